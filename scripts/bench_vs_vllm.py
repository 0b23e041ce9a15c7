"""Our P/D pair against vLLM on one checkpoint, measured by vLLM's own benchmark client.

Called by `scripts/bench-vs-vllm.sh`, which makes vLLM's venv first; run it directly only with
such a venv at hand:

    .venv/bin/python scripts/bench_vs_vllm.py --vllm-python VLLM_VENV/bin/python --out DIR

Setups (each started on free ports of 127.0.0.1, waited for, measured, then torn down, also on
failure or interruption):

- `vllm`: vLLM CPU, one engine serving prefill and decode (the baseline every ratio uses);
- `vllm-pd`: vLLM's own P/D: a producer and a consumer engine with NixlConnector, one core each,
  behind vllm-router (skipped when vLLM's venv has no vllm-router);
- `ours`: prefill-svc + decode-svc (`--engine` as given, else the services' default for a
  checkpoint directory), measured through decode's OpenAI-compatible HTTP front door;
- `ours-share`: the same pair with `--local-prefill share` on decode: while prefill is busy
  (a burst of arrivals), decode computes part of the burst's prompts itself;
- `ours-colocated`: decode-svc alone, through the same HTTP front door: with no prefill engine
  it computes every prompt on its own engine, in its own step loop (`--local-prefill fallback`),
  so one process serves prefill and decode, as vLLM's one engine does.

For every setup and level the same client runs (`vllm bench serve`, random dataset, the same
seed, `--ignore-eos`) with N concurrent users; its JSON lands in DIR/raw/. One table follows:
output tokens/s, TTFT p50 / p99, TPOT p50, and each against vLLM colocated at the same level,
plus the decode side's CPU time per output token at each level (all its processes and threads,
and its first process's main thread alone: ours, the event loop) and its resident memory at the
highest level (sampled every 0.2 s).

With `--rounds N` the setups run in turn N times (vllm, ours, ... then again); each figure is
the median over the rounds, each ratio the median of the rounds' own ratios, so drift of a
shared machine between one setup's runs and another's does not pass for a difference.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.engine.hf.tiny_checkpoints import cached_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "scripts" / "vllm_bench_client.py"
SETUPS = ("vllm", "vllm-pd", "ours", "ours-share", "ours-colocated")
BASELINE = "vllm"
# A median TPOT below this means a stream's tokens came in one burst, not one by one.
BURST_TPOT_MS = 0.1


class SetupSkipped(Exception):
    """The setup cannot run here; the message says why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Server:
    """One server process in a session of its own, its output in a log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 20.0) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@dataclass
class Servers:
    """The servers of the running setup; their process groups are also listed in `pid_file`, so
    the calling shell script can end them if this process itself is killed."""

    logs: Path
    pid_file: Path
    running: list[Server] = field(default_factory=list)

    def start(self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> Server:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as sink:
            proc = subprocess.Popen(
                list(cmd),
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                cwd=ROOT,
                start_new_session=True,
            )
        server = Server(name, proc, log)
        self.running.append(server)
        with open(self.pid_file, "a", encoding="utf-8") as f:
            f.write(f"{proc.pid}\n")
        return server

    def run(self, name: str, cmd: Sequence[str]) -> int:
        """Run a client to its end, tracked like a server, so an interruption ends it too."""
        client = self.start(name, cmd)
        try:
            return client.proc.wait()
        finally:
            client.stop()
            self.running.remove(client)

    def stop_all(self) -> None:
        for server in reversed(self.running):
            server.stop()
        self.running.clear()
        self.pid_file.write_text("", encoding="utf-8")


def wait_line(server: Server, pattern: str, timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, server.text())
        if found:
            return found
        if not server.alive():
            raise RuntimeError(f"{server.name} exited ({server.proc.returncode}) before printing {pattern!r}; see {server.log}")
        time.sleep(0.2)
    raise RuntimeError(f"{server.name} printed no {pattern!r} within {timeout:.0f} s; see {server.log}")


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), bytes(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), b""


def http_post(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def wait_healthy(base: str, watched: Sequence[Server], timeout: float) -> None:
    """GET /health answers 200 (our services: readiness, decode has a prefill peer; vLLM: the
    engine is up) and /v1/models lists a model."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for server in watched:
            if not server.alive():
                raise RuntimeError(f"{server.name} exited ({server.proc.returncode}) while starting; see {server.log}")
        with contextlib.suppress(OSError):
            if http_get(f"{base}/health")[0] == 200 and http_get(f"{base}/v1/models")[0] == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{base} not ready within {timeout:.0f} s; see the logs of {', '.join(s.name for s in watched)}")


