#!/usr/bin/env bash
# The whole suite on one large GPU in a few minutes: WORKERS pytest workers share the card (each process
# sees SHARE x its memory as the total: tests/gpu_share/sitecustomize.py), then the tests that size
# engines from the whole card (`whole_gpu`) run alone, then whatever failed in the shared run runs again
# alone (a test that ran out of its share passes there; a real failure fails twice).
#   WORKERS=8 bash scripts/test_shared_gpu.sh [pytest args]      (make test-shared-gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WORKERS=${WORKERS:-8}
SHARE=${SHARE:-$("$PYTHON" -c "print(round(0.9 / $WORKERS, 3))")}
CACHE=${CACHE:-$(mktemp -d)}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
echo "shared run: $WORKERS workers, each sees $SHARE of the card"
MINIVLLM_TEST_GPU_SHARE=$SHARE PYTHONPATH="$PYTHONPATH:tests/gpu_share" \
  "$PYTHON" -m pytest -q -n "$WORKERS" -o cache_dir="$CACHE" --durations=25 "$@"
shared=$?
echo "the whole_gpu tests, alone"
"$PYTHON" -m pytest -q -m whole_gpu -o cache_dir="$CACHE/whole" "$@"
whole=$?
rerun=0
if [ $shared -ne 0 ]; then
  echo "the shared run's failures, again alone"
  "$PYTHON" -m pytest -q --lf --lfnf=none -o cache_dir="$CACHE" "$@"
  rerun=$?
fi
[ $whole -ne 0 ] && [ $whole -ne 5 ] && exit $whole  # (5: no whole_gpu test selected)
exit $rerun
