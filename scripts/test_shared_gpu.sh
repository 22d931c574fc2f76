#!/usr/bin/env bash
# The whole suite on one large GPU in a few minutes: WORKERS pytest workers share the card (each process
# sees SHARE x its memory as the total: tests/gpu_share/sitecustomize.py), then the tests that size
# engines from the whole card (`whole_gpu`) run alone, then whatever failed in the shared run runs again
# alone (a test that ran out of its share passes there; a real failure fails twice).
#   WORKERS=8 bash scripts/test_shared_gpu.sh [pytest args]      (make test-shared-gpu)
# Under a time limit per command (a leased machine), run the parts in separate commands with one CACHE:
#   CACHE=.suite_cache PARTS=shared LIMIT=500 bash scripts/test_shared_gpu.sh
#   CACHE=.suite_cache PARTS="shared whole rerun" RESUME=1 bash scripts/test_shared_gpu.sh
# LIMIT (seconds) stops a part with an interrupt, so pytest still prints its summary and records what
# failed so far for the rerun. The shared run logs every test's outcome in CACHE/testlog.txt; with RESUME=1
# it goes on from that log (tests/conftest.py: MINIVLLM_TEST_RESUME), else it starts afresh (the log and
# the cache's record of failures cleared).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WORKERS=${WORKERS:-8}
SHARE=${SHARE:-$("$PYTHON" -c "print(round(0.9 / $WORKERS, 3))")}
CACHE=${CACHE:-$(mktemp -d)}
PARTS=${PARTS:-shared whole rerun}
LIMIT=${LIMIT:-0}  # 0: no limit
RESUME=${RESUME:-0}  # 1: the shared run goes on from CACHE/testlog.txt
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$CACHE"

capped() {  # capped command...: run it, interrupted (SIGINT) after LIMIT seconds if LIMIT > 0
  if [ "$LIMIT" -gt 0 ]; then timeout -s INT -k 30 "$LIMIT" "$@"; else "$@"; fi
}
wants() { [[ " $PARTS " == *" $1 "* ]]; }

shared=0 whole=0 rerun=0
if wants shared; then
  echo "shared run: $WORKERS workers, each sees $SHARE of the card"
  fresh=""
  [ "$RESUME" = 1 ] || { rm -f "$CACHE/testlog.txt"; fresh=--cache-clear; }
  MINIVLLM_TEST_LOG="$CACHE/testlog.txt" MINIVLLM_TEST_RESUME=$RESUME MINIVLLM_TEST_GPU_SHARE=$SHARE \
    PYTHONPATH="$PYTHONPATH:tests/gpu_share" \
    capped "$PYTHON" -m pytest -q -n "$WORKERS" -o cache_dir="$CACHE" --durations=25 $fresh "$@"
  shared=$?
  [ $shared -eq 5 ] && shared=0  # (a resumed run with nothing left)
fi
if wants whole; then
  echo "the whole_gpu tests, alone"
  capped "$PYTHON" -m pytest -q -m whole_gpu -o cache_dir="$CACHE/whole" "$@"
  whole=$?
fi
if wants rerun; then  # (the failures of every shared run with this CACHE)
  echo "the shared run's failures, again alone"
  capped "$PYTHON" -m pytest -q --lf --lfnf=none -o cache_dir="$CACHE" "$@"
  rerun=$?
fi
[ $whole -ne 0 ] && [ $whole -ne 5 ] && exit $whole  # (5: no whole_gpu test selected)
if wants rerun; then
  [ $rerun -eq 5 ] && exit 0  # (no failure to rerun)
  exit $rerun
fi
exit $shared
