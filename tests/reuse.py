"""Decode's prefix reuse (prefix cache and state checkpoints) is on by default: it keeps finished
prompts' blocks. Fixtures whose tests check that decode frees every block after its requests,
or count the bytes a READ moves, start decode with `REUSE_OFF`; a test that wants reuse passes
its own `--prefix-cache-blocks` after it (the last flag wins)."""

REUSE_OFF = ("--prefix-cache-blocks", "0")
