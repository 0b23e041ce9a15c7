"""`--engine hf` chat: the checkpoint's own tokenizer chat template, else the byte template."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shared.engine.hf.chat_template import HfChatTemplate
from shared.engine.hf.tiny_checkpoints import build_tokenizer
from shared.engine.hf.tokenizer import HfTokenizer
from shared.http.chat_template import BYTE_TEMPLATE, template_for
from shared.http.params import ChatMessage
from tests.unit.engine_hf import helpers

MESSAGES = [
    ChatMessage("system", "You are terse."),
    ChatMessage("user", "Hello"),
    ChatMessage("assistant", "Hi."),
    ChatMessage("user", "Again"),
]
NO_TEMPLATE = "has no chat template"


def strip_chat_template(directory: Path) -> None:
    """What a checkpoint without a template looks like: neither its own file nor a
    tokenizer_config.json key (where older transformers versions keep it)."""
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config), encoding="utf-8")


def test_the_checkpoint_template_renders_what_apply_chat_template_gives(tmp_path: Path) -> None:
    build_tokenizer(str(tmp_path))
    template = HfTokenizer(str(tmp_path)).chat_template
    assert isinstance(template, HfChatTemplate)
    conversation = [{"role": m.role, "content": m.content} for m in MESSAGES]
    want = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True).apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    got = template.render(MESSAGES)
    assert got == want
    assert got.endswith("<|im_start|>assistant\n")  # the generation prompt
    assert got != BYTE_TEMPLATE.render(MESSAGES)  # negative control: not the byte template


def test_the_hf_engine_brings_its_checkpoint_template(
    hf_checkpoint: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="shared.engine.hf.engine"):
        engine = helpers.engine(hf_checkpoint("bamba"), 1)
    assert isinstance(engine.chat_template, HfChatTemplate)
    assert template_for(engine) is engine.chat_template
    assert not [r for r in caplog.records if NO_TEMPLATE in r.getMessage()]


def test_a_checkpoint_without_a_template_falls_back_to_the_byte_template_and_says_so(
    hf_checkpoint: Callable[[str], str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "no-template"
    shutil.copytree(hf_checkpoint("bamba"), directory)
    strip_chat_template(directory)
    with caplog.at_level(logging.INFO, logger="shared.engine.hf.engine"):
        engine = helpers.engine(str(directory), 1)
    assert engine.chat_template is None
    assert template_for(engine) is BYTE_TEMPLATE
    said = [r for r in caplog.records if NO_TEMPLATE in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and str(directory) in said[0].getMessage()
