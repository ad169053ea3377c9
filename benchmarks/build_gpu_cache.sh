#!/usr/bin/env bash
# Compile, on this machine (no GPU needed), the kernels the GPU test suite uses -- listed in
# benchmarks/gpu_suite_kernels.txt, recorded on an H100 with CUTE_KERNELS_RECORD=FILE, plus every
# attention configuration (compile_configurations()) -- and
# pack them as .kcache.tar.xz (about 2 MB) to carry to a GPU machine with the bundle's first
# part; benchmarks/gpu_session.sh unpacks it there. Kernels the list misses compile on the GPU
# machine as usual; lines for kernels that no longer exist are skipped.
#
#   benchmarks/build_gpu_cache.sh                      # ~5 min on 2 cores
#   device call 1: carry [".gpu/a", ".kcache.tar.xz"]  command: bash .gpu/a/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .kcache .kcache.tar.xz
python -m cute_kernels precompile --arch sm_90a --cache-dir .kcache --families "" \
  --from benchmarks/gpu_suite_kernels.txt
tar -C .kcache -cJf .kcache.tar.xz .
ls -la .kcache.tar.xz
