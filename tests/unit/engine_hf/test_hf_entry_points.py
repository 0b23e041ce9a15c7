"""How a user reaches the hf engine: flags, the colocated CLI, the tokenizer, EOS, bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from hybridpd_tools.cli.main import main
from shared.config import parse_settings
from shared.engine.hf.checkpoint import HfCheckpoint
from shared.engine.hf.colocated import colocated_generate
from shared.engine.hf.engine import HfEngine
from shared.engine.hf.identity import CheckpointError
from shared.engine.hf.tiny_checkpoints import EOS_TOKEN
from shared.engine.hf.tokenizer import HfTokenizer
from shared.errors import InvalidArgument
from shared.layout.page import build_engine_layout
from shared.runtime.engine_host import engine_factory_for, layout_for
from tests.unit.engine_hf.helpers import checkpoint, spec_of


def test_service_flags_select_the_hf_engine(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("granitemoehybrid")
    settings = parse_settings("prefill", ["--engine", "hf", "--model", directory, "--dtype", "bf16", "--tp", "2"], environ={})
    assert (settings.engine, settings.dtype) == ("hf", "bf16")
    layout = layout_for(settings)
    assert (layout.spec.kv_dtype, layout.spec.ssm_dtype, layout.tp) == ("bf16", "fp32", 2)
    assert layout.spec.checkpoint_digest
    with pytest.raises(SystemExit):
        parse_settings("prefill", ["--engine", "hf", "--dtype", "fp8"], environ={})
    bad = parse_settings("prefill", ["--engine", "hf", "--model", "tiny-mamba2"], environ={})
    with pytest.raises(InvalidArgument, match="checkpoint directory") as err:
        layout_for(bad)
    assert err.value.fields == ("--model",)
    with pytest.raises(InvalidArgument, match="needs --model DIR"):
        engine_factory_for("hf")(layout, [])


def test_tokenizer_text_round_trip_and_eos(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("qwen3_5_text")
    tok = HfTokenizer(directory)
    ids = tok.encode("Hello world, the quick brown fox")
    assert 1 < len(ids) < len("Hello world, the quick brown fox")  # merges, not bytes
    assert tok.decode(ids) == "Hello world, the quick brown fox"
    ckpt = checkpoint(directory)
    eos = tok.encode(EOS_TOKEN)
    assert ckpt.eos_token_ids == frozenset(eos) == frozenset({1})
    free = colocated_generate(ckpt, ids, 12, stop_at_eos=False)
    assert 1 not in free.token_ids  # so the next check is about our generation_config below
    assert colocated_generate(ckpt, ids, 12).finish_reason == "length"


def test_generation_stops_at_the_eos_ids_of_generation_config(hf_checkpoint: Callable[[str], str], tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("qwen3_5_text"), directory)
    prompt = HfTokenizer(str(directory)).encode("Hello world")
    free = colocated_generate(HfCheckpoint(str(directory), dtype="fp32"), prompt, 12, stop_at_eos=False).token_ids
    eos = free[3]
    cfg = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps(cfg | {"eos_token_id": [1, eos]}))
    ckpt = HfCheckpoint(str(directory), dtype="fp32")
    assert ckpt.eos_token_ids == frozenset({1, eos})
    stopped = colocated_generate(ckpt, prompt, 12)
    assert stopped.token_ids == free[: free.index(eos) + 1] and stopped.finish_reason == "stop"
    # min_tokens masks the EOS ids in the sampler until then: the same tokens up to the EOS, then others.
    kept = colocated_generate(ckpt, prompt, 12, min_tokens=6)
    assert kept.token_ids[:3] == free[:3] and not {1, eos} & set(kept.token_ids[:6]) and len(kept.token_ids) >= 6
    assert kept.token_ids[3] != eos
    with pytest.raises(ValueError, match="min_tokens"):
        colocated_generate(ckpt, prompt, 4, min_tokens=5)


def test_generate_colocated_with_the_hf_engine(
    hf_checkpoint: Callable[[str], str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    directory = hf_checkpoint("falcon_h1")
    assert (
        main(
            [
                "generate",
                "--colocated",
                "--engine",
                "hf",
                "--model",
                directory,
                "--prompt",
                "hello world",
                "--max-tokens",
                "6",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    prompt = HfTokenizer(directory).encode("hello world")
    want = colocated_generate(checkpoint(directory), prompt, 6, boundary="full")
    assert out["token_ids"] == want.token_ids and out["prompt_token_count"] == len(prompt)
    assert out["text"] == HfTokenizer(directory).decode(want.token_ids)
    assert main(["generate", "--colocated", "--engine", "hf", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 1
    assert "INVALID_ARGUMENT: --model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:  # out of range: refused by the flag's parser, one line, exit 2
        main(["generate", "--colocated", "--engine", "hf", "--model", directory, "--prompt", "x", "--top-p", "0"])
    assert bad.value.code == 2 and "--top-p" in capsys.readouterr().err


def test_a_checkpoint_missing_weights_is_refused(hf_checkpoint: Callable[[str], str], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("bamba"), directory)
    weights = load_file(str(directory / "model.safetensors"))
    dropped = sorted(k for k in weights if k.endswith("mamba.A_log"))[0]
    del weights[dropped]
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    # transformers would initialise it at random, differently in prefill and decode.
    with pytest.raises(CheckpointError, match=r"1 weights missing.*A_log"):
        HfCheckpoint(str(directory), dtype="fp32")


def test_layer_kinds_must_be_transformers_cache_layers(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("jamba")
    spec = spec_of(directory)
    swapped = dataclasses.replace(spec, layer_kinds=tuple(reversed(spec.layer_kinds)))
    layout = build_engine_layout(swapped, 1)
    with pytest.raises(ValueError, match=r"layer 0 is 'attention' in config\.json but transformers caches it as"):
        HfEngine(layout, [], checkpoint(directory))


_REPLACEMENT = "\ufffd"  # what a decode shows for an incomplete UTF-8 sequence


def test_streamed_text_is_the_whole_text(hf_checkpoint: Callable[[str], str]) -> None:
    tok = HfTokenizer(hf_checkpoint("nemotron_h"))
    text = "Hello wörld, ünïcode 🦊 again"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    stream = tok.stream()
    pieces = [stream.feed([i]) for i in ids]
    assert "".join(pieces) + stream.finish() == text
    assert _REPLACEMENT not in "".join(pieces)  # a split character waits for its other bytes
    assert "" in pieces  # negative control: some token really ended inside a character
    chunked = tok.stream()
    assert "".join(chunked.feed(ids[i : i + 3]) for i in range(0, len(ids), 3)) + chunked.finish() == text


def test_a_stream_ending_inside_a_character_shows_it_as_the_full_decode_does(hf_checkpoint: Callable[[str], str]) -> None:
    tok = HfTokenizer(hf_checkpoint("nemotron_h"))
    ids = tok.encode("ok 🦊")
    stream = tok.stream()
    head = stream.feed(ids[:-1])  # the fox's last byte never comes
    assert head + stream.finish() == tok.decode(ids[:-1])
    assert tok.decode(ids[:-1]).endswith(_REPLACEMENT)
