"""`hybrid-pd bench`: measurements of the data and control planes, each against a baseline
measured in the same run (these machines are shared and noisy, so absolute figures drift;
ratios hold). See docs/performance.md for the figures and the commands reproducing them.

stats            medians, percentiles, GB/s and ratios (pure)
progress         a simple progress bar on stderr
plotting         line and bar charts: PNG through matplotlib when installed, SVG always
sizing           cache blocks a request needs and the block ids the services allocate (pure)
sections         bytes of a READ by section: FA, conv, SSM (pure)
pairs            the READs of one request: read lists and descriptor ids per rank pair (pure)
crossover        bytes moved per request against prompt length, from the layout math (pure)
descids          micro-benchmark of per-request descriptor ids (`read_indices`)
raw_target       the process the raw NIXL baselines read from (plain agents)
raw_pumping      how raw NIXL progresses UCX on both sides while its READ is in flight
raw_nixl         plain NIXL agents: the raw READ baselines (identical descriptors, one per region)
memcpy           the in-process copy baseline (memory-bandwidth limit)
client           a Generate client that timestamps tokens
transfer         `bench transfer`: our READ path against raw NIXL and memcpy
transfer_report  its JSON result and table (pure)
no_compute       an engine that computes nothing (isolates the control plane)
echo             a bare grpc.aio stream round trip (the floor of a Session exchange)
control          `bench control`: the control-plane cost of one request
cpu              CPU seconds of a process (throughput per core used)
colocated_server one process that prefills and decodes (the baseline of `bench e2e`)
setups           both setups of `bench e2e` (service pair, colocated server), started side by side
e2e              `bench e2e`: TTFT, inter-token latency, tokens/s, disaggregated vs colocated
long_prompt      `bench e2e --workload long-prompt`: exposed transfer time and bytes per prompt length
multi_turn       `bench e2e --workload multi-turn`: bytes moved and TTFT per turn of growing conversations
"""
