"""What identifies a checkpoint: its config's content and its weights, never where it lies.

The digest covers config.json (parsed and re-serialised with sorted keys, so formatting does
not matter) and every *.safetensors file: its header (tensor names, dtypes, shapes, offsets)
and its data. Files up to `FULL_HASH_LIMIT` are hashed whole; larger ones by evenly spaced
samples plus their last bytes, so a multi-GB model starts in seconds while a fine-tune (which
changes every tensor) or a different checkpoint is still told apart. Two directories holding
the same files give the same digest; file and directory names do not enter it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from shared.layout.spec import LayoutError

FULL_HASH_LIMIT = 1 << 30
SAMPLES = 256
SAMPLE_BYTES = 64 << 10
_CHUNK = 8 << 20


class CheckpointError(LayoutError):
    """A checkpoint directory that cannot be served; the message names the file or key."""


def _config_blob(directory: Path) -> bytes:
    path = directory / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    return json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()


def _safetensors_digest(path: Path) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path.name}: not a safetensors file (shorter than its header length)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CheckpointError(f"{path.name}: header length {header_len} runs past the end of the file")
        h.update(head + f.read(header_len))
        if size <= FULL_HASH_LIMIT:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        else:
            data_start, data_len = 8 + header_len, size - 8 - header_len
            for i in range(SAMPLES):
                f.seek(data_start + (data_len - SAMPLE_BYTES) * i // (SAMPLES - 1))
                h.update(f.read(SAMPLE_BYTES))
            f.seek(max(data_start, size - SAMPLE_BYTES))
            h.update(f.read())
    return h.digest()


def checkpoint_digest(directory: str | os.PathLike[str]) -> str:
    """Hex SHA-256 naming this checkpoint's config content and weights."""
    root = Path(directory)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors weights in the checkpoint directory")
    h = hashlib.sha256(b"hybrid-pd checkpoint v1\0")
    h.update(_config_blob(root))
    # Sorted by content digest, not name: renaming shards does not change the model.
    for digest in sorted(_safetensors_digest(f) for f in files):
        h.update(digest)
    return h.hexdigest()