def served_model(base: str) -> str:
    status, body = http_get(f"{base}/v1/models")
    if status != 200:
        raise RuntimeError(f"{base}/v1/models answered {status}")
    name: str = json.loads(body)["data"][0]["id"]
    return name


def warm_up(base: str, model: str) -> None:
    """Two short completions, so first-call costs stay out of the first level."""
    for prompt in ("Hello world", "The quick brown fox"):
        http_post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True})


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def tree_rss_kib(pid: int) -> int:
    """VmRSS of `pid` and of every process below it (shared pages count once per process)."""
    return sum(rss_kib(p) for p in process_tree(pid))


def rss_kib(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_ticks(pid: int) -> tuple[int, int]:
    """CPU ticks (user + system) used so far by `pid` and every process below it, all threads,
    and by `pid`'s main thread alone (ours: the event loop; vLLM: the API server's)."""

    def ticks(stat_path: str) -> int:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])
        return 0

    return sum(ticks(f"/proc/{p}/stat") for p in process_tree(pid)), ticks(f"/proc/{pid}/task/{pid}/stat")


class RssSampler:
    """Peak of `measure()` sampled every 0.2 s while the `with` block runs."""

    def __init__(self, pid: int, tree: bool) -> None:
        self.pid, self.tree = pid, tree
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def measure(self) -> int:
        return tree_rss_kib(self.pid) if self.tree else rss_kib(self.pid)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, self.measure())
            self._stop.wait(0.2)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, self.measure())


@dataclass
class Running:
    """A setup up and ready: where to send requests and whose memory to watch."""

    base: str
    model: str
    rss_pid: int
    rss_what: str
    rss_tree: bool
    # (server, log line) pairs counted after each level: events that explain outliers.
    watch: list[tuple[Server, str]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {f"{server.name}: {line}": server.text().count(line) for server, line in self.watch}


@dataclass
class Options:
    vllm_python: str
    vllm_router: str | None
    checkpoint: str
    out: Path
    levels: list[int]
    input_len: int
    output_len: int
    num_prompts: int | None
    engine: str | None
    startup_timeout: float
    seed: int
    rounds: int = 1

    def prompts_for(self, level: int) -> int:
        return self.num_prompts if self.num_prompts else max(16, 4 * level)

    @property
    def max_model_len(self) -> int:
        return 1024 if self.input_len + self.output_len <= 1024 else 2048


def vllm_server_cmd(o: Options, port: int, extra: Sequence[str] = ()) -> list[str]:
    return [
        o.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        o.checkpoint,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(o.max_model_len),
        "--enforce-eager",
        # With prefix caching (its default for hybrids) vLLM 0.32 CPU crashes on random prompts
        # (IndexError in mamba_mixer2.conv_ssm_forward).
        "--no-enable-prefix-caching",
        *extra,
    ]


VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def start_vllm(o: Options, servers: Servers) -> Running:
    port = free_port()
    server = servers.start("vllm", vllm_server_cmd(o, port), VLLM_ENV)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, [server], o.startup_timeout)
    return Running(base, served_model(base), server.proc.pid, "api server + engine core", True)


