"""When a generation ends: at an EOS or stop token id (which is kept as the last token), or at
max_tokens; a stop id ends it only from min_tokens tokens on (the samplers also mask those ids
until then, `shared.engine.sampling.masked`; this rule covers engines without logits). One rule
for the decode service, the colocated baseline and the CLI."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from shared.engine.protocol import DecodeSession

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class StopRule:
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # the model's EOS ids and the request's own
    min_tokens: int = 0  # before this many tokens no stop id ends the generation

    @classmethod
    def of(
        cls,
        max_tokens: int,
        eos: frozenset[int],
        extra: Sequence[int] = (),
        *,
        ignore_eos: bool = False,
        min_tokens: int = 0,
    ) -> StopRule:
        return cls(max_tokens, frozenset(int(t) for t in extra) | (frozenset() if ignore_eos else eos), min_tokens)

    def finish(self, token: int, count: int) -> FinishReason | None:
        """Why generation ends after `count` tokens, the last being `token` (None: it goes on)."""
        if token in self.stop_token_ids and count >= self.min_tokens:
            return "stop"
        return "length" if count >= self.max_tokens else None


def steps(decode: DecodeSession, n: int, rule: StopRule, generated: int) -> tuple[list[int], FinishReason | None]:
    """Up to `n` more tokens after `generated` ones; fewer when the rule ends the generation."""
    ids: list[int] = []
    for _ in range(n):
        token = decode.step()
        ids.append(token)
        reason = rule.finish(token, generated + len(ids))
        if reason is not None:
            return ids, reason
    return ids, None
