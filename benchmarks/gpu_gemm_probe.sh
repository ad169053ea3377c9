#!/usr/bin/env bash
# Probe GEMM configurations one by one, each in its own process with a time limit.
#   TILE_M TILE_N WARPGROUPS CLUSTER_M M N K CLUSTERS(0 = one per tile)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
run() { timeout ${PROBE_TIMEOUT:-40} python3 benchmarks/experiment_gemm.py "$@" 2>&1 | grep -E "cfg|Error" | tail -2; echo "[$* rc=${PIPESTATUS[0]}]"; }
run 64 128 1 1 17 33 65 0
run 128 128 2 1 128 256 64 0
run 128 128 2 1 128 128 128 0
run 128 128 2 1 256 256 72 0
run 64 128 1 1 64 128 1024 0
run 128 128 1 1 128 128 1024 0
run 128 128 2 1 128 128 1024 0
run 64 128 1 1 4096 4096 4096 0
run 128 128 2 1 4096 4096 4096 0
run 64 128 1 1 4096 4096 4096 132
run 128 128 2 1 4096 4096 4096 132
run 128 256 2 1 4096 4096 4096 132
run 128 256 2 2 4096 4096 4096 66
