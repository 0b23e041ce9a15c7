"""The value types of the services' flags: each turns a flag's text into a value or raises
ValueError saying what it expects (the caller names the flag and where the text came from)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a port number 0..65535 (0: pick a free port)")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """`1073741824`, `512MiB`, `8GiB`, `1.5G` (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise ValueError("expected a byte count such as 1073741824, 512MiB or 8GiB")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value < 1:
        raise ValueError("must be at least one byte")
    return value


def host_port(text: str) -> str:
    """`HOST:PORT` (IPv6 as `[::1]:PORT`)."""
    m = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d+)", text.strip())
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ValueError("expected HOST:PORT, for example 127.0.0.1:50051")
    return text.strip()


def advertise_address(text: str) -> str:
    """`HOST` or `HOST:PORT` (IPv6 in brackets when a port follows: `[fd00::1]:50051`)."""
    host, port = split_advertised(text)
    if not host or (port is not None and not 0 < port < 65536):
        raise ValueError("expected HOST or HOST:PORT, for example prefill-0.example or 10.0.0.7:50051")
    return text


def split_advertised(text: str) -> tuple[str, int | None]:
    """`HOST[:PORT]` -> (host without brackets, port or None)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, int(port)
    return text, None  # a bare name, IPv4 or IPv6 address


def model_name(text: str) -> str:
    name = text.strip()
    if not name:
        raise ValueError("must not be empty")
    return name


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must be >= 0")
    return value


def existing_file(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    return path


def engine_id_text(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", text):
        raise ValueError("use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return text


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true/false (1/0, yes/no, on/off)")


def choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return text

    parse.options = options  # type: ignore[attr-defined]  # read by build_parser for the metavar
    return parse
