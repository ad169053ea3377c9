export PYTHONPATH=$PWD:$PYTHONPATH
python3 benchmarks/experiment_norms.py --held 1l,1s --shapes 4096x65536,4096x131072 2>&1 | grep -v Warn
python3 -m pytest tests/test_norms.py -m "not compile" -q -x -k "forward or split or residual or poison" 2>&1 | tail -2
