"""The `paged` engine: a hybrid checkpoint's own weights, run by the project's own torch math,
with every request's state only in the paged blocks and decode steps batched across requests,
batch-invariant by construction (see tiles.py)."""
