"""Pure layout math for hybrid SSM + attention models (numpy only, no I/O but reading a config.json).

spec        ModelSpec and the dims of each SSM family
hf_config   config.json -> ModelSpec (`parse_config`)
presets     named real and tiny reference models
models      a preset name or a config.json path -> ModelSpec (`load_model`)
shapes      per-rank shapes and the TP index functions (the single source of truth for sharding)
page        HMA groups, regions, block sizes and the byte layout of a page (`build_engine_layout`)
descriptors (addr, len) descriptor rows for every region, piece and block, in one numpy pass
plan        transfer plans for a (prefill, decode) layout pair (`build_plan`, `tp_ratio`)
read_lists  per-peer descriptor lists and per-request index arrays (what the transport executes)
verify      the byte-interval verifier and the byte-level simulator
plan_json   the stable JSON form of a plan (schema hybrid-pd.plan/v1)
"""
