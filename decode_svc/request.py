"""One valid Generate request: the servicer's `GenerateRequest` checked once, every problem
naming its field, and turned into the `RequestContext` the rest of the decode path reads."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from decode_svc import tokenizer
from decode_svc.learned_peers import remote_prefill_of
from decode_svc.peer_link import PeerLink
from decode_svc.request_options import decode_options
from shared import limits
from shared.engine.sampling import SamplingParams
from shared.engine.stopping import StopRule
from shared.errors import InvalidArgument
from shared.http.kv_transfer import RemotePrefill
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.rpc.token_ids import token_array
from shared.runtime.engine_host import EngineHost

DEFAULT_TIMEOUT_SECONDS = 300.0  # when the client set no deadline


@dataclass(frozen=True)
class RequestContext:
    """One valid Generate request, as the servicer hands it to `Generation.run`."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    prompt_field: str  # the request field the prompt came from, for messages
    deadline: float  # event-loop time: the client's deadline, or DEFAULT_TIMEOUT_SECONDS from arrival
    started: float  # time.monotonic() at arrival
    sampling: SamplingParams  # the seed already picked when the request gave none
    stop: StopRule  # max_tokens, the model's EOS ids (unless ignore_eos) and the request's stop ids
    # The decode leg of vLLM's P/D protocol: the prefill engine and pinned request that
    # kv_transfer_params name (None: this engine picks a prefill peer and sends a job).
    remote: RemotePrefill | None = None
    logprobs: int | None = None  # None: none; k: each token's logprob and the k likeliest
    prompt_logprobs: int | None = None  # None: none; k: the prompt's, from prefill
    n: int = 1  # sequences from the one prompt (decode_svc/forks.py)
    stream_interval: int = 1  # tokens a stream coalesces before it sends (--stream-interval; the first goes alone)


def validate(host: EngineHost, request: pb.GenerateRequest, time_remaining: float | None) -> RequestContext:
    """The request once as a `RequestContext`: every problem names its field; nothing is
    touched before this passes. `time_remaining`: the call's deadline (None: none set)."""
    started = time.monotonic()
    loop_now = asyncio.get_running_loop().time()
    if request.prompt and request.prompt_token_ids:
        raise InvalidArgument("give either prompt or prompt_token_ids, not both", field="prompt")
    ids: list[int] | npt.NDArray[np.int64]  # what the vocabulary check reads: the list itself, or the field's one numpy copy
    if request.prompt:
        prompt = ids = tokenizer.for_engine(host.engine).encode(request.prompt)
    else:
        ids = token_array(request.prompt_token_ids)
        prompt = ids.tolist()
    prompt_field = "prompt" if request.prompt else "prompt_token_ids"
    if not prompt:
        raise InvalidArgument("the prompt is empty", field="prompt")
    host.check_token_ids(ids, "prompt_token_ids")
    limits.check_request(request)  # max_tokens >= 1; sampling's floats finite and within float32
    total = len(prompt) + request.max_tokens
    capacity = host.max_tokens()
    if len(prompt) >= capacity:
        raise InvalidArgument(
            f"{len(prompt)} tokens; this decode engine's cache holds at most {capacity} tokens per request, "
            "prompt and generated tokens together",
            field=prompt_field,
        )
    if total > capacity:
        raise InvalidArgument(
            f"prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) = {total} tokens; "
            f"this decode engine's cache holds at most {capacity} tokens per request",
            field="max_tokens",
        )
    request_id = request.request_id or uuid.uuid4().hex
    if len(request_id) > 128:
        raise InvalidArgument("must be at most 128 characters", field="request_id")
    remote = remote_prefill_of(request.kv_transfer_params)
    prompt_logprobs = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and remote is not None:
        raise InvalidArgument(
            "not with kv_transfer_params: the prefill leg computed the prompt without them", field="prompt_logprobs"
        )
    n = max(1, request.n)
    if n > 1 and remote is not None:
        raise InvalidArgument("more than one sequence is not served for a P/D decode leg (kv_transfer_params)", field="n")
    if n > 1:
        check_sequences_fit(host, len(prompt), request.max_tokens, n)
    if prompt_logprobs is not None and not host.engine.samples:
        raise InvalidArgument(f"this engine ({host.engine.spec.name}) has no logits of the prompt", field="prompt_logprobs")
    deadline = loop_now + (time_remaining if time_remaining is not None else DEFAULT_TIMEOUT_SECONDS)
    options = decode_options(request, host.engine)
    return RequestContext(
        request_id,
        prompt,
        request.max_tokens,
        prompt_field,
        deadline,
        started,
        options.sampling,
        options.stop,
        remote,
        request.logprobs if request.HasField("logprobs") else None,
        prompt_logprobs,
        n,
    )


def check_sequences_fit(host: EngineHost, prompt_len: int, max_tokens: int, n: int) -> None:
    """n sequences of a prompt must fit the cache together (sharing the prompt's full attention
    blocks, decode_svc/forks.py), or they would wait for each other's blocks until the deadline."""
    layout = host.layout
    each = sum(host.blocks_per_group(prompt_len + max_tokens))
    shared = host.engine.num_prefill_tokens(prompt_len) // layout.block_size * len(layout.attention_group_ids)
    needed = n * each - (n - 1) * shared
    if needed > host.num_blocks:
        raise InvalidArgument(
            f"{n} sequences of up to {prompt_len + max_tokens} tokens need {needed} cache blocks together; this decode "
            f"engine has {host.num_blocks}: ask for fewer sequences or fewer max_tokens",
            field="n",
        )


def check_fits_prefill(host: EngineHost, link: PeerLink, req: RequestContext) -> None:
    """A prompt whose prefilled state cannot fit the chosen prefill engine's whole cache."""
    remote = link.remote
    needed = sum(link.plan.prefill.blocks_per_group(host.engine.num_prefill_tokens(len(req.prompt))))
    if needed > remote.num_logical_blocks:
        raise InvalidArgument(
            f"{len(req.prompt)} tokens need {needed} blocks on prefill {remote.engine_id}, whose cache has "
            f"{remote.num_logical_blocks}",
            field=req.prompt_field,
        )
