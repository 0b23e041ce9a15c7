"""`decode-svc` / `python -m decode_svc`: run the decode service until SIGTERM."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from decode_svc.app import DecodeApp
from shared.config import ServiceSettings, parse_settings
from shared.runtime.engine_host import engine_factory_for
from shared.runtime.process import run_service


async def serve(settings: ServiceSettings) -> None:
    app = await DecodeApp.start(settings, engine_factory_for(settings.engine, settings))
    await app.shell.run_until_signal(app.stop)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service(parse_settings("decode", argv), serve)


if __name__ == "__main__":
    sys.exit(main())
