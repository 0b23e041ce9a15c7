"""The first output token ahead of the manifest (the full-N boundary).

Prefill draws output token 0 right after the prompt's forward; its digests, its pin and the
manifest come after. A job that asks (`PrefillJob.accept_first_token`) gets that token in a
message of its own the moment it is drawn, and decode streams it to the client at once, so the
time to first token holds neither prefill's digest pass over the state nor building the manifest.

A token that ends the request (a stop token, max_tokens 1) needs no state: decode cancels the job
at once and sends its summary, without waiting for the manifest.

The manifest that follows repeats the token, and the two must be equal. A job that fails after
the token left may still go to another prefill engine (decode_svc/prefill_retry.py): that
engine computes the same prompt with the same sampling, so it draws the same token, and the
check says so; the client never gets the token twice.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from decode_svc.peer_link import PeerLink
from shared.engine.logprobs import TokenLogprobs
from shared.errors import Internal


class EarlyToken:
    """One request's first token as prefill sent it ahead of the manifest, and whether it went out."""

    def __init__(self) -> None:
        self.arrived: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.sent = False  # streamed to the client: the manifest's token is not sent again
        self.link: PeerLink | None = None  # of the prefill engine that drew it
        self.engine_seconds = 0.0  # that engine's own model calls for the prompt (0: it did not say)
        self._arrived_at = 0.0
        self.logprobs: TokenLogprobs | None = None  # the token's, when the job asked

    def take(self, link: PeerLink, token: int, engine_seconds: float, logprobs: TokenLogprobs | None) -> None:
        """The session's sink: the first token to arrive counts (a retried job's is the same)."""
        if not self.arrived.done():
            self.arrived.set_result(token)
            self.link, self.engine_seconds, self._arrived_at = link, engine_seconds, time.monotonic()
            self.logprobs = logprobs

    async def first(self, job: asyncio.Future[Any]) -> int | None:
        """Wait for the first token or the end of `job`, whichever comes first: the token (from
        then on it counts as sent to the client), or None when the job ended without one."""
        await asyncio.wait((job, self.arrived), return_when=asyncio.FIRST_COMPLETED)
        if not self.arrived.done():
            return None
        self.sent = True
        return self.arrived.result()

    def seconds_after(self, started: float) -> float:
        """From `started` (the job sent) to the token's arrival."""
        return self._arrived_at - started

    def check(self, manifest_token: int | None, peer: str) -> None:
        """The manifest's first token must be the one already streamed."""
        if self.sent and manifest_token != self.arrived.result():
            raise Internal(
                f"prefill {peer} sent first token {manifest_token} in its manifest, but the client was already sent "
                f"first token {self.arrived.result()}",
                field="manifest.first_token_id",
                reason="FIRST_TOKEN_MISMATCH",
            )