def start_vllm_pd(o: Options, servers: Servers) -> Running:
    if not o.vllm_router:
        raise SetupSkipped("no vllm-router in vLLM's venv (install it, or run the shell script without --no-vllm-pd)")
    ends: dict[str, tuple[Server, int]] = {}
    for role, core in (("producer", 0), ("consumer", 1)):
        port = free_port()
        config = json.dumps({"kv_connector": "NixlConnector", "kv_role": f"kv_{role}", "kv_buffer_device": "cpu"})
        env = {
            **VLLM_ENV,
            # One core each: with the default both engines bind every core (~200 ms a decode step).
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        }
        ends[role] = (servers.start(f"vllm-{role}", vllm_server_cmd(o, port, ["--kv-transfer-config", config]), env), port)
    for _, port in ends.values():
        wait_healthy(f"http://127.0.0.1:{port}", [s for s, _ in ends.values()], o.startup_timeout)
    router_port = free_port()
    router = servers.start(
        "vllm-router",
        [
            o.vllm_router,
            "--host",
            "127.0.0.1",
            "--port",
            str(router_port),
            "--vllm-pd-disaggregation",
            "--kv-connector",
            "nixl",
            "--prefill",
            f"http://127.0.0.1:{ends['producer'][1]}",
            "--decode",
            f"http://127.0.0.1:{ends['consumer'][1]}",
            "--prometheus-port",
            str(free_port()),
        ],
    )
    base = f"http://127.0.0.1:{router_port}"
    wait_healthy(base, [router, *(s for s, _ in ends.values())], o.startup_timeout)
    consumer = ends["consumer"][0]
    # Seen on a loaded machine: a READ that waits 30 s, the producer having released the blocks.
    watch = [(ends["producer"][0], "Releasing expired KV blocks")]
    model = served_model(f"http://127.0.0.1:{ends['consumer'][1]}")
    return Running(base, model, consumer.proc.pid, "consumer tree", True, watch)


def our_common_args(o: Options) -> list[str]:
    engine = ["--engine", o.engine] if o.engine else []
    return ["--model", o.checkpoint, "--host", "127.0.0.1", "--port", "0", *engine]


def start_ours(o: Options, servers: Servers, decode_flags: Sequence[str] = ()) -> Running:
    common = our_common_args(o)
    prefill = servers.start("prefill-svc", [sys.executable, "-m", "prefill_svc", *common])
    prefill_port = wait_line(prefill, r"LISTENING port=(\d+)", o.startup_timeout).group(1)
    decode = servers.start(
        "decode-svc",
        [
            sys.executable,
            "-m",
            "decode_svc",
            *common,
            "--http-port",
            "0",
            "--prefill",
            f"127.0.0.1:{prefill_port}",
            *decode_flags,
        ],
    )
    http_port = wait_line(decode, r"HTTP port=(\d+)", o.startup_timeout).group(1)
    base = f"http://127.0.0.1:{http_port}"
    wait_healthy(base, [prefill, decode], o.startup_timeout)
    return Running(base, served_model(base), decode.proc.pid, "decode-svc process", False)


def start_ours_colocated(o: Options, servers: Servers) -> Running:
    decode = servers.start(
        "decode-svc-colocated",
        [sys.executable, "-m", "decode_svc", *our_common_args(o), "--http-port", "0", "--local-prefill", "fallback"],
    )
    http_port = wait_line(decode, r"HTTP port=(\d+)", o.startup_timeout).group(1)
    base = f"http://127.0.0.1:{http_port}"
    wait_healthy(base, [decode], o.startup_timeout)
    return Running(base, served_model(base), decode.proc.pid, "decode-svc process", False)


STARTERS: dict[str, Callable[[Options, Servers], Running]] = {
    "vllm": start_vllm,
    "vllm-pd": start_vllm_pd,
    "ours": start_ours,
    "ours-share": functools.partial(start_ours, decode_flags=("--local-prefill", "share")),
    "ours-colocated": start_ours_colocated,
}


def raw_name(setup: str, level: int, round_index: int) -> str:
    """The file name (no suffix) of one client run's JSON and log: round 1 keeps the name of a
    run of one round."""
    return f"{setup}-c{level}" + (f"-r{round_index + 1}" if round_index else "")


