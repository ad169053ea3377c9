#!/usr/bin/env bash
# One device call: GPU tests (in 4 processes), then whatever benchmarks are named. Logs go to
# $OUT. A carried .kcache.tar.xz (benchmarks/build_gpu_cache.sh) becomes the kernel cache, so
# the suite compiles almost nothing; CUTE_KERNELS_RECORD in $OUT lists what it did use.
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -f .kcache.tar.xz ]; then
  mkdir -p /tmp/kcache && tar -C /tmp/kcache -xJf .kcache.tar.xz
  export CUTE_KERNELS_CACHE_DIR=/tmp/kcache
fi
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
CUTE_KERNELS_RECORD=$OUT/kernels.txt python3 -m pytest tests -m "not compile" -q -n 4 -p no:cacheprovider \
  "${PYTEST_ARGS[@]}" 2>&1 | tee $OUT/pytest.log | tail -15
for script in "$@"; do
  python3 $script 2>&1 | tee -a $OUT/bench.log | tail -20
done
