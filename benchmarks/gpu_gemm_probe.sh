#!/usr/bin/env bash
# Probe GEMM configurations one by one, each in its own process with a time limit, so a hang
# shows up as one timed-out line instead of a lost device call. Each line: shapes, then
# configurations in experiment_gemm.py's syntax (TMxTNxWGxCM, trailing p = ping-pong).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
run() {
  timeout "${PROBE_TIMEOUT:-60}" python3 benchmarks/experiment_gemm.py --shapes "$1" --configs "$2" 2>&1 \
    | grep -E "TFLOP|Error|rel err" | tail -4
  echo "[$1 $2 rc=${PIPESTATUS[0]}]"
}
run 17x33x72,128x256x64,256x256x72 64x128x1x1
run 17x33x72,128x256x64,256x256x72 128x128x2x1
run 1000x2904x200 128x256x2x1
run 1000x2904x200 128x256x2x2
run 1000x2904x200 128x192x2x1p
run 1000x2904x200 128x192x2x2p
run 4096x4096x4096 128x256x2x2
