"""`bench e2e --workload multi-turn`: conversations whose every turn extends the previous one.

Turn 1's prompt is `first_turn_tokens` random tokens; turn t+1's prompt is turn t's prompt, its
answer (the disaggregated setup's `max_tokens` tokens) and a new user message of `turn_tokens`
random tokens. Each turn goes to both setups (setups.py) with the same prompt, alternating which
goes first. Per turn: prompt tokens, new tokens (what the turn added to the conversation: the
whole prompt at turn 1, then the previous answer and the new message), the tokens and bytes decode
read from prefill (attention K/V, conv and SSM separately, as the decode service reports them),
TTFT in both setups and whether both generated the same tokens.

This is the baseline decode-side prefix reuse will be measured against: today decode keeps
nothing of a finished request, so every turn reads the attention K/V of the whole prompt again
and the attention bytes per new token grow with the conversation; with reuse only the new
tokens' blocks (plus the state at the end of the prompt) would move, about `attention bytes per
transferred token x new tokens` (`attention_bytes_if_only_new`). With `prefill_chunk_tokens` the
pair transfers in manifest parts (pipelined transfer), which with the prefix cache cover only the
tokens after the cached prefix; `reads` counts the READs (rank pairs x parts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from hybridpd_tools.bench.client import Timed, generate, seconds
from hybridpd_tools.bench.progress import Progress
from hybridpd_tools.bench.setups import SETUPS, SetupConfig, flat_config, model_spec, start_setups
from hybridpd_tools.bench.stats import Summary, fixed, json_number, megabytes, ms_summary, ratio
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc

SCHEMA = "hybrid-pd.bench.e2e.multi-turn/v1"


@dataclass(frozen=True)
class MultiTurnConfig:
    setup: SetupConfig
    turns: int = 4
    conversations: int = 2
    first_turn_tokens: int = 2048
    turn_tokens: int = 256  # each later turn's new user message
    max_tokens: int = 32  # each answer
    warmup: int = 1  # unmeasured requests per setup first, at the first turn's length
    seed: int = 0
    prefix_cache_blocks: int = 0  # decode's prefix cache and prefill's boundary cache (0: off, the baseline)

    def longest_prompt(self) -> int:
        return self.first_turn_tokens + (self.turns - 1) * (self.max_tokens + self.turn_tokens)


@dataclass
class Turn:
    """One turn of one conversation, generated on both setups."""

    conversation: int
    turn: int  # 1-based
    prompt_tokens: int
    new_tokens: int
    results: dict[str, Timed] = field(default_factory=dict)


def _tokens(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


async def run_multi_turn(cfg: MultiTurnConfig, *, command: str, show_progress: bool = True) -> dict[str, Any]:
    spec = model_spec(cfg.setup.model, cfg.setup.engine)
    rng = np.random.default_rng(cfg.seed)
    progress = Progress("bench e2e multi-turn", 2 * (cfg.warmup + cfg.turns * cfg.conversations), enabled=show_progress)
    progress.advance(0, "starting services")
    turns: list[Turn] = []
    try:
        async with start_setups(
            spec,
            cfg.setup,
            prompt_tokens=cfg.longest_prompt(),
            max_tokens=cfg.max_tokens,
            name="bench-multi-turn",
            prefix_cache_blocks=cfg.prefix_cache_blocks,
            unpipelined=False,
        ) as running:
            channels = {s: grpc.aio.insecure_channel(a) for s, a in running.addresses.items()}
            stubs = {s: pb_grpc.DecodeServiceStub(c) for s, c in channels.items()}
            try:
                for _ in range(cfg.warmup):  # lazy initialisation and wire-up: not measured
                    prompt = _tokens(rng, spec.vocab_size, cfg.first_turn_tokens)
                    for setup in SETUPS:
                        await generate(stubs[setup], prompt, cfg.max_tokens, ignore_eos=True)
                        progress.advance(1, f"warmup {setup}")
                for k in range(cfg.conversations):
                    prompt = _tokens(rng, spec.vocab_size, cfg.first_turn_tokens)
                    new = len(prompt)
                    for t in range(1, cfg.turns + 1):
                        turn = Turn(k, t, len(prompt), new)
                        for setup in SETUPS if (k + t) % 2 == 0 else SETUPS[::-1]:
                            turn.results[setup] = await generate(stubs[setup], prompt, cfg.max_tokens, ignore_eos=True)
                            progress.advance(1, f"conversation {k + 1} turn {t} {setup}")
                        turns.append(turn)
                        answer = turn.results["disaggregated"]
                        if answer.error:
                            break  # the conversation cannot go on without its answer
                        message = _tokens(rng, spec.vocab_size, cfg.turn_tokens)
                        prompt = prompt + answer.token_ids + message
                        new = len(answer.token_ids) + len(message)
            finally:
                for channel in channels.values():
                    await channel.close()
    finally:
        progress.finish()
    return build_multi_turn_result(cfg, turns, command)


def turn_row(t: int, turns: Sequence[Turn]) -> dict[str, Any]:
    """The figures of turn `t`, over the conversations (their sizes are equal: answers never stop early)."""
    errors = [r.error for x in turns for r in x.results.values() if r.error]
    ok = [x for x in turns if len(x.results) == len(SETUPS) and all(not r.error for r in x.results.values())]
    d = [x.results["disaggregated"] for x in ok]
    c = [x.results["colocated"] for x in ok]
    summaries = [r.summary for r in d if r.summary is not None]
    first = summaries[0] if summaries else None
    transferred = first.num_transferred_tokens if first else 0
    attention = first.transfer.attention_bytes if first else None
    new = turns[0].new_tokens if turns else 0
    read_tokens = transferred - (first.prefix_cached_tokens if first else 0)  # the K/V the READ moved
    per_token = attention / read_tokens if attention is not None and read_tokens else math.nan
    d_ttft, c_ttft = Summary.of([r.ttft for r in d]).median, Summary.of([r.ttft for r in c]).median
    return {
        "turn": t,
        "conversations": len(turns),
        "errors": errors[:5],
        "prompt_tokens": turns[0].prompt_tokens if turns else None,
        "new_tokens": new,
        "transferred_tokens": transferred if first else None,
        "prefix_cached_tokens": first.prefix_cached_tokens if first else None,
        "bytes": {
            "attention": attention,
            "conv": first.transfer.conv_bytes if first else None,
            "ssm": first.transfer.ssm_bytes if first else None,
            "total": first.transfer.total_bytes if first else None,
        },
        "attention_bytes_per_new_token": json_number(attention / new if attention is not None and new else math.nan),
        "attention_bytes_if_only_new": json_number(per_token * min(new, transferred)),  # turn 1: all of it
        "attention_bytes_per_read_token": json_number(per_token),
        "ttft_ms": {"disaggregated": ms_summary([r.ttft for r in d]), "colocated": ms_summary([r.ttft for r in c])},
        "ttft_ratio": json_number(ratio(d_ttft, c_ttft)),
        "read_ms": ms_summary([seconds(s.read_duration) for s in summaries]),
        # Prefill's own compute of the prompt: with its boundary cache, only the chunks after the kept boundary.
        "prefill_engine_ms": ms_summary([seconds(s.prefill_engine_duration) for s in summaries]),
        "reads": first.transfer.read_count if first else None,  # one per rank pair and manifest part
        "digest_check_ms": ms_summary([seconds(s.digest_check_duration) for s in summaries]),
        "tokens_match": f"{sum(a.token_ids == b.token_ids for a, b in zip(d, c))}/{len(turns)}",
    }


def build_multi_turn_result(cfg: MultiTurnConfig, turns: Sequence[Turn], command: str) -> dict[str, Any]:
    rows = [turn_row(t, [x for x in turns if x.turn == t]) for t in range(1, cfg.turns + 1)]
    rows = [r for r in rows if r["conversations"]]  # a turn no conversation reached has no figures
    attention = [r["bytes"]["attention"] for r in rows if r["bytes"]["attention"] is not None]
    later = [r for r in rows if r["turn"] > 1 and r["bytes"]["attention"] is not None]
    moved = sum(r["bytes"]["attention"] for r in later)
    needed = sum(r["attention_bytes_if_only_new"] or 0 for r in later)
    return {
        "schema": SCHEMA,
        "command": command,
        "config": flat_config(cfg),
        "turns": rows,
        # Turns 2..K: attention bytes read against those of the new tokens only (what prefix reuse would read).
        "later_turns": {
            "attention_bytes": moved if later else None,
            "attention_bytes_if_only_new": json_number(needed) if later else None,
            "reuse_would_save_share": json_number(1 - needed / moved) if later and moved else None,
            "last_over_first_turn_attention_bytes": json_number(ratio(attention[-1], attention[0]))
            if len(attention) > 1
            else None,
        },
    }


def format_multi_turn(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"bench e2e --workload multi-turn: {c['model']} ({c['engine']} engine), prefill TP {c['prefill_tp']} -> "
        f"decode TP {c['decode_tp']}, {c['conversations']} conversations of {c['turns']} turns: "
        f"{c['first_turn_tokens']} tokens first, then +{c['max_tokens']} answer +{c['turn_tokens']} message per turn",
        "",
        f"{'turn':>4} {'prompt':>7} {'new':>6} {'read tok':>8} {'cached':>7} {'FA MB':>8} {'conv MB':>8} {'SSM MB':>8} "
        f"{'FA B/new tok':>12} {'FA MB if new':>12} {'TTFT d ms':>10} {'TTFT c ms':>10} {'d/c':>6} {'READ ms':>8} {'READs':>5} {'same':>5}",
    ]
    for r in result["turns"]:
        b = r["bytes"]
        lines.append(
            f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['new_tokens']:>6} {r['transferred_tokens'] or '-':>8} {r.get('prefix_cached_tokens') or 0:>7} "
            f"{megabytes(b['attention']):>8} {megabytes(b['conv']):>8} {megabytes(b['ssm']):>8} {fixed(r['attention_bytes_per_new_token'], 0):>12} "
            f"{megabytes(r['attention_bytes_if_only_new']):>12} {fixed(r['ttft_ms']['disaggregated']['median'], 1):>10} "
            f"{fixed(r['ttft_ms']['colocated']['median'], 1):>10} {fixed(r['ttft_ratio'], 3):>6} "
            f"{fixed(r['read_ms']['median'], 2):>8} {r.get('reads') or '-':>5} {r['tokens_match']:>5}"
            + (f"  errors: {r['errors']}" if r["errors"] else "")
        )
    x = result["later_turns"]
    share = x["reuse_would_save_share"]
    reuse = (
        [
            f"Decode's prefix cache on ({c['prefix_cache_blocks']} blocks): each turn reads K/V after the cached prefix only",
            "('cached': prompt tokens whose K/V decode held; 'FA MB if new': reading only the new tokens; the rest is",
            "the previous prompt's partly filled last block and its last token, which decode computed itself).",
        ]
        if c.get("prefix_cache_blocks")
        else [
            "No decode-side prefix reuse (--prefix-cache-blocks 0): every turn reads the attention K/V of its whole prompt,",
            "so FA bytes per new token grow with the conversation ('FA MB if new': what reading only the new tokens would move).",
        ]
    )
    chunks = c.get("prefill_chunk_tokens")
    pipelined = (
        [f"Pipelined transfer (--prefill-chunk-tokens {chunks}): 'READs' counts one per rank pair and manifest part."]
        if chunks
        else []
    )
    lines += [
        "",
        *reuse,
        *pipelined,
        f"turns 2..{c['turns']}: {megabytes(x['attention_bytes'])} MB of attention read, {megabytes(x['attention_bytes_if_only_new'])} MB "
        f"for the new tokens alone ({fixed(None if share is None else 100 * share, 1)} % "
        + ("beyond them)" if c.get("prefix_cache_blocks") else "would be saved)"),
    ]
    return "\n".join(lines)
