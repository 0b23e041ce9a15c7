"""The checks of a request's state before decoding from it: what the READs left in its blocks
must have the digests prefill took of what it wrote (`--verify-transfer`, on by default), and
with --check-state decode recomputes the prompt's state itself and compares."""

from __future__ import annotations

from dataclasses import dataclass, field

from decode_svc.peer_link import PeerLink
from decode_svc.state_checkpoints import Compute
from shared.cache.digest import SECTIONS, Section, compare_digests, state_digests
from shared.cache.manifest import Manifest
from shared.engine.protocol import RequestBlocks
from shared.errors import DataLoss
from shared.observe import Count, Observer
from shared.otel import spans
from shared.runtime.engine_host import EngineHost


@dataclass(frozen=True)
class StateChecks:
    host: EngineHost
    check_state: bool  # --check-state: recompute the prompt and compare
    observer: Observer = field(default_factory=Observer)

    @spans.traced(spans.DIGEST_CHECK)
    async def digests(self, run: Compute, request_id: str, manifest: Manifest, link: PeerLink, local: RequestBlocks) -> None:
        """What the READs left in our blocks must have the digests prefill took of what it wrote
        (that they are there, of our kind, was checked when the manifest arrived)."""
        expected = list(manifest.digests)
        layout, views, n, start = self.host.layout, self.host.views, manifest.tokens_to, manifest.tokens_from
        source = link.plan.prefill
        # A part before the last chunk: its K/V only; a layer part: its layers only.
        sections: tuple[Section, ...] = SECTIONS if manifest.ends_prompt else ("fa",)
        layers = manifest.layers
        got = await run(
            lambda: state_digests(
                layout, views, local.block_ids, n, source=source, tokens_from=start, sections=sections, layers=layers
            )
        )
        bad = compare_digests(layout, expected, got, layers=layers)
        if not bad:
            return
        for m in bad:
            self.observer.count(Count.DIGEST_MISMATCH, kind=m.section)
        readers = {
            p: [r.decode_rank for r in link.plan.ranks if any(x.prefill_rank == p for x in r.reads)] for p in range(source.tp)
        }
        shown = "; ".join(f"{m.describe()}, read by decode ranks {readers[m.rank]}" for m in bad[:5])
        which = "" if manifest.part is None else f" ({manifest.part.describe()})"
        raise DataLoss(
            f"request {request_id}: the state READ from prefill {link.engine_id}{which} differs from what it wrote in "
            f"{len(bad)} digests: {shown}",
            field="manifest.digests",
            reason="DIGEST_MISMATCH",
        )

    async def recompute(self, run: Compute, prompt: list[int], num_computed: int, local: RequestBlocks, link: PeerLink) -> None:
        """--check-state: the state in `local` against decode's own computation of the prompt, in
        the chunks `link`'s prefill engine computed it in (they decide the bits of some engines)."""
        chunk = link.remote.prefill_chunk_tokens
        mismatches = await run(lambda: self.host.engine.check_state(prompt, num_computed, local, chunk_tokens=chunk))
        if mismatches:
            shown = "; ".join(mismatches[:5])
            raise DataLoss(f"transferred state differs from prefill's in {len(mismatches)} places: {shown}")
