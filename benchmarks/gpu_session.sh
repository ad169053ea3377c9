#!/usr/bin/env bash
# One device call: GPU tests, then whatever benchmarks are named. Logs go to $OUT.
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -m pytest tests -m "not compile" -q -x -p no:cacheprovider "${PYTEST_ARGS[@]}" 2>&1 | tee $OUT/pytest.log | tail -15
for script in "$@"; do
  python3 $script 2>&1 | tee -a $OUT/bench.log | tail -20
done
