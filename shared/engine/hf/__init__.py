"""The `hf` engine: Hugging Face hybrid checkpoints run by transformers on the paged caches.

checkpoint        a checkpoint directory loaded for serving (model, EOS ids, one forward)
cache_state       transformers' cache <-> the layout's state (conv K vs K-1, GDN transpose)
engine            HfEngine / HfDecodeSession: prefill into blocks, decode from blocks
colocated         the one-process baseline (same split, one cache, no blocks)
model_spec        the ModelSpec served: lossless state dtypes, checkpoint digest
identity          the checkpoint digest (config content + weights)
tokenizer         text <-> ids with the checkpoint's tokenizer
tiny_checkpoints  seeded tiny checkpoints of every family, built offline (tests, demos)
"""