def run_client(o: Options, servers: Servers, setup: str, running: Running, level: int, round_index: int) -> dict[str, Any]:
    raw = o.out / "raw"
    run = raw_name(setup, level, round_index)
    name = run + ".json"
    cmd = [
        o.vllm_python,
        str(CLIENT),
        "--backend",
        "vllm",
        "--base-url",
        running.base,
        "--endpoint",
        "/v1/completions",
        "--model",
        running.model,
        "--tokenizer",
        o.checkpoint,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(o.input_len),
        "--random-output-len",
        str(o.output_len),
        "--random-range-ratio",
        "0",
        "--ignore-eos",
        "--num-prompts",
        str(o.prompts_for(level)),
        "--max-concurrency",
        str(level),
        "--request-rate",
        "inf",
        "--seed",
        str(o.seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",  # per-request TTFTs and ITLs in the raw JSON
        "--result-dir",
        str(raw),
        "--result-filename",
        name,
    ]
    rc = servers.run(f"client-{run}", cmd)
    log = o.out / "logs" / f"client-{run}.log"
    if rc != 0 or not (raw / name).is_file():
        raise RuntimeError(f"vllm bench serve failed against {setup} at {level} users (exit {rc}); see {log}")
    result: dict[str, Any] = json.loads((raw / name).read_text())
    return result


@dataclass
class Row:
    setup: str
    level: int
    result: dict[str, Any] | None = None
    rss_mib: float | None = None
    rss_what: str = ""
    note: str = ""
    # Decode side's CPU ms per output token: all its processes and threads, and its first
    # process's main thread alone (ours: the event loop, which shares the interpreter lock with
    # the engine's compute thread).
    cpu_ms_per_token: float | None = None
    main_thread_cpu_ms_per_token: float | None = None
    round: int = 0  # which of the run's rounds (from 0)


def measure_setup(o: Options, setup: str, servers: Servers, round_index: int = 0) -> list[Row]:
    rows: list[Row] = []
    try:
        print(f"[{setup}] starting", flush=True)
        started = time.monotonic()
        running = STARTERS[setup](o, servers)
        print(f"[{setup}] ready in {time.monotonic() - started:.0f} s at {running.base} (model {running.model})", flush=True)
        warm_up(running.base, running.model)
        for level in o.levels:
            before = running.counts()
            highest = level == max(o.levels)
            sampler = RssSampler(running.rss_pid, running.rss_tree)
            cpu_before = cpu_ticks(running.rss_pid)
            with sampler if highest else contextlib.nullcontext(sampler):
                result = run_client(o, servers, setup, running, level, round_index)
            cpu_after = cpu_ticks(running.rss_pid)
            row = Row(setup, level, result, round=round_index)
            tokens = int(result.get("total_output_tokens", 0) or 0)
            if tokens:
                per_token = 1000 / os.sysconf("SC_CLK_TCK") / tokens
                row.cpu_ms_per_token = (cpu_after[0] - cpu_before[0]) * per_token
                row.main_thread_cpu_ms_per_token = (cpu_after[1] - cpu_before[1]) * per_token
            if highest:
                row.rss_mib, row.rss_what = sampler.peak_kib / 1024, running.rss_what
            failed = int(result.get("failed", 0) or 0)
            events = [f"{n - before.get(what, 0)} x {what!r}" for what, n in running.counts().items() if n > before.get(what, 0)]
            row.note = "; ".join(([f"{failed} failed"] if failed else []) + events)
            rows.append(row)
            print(
                f"[{setup}] {level} users: {result.get('output_throughput', 0):.0f} tok/s, "
                f"TTFT p50 {result.get('median_ttft_ms', 0):.0f} ms, TPOT p50 {result.get('median_tpot_ms', 0):.1f} ms"
                + (f" ({row.note})" if row.note else ""),
                flush=True,
            )
    except SetupSkipped as e:
        print(f"[{setup}] skipped: {e}", flush=True)
        rows = [Row(setup, 0, note=f"skipped: {e}", round=round_index)]
    except Exception as e:  # one setup failing must not lose the others' results
        print(f"[{setup}] FAILED: {e}", flush=True)
        rows.append(Row(setup, 0, note=f"failed: {e}", round=round_index))
    finally:
        servers.stop_all()
    return rows


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def metric(row: Row | None, key: str) -> float | None:
    if row is None or row.result is None:
        return None
    value = row.result.get(key)
    return float(value) if isinstance(value, int | float) else None


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values there are (None: none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


class Rounds:
    """Every round's rows of one run; a setup's figure at a level is the median over its rounds,
    and its ratio to the baseline the median of each round's ratio (the baseline of the same
    round: a shared machine's drift between rounds cancels out)."""

    def __init__(self, rows: Sequence[Row]) -> None:
        self.groups: dict[tuple[str, int], list[Row]] = {}
        for r in rows:
            if r.result is not None:
                self.groups.setdefault((r.setup, r.level), []).append(r)
        self.base = {(r.level, r.round): r for r in rows if r.setup == BASELINE and r.result is not None}

    def value(self, setup: str, level: int, key: str) -> float | None:
        return median([metric(r, key) for r in self.groups.get((setup, level), [])])

    def ratio(self, setup: str, level: int, key: str) -> float | None:
        ratios: list[float | None] = []
        for r in self.groups.get((setup, level), []):
            mine, theirs = metric(r, key), metric(self.base.get((level, r.round)), key)
            ratios.append(mine / theirs if mine is not None and theirs else None)
        return median(ratios)


def table(rows: Sequence[Row]) -> str:
    rounds = Rounds(rows)
    head = [
        "setup",
        "users",
        "out tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "E2E p50 ms",
        "tok/s vs vLLM",
        "TTFT p50 vs vLLM",
        "TPOT p50 vs vLLM",
        "decode CPU ms/token (main thread)",
        "decode RSS MiB",
    ]
    lines = [head]
    notes: list[str] = []
    burst = {
        (level, r.round)
        for (setup, level), group in rounds.groups.items()
        if setup == BASELINE
        for r in group
        if (metric(r, "median_tpot_ms") or 0.0) < BURST_TPOT_MS
    }
    burst_levels = {level for level, _ in burst}
    for level, index in sorted(burst):
        notes.append(
            f"{BASELINE} at {level} users (round {index + 1}): TPOT p50 ~0, its tokens arrived in one burst (a loaded "
            "machine); no TPOT ratio at that level, compare E2E"
        )
    for r in rows:
        if r.result is None:
            notes.append(f"{r.setup}: {r.note}")
        elif r.note:
            notes.append(f"{r.setup} at {r.level} users (round {r.round + 1}): {r.note}")
    for (setup, level), group in rounds.groups.items():
        v = functools.partial(rounds.value, setup, level)
        x = functools.partial(rounds.ratio, setup, level)
        rss = [r for r in group if r.rss_mib is not None]
        lines.append(
            [
                setup,
                str(level),
                fmt(v("output_throughput")),
                fmt(v("median_ttft_ms")),
                fmt(v("p99_ttft_ms")),
                fmt(v("median_tpot_ms"), 1),
                fmt(v("median_e2el_ms")),
                fmt(x("output_throughput"), 2),
                fmt(x("median_ttft_ms"), 2),
                "-" if level in burst_levels else fmt(x("median_tpot_ms"), 2),
                f"{fmt(median([r.cpu_ms_per_token for r in group]), 2)} "
                f"({fmt(median([r.main_thread_cpu_ms_per_token for r in group]), 2)})",
                f"{fmt(max(r.rss_mib or 0.0 for r in rss))} ({rss[0].rss_what})" if rss else "",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out + [f"- {n}" for n in notes])


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"levels must be positive integers, comma separated: {text!r}")
    return levels


def parse_setups(text: str) -> list[str]:
    setups = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or not setups:
        raise argparse.ArgumentTypeError(f"unknown setup(s) {unknown}; choose from {', '.join(SETUPS)}")
    return setups


def positive_int(text: str) -> int:
    """An argument of at least 1 (scripts sit below the CLI package and may not import its types)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_vs_vllm.py",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--vllm-python", required=True, help="python of vLLM's venv (runs vLLM's servers and its bench client)")
    p.add_argument("--vllm-router", default=None, help="vllm-router binary for the vllm-pd setup (none: vllm-pd is skipped)")
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="output dir: raw/ (vllm bench JSON per setup and level), logs/, summary.json, table.md",
    )
    p.add_argument(
        "--checkpoint", default=None, help="checkpoint dir (default: the nemotron_h bench64 checkpoint, built offline and cached)"
    )
    p.add_argument(
        "--setups", type=parse_setups, default=",".join(SETUPS), help=f"comma separated, from {','.join(SETUPS)} (default: all)"
    )
    p.add_argument(
        "--levels", type=parse_levels, default="1,8,32,64", help="concurrent users, comma separated (default: 1,8,32,64)"
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens, random dataset (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens, --ignore-eos (default: 64)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per level (default: max(16, 4 x users))")
    p.add_argument(
        "--engine", default=None, help="our services' --engine (hf, paged, ...); default: what they choose for a checkpoint dir"
    )
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a setup may take to become ready (default: 600)")
    p.add_argument("--seed", type=int, default=0, help="random dataset seed: the same prompts for every setup (default: 0)")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run every setup this many times, in turn (vllm, ours, ... then again): the table gives medians over "
        "the rounds and the median of each round's ratio, so a shared machine's drift between setups cancels out (default: 1)",
    )
    return p


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    out: Path = args.out.resolve()
    (out / "raw").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint or cached_checkpoint("nemotron_h", size="bench64")
    o = Options(
        vllm_python=os.path.abspath(args.vllm_python),
        vllm_router=os.path.abspath(args.vllm_router) if args.vllm_router else None,
        checkpoint=os.path.abspath(checkpoint),
        out=out,
        levels=sorted(set(args.levels)),
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        engine=args.engine,
        startup_timeout=args.startup_timeout,
        seed=args.seed,
        rounds=args.rounds,
    )
    print(f"checkpoint: {o.checkpoint}", flush=True)
    # A SIGTERM (the shell script's trap) unwinds like Ctrl-C, through every `finally`.
    signal.signal(signal.SIGTERM, _interrupted)
    servers = Servers(out / "logs", out / "server-pids")
    servers.pid_file.write_text("", encoding="utf-8")
    setups = list(args.setups)
    if BASELINE in setups:  # the baseline first, so a failure there shows before the long runs
        setups.remove(BASELINE)
        setups.insert(0, BASELINE)
    rows: list[Row] = []
    try:
        for index in range(o.rounds):
            if o.rounds > 1:
                print(f"== round {index + 1} of {o.rounds}", flush=True)
            for setup in setups:
                rows.extend(measure_setup(o, setup, servers, index))
    finally:
        servers.stop_all()
    text = table(rows)
    settings = f"random {o.input_len} in / {o.output_len} out, --ignore-eos, prompts per level: " + (
        str(o.num_prompts) if o.num_prompts else "max(16, 4 x users)"
    )
    if o.rounds > 1:
        settings += f"; {o.rounds} rounds: medians over the rounds, ratios the median of each round's"
    print(f"\n{settings}; ratios are setup / vLLM colocated at the same level (this run)\n{text}")
    (out / "table.md").write_text(f"{settings}\n\n{text}\n", encoding="utf-8")
    summary = {
        "checkpoint": o.checkpoint,
        "engine": o.engine,
        "input_len": o.input_len,
        "output_len": o.output_len,
        "levels": o.levels,
        "rows": [
            {
                "setup": r.setup,
                "users": r.level,
                "round": r.round + 1,
                "output_throughput": metric(r, "output_throughput"),
                "median_ttft_ms": metric(r, "median_ttft_ms"),
                "p99_ttft_ms": metric(r, "p99_ttft_ms"),
                "median_tpot_ms": metric(r, "median_tpot_ms"),
                "median_e2el_ms": metric(r, "median_e2el_ms"),
                "completed": metric(r, "completed"),
                "failed": metric(r, "failed"),
                "decode_cpu_ms_per_token": r.cpu_ms_per_token,
                "decode_main_thread_cpu_ms_per_token": r.main_thread_cpu_ms_per_token,
                "decode_rss_mib": r.rss_mib,
                "rss_of": r.rss_what or None,
                "note": r.note or None,
                "raw": f"raw/{raw_name(r.setup, r.level, r.round)}.json" if r.result is not None else None,
            }
            for r in rows
        ],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"\nraw results: {out / 'raw'}; summary: {out / 'summary.json'}")
    measured = [r for r in rows if r.result is not None]
    failed = [r for r in rows if r.note.startswith("failed")]
    return 1 if failed or not measured else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt as interrupt:
        print(f"bench_vs_vllm: interrupted ({interrupt or 'Ctrl-C'}); the servers it started are stopped", file=sys.stderr)
        sys.exit(130)
