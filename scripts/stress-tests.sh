#!/usr/bin/env bash
# Shake out intermittent failures: run the exactness, services and faults suites RUNS times while
# two busy processes keep every core loaded, and report failures/runs with the failing tests.
#
#   scripts/stress-tests.sh [RUNS] [PYTEST PATHS...]     (defaults: 10 runs, the three suites)
#
# Each run's log is kept under $STRESS_LOGS (default: a fresh temporary folder). Exit status 0
# only when every run passed. A failure here is a bug to find, never a test to retry.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=${1:-10}
shift || true
if [ $# -gt 0 ]; then suites=("$@"); else suites=(tests/integration/exactness tests/integration/services tests/faults); fi
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
logs=${STRESS_LOGS:-$(mktemp -d -t hybrid-pd-stress.XXXXXX)}
mkdir -p "$logs"

busy=()
cleanup() { for pid in "${busy[@]}"; do kill "$pid" 2>/dev/null; done; }
trap cleanup EXIT
# Interrupted: stop the runs too (a handler that only cleaned up let the loop go on).
trap 'exit 130' INT TERM
for _ in 1 2; do
  "$python" -c 'while True: pass' &
  busy+=($!)
done

failed_runs=0
echo "stress: $runs runs of ${suites[*]} with ${#busy[@]} busy processes; logs in $logs"
for i in $(seq 1 "$runs"); do
  log="$logs/run-$i.log"
  started=$(date +%s)
  if "$python" -m pytest -q -p no:cacheprovider "${suites[@]}" >"$log" 2>&1; then
    verdict=ok
  else
    verdict=FAILED
    failed_runs=$((failed_runs + 1))
  fi
  summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed).* =+$' "$log" | tail -n 1)
  echo "run $i/$runs: $verdict in $(( $(date +%s) - started )) s: $summary"
  grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
done
echo "failures/runs: $failed_runs/$runs"
[ "$failed_runs" -eq 0 ]
