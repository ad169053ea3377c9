#!/usr/bin/env bash
# Probe GEMM configurations one by one, each in its own process with a time limit.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
run() { timeout 75 python3 benchmarks/experiment_gemm.py "$@" 2>&1 | grep -E "cfg|Error" | tail -2 || true; echo "[$* rc=${PIPESTATUS[0]}]"; }
run 128 128 1 1
run 128 128 2 1
run 128 256 2 1
run 128 128 2 1 129 264 128
run 128 128 2 1 256 256 72
run 128 256 2 2
run 64 256 1 1
run 128 256 2 1 8192 8192 8192
