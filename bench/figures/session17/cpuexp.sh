#!/bin/bash
# Run 23 (bench/NOTES.md, seventeenth session): per-process CPU during a saturating AUTO then OFF Poisson run (run 22's arrivals), sampled each second.
cd /work/main
B=.venv/bin; O=bench/out
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
stamp serve
$B/specdec -v serve --config configs/default.yaml > $O/serve23.log 2>&1 &
SERVE=$!
for i in $(seq 1 180); do curl -s -o /dev/null http://127.0.0.1:9400/metrics && break; sleep 2; done
sleep 5
.venv/bin/python bench/figures/session17/cpusample.py > $O/cpu23.log 2>&1 &
SAMPLER=$!
stamp run
$B/specdec bench serve --server 127.0.0.1:50051 --prompts humaneval:8 --max-tokens 32 --concurrency "" \
  --rate 0.625 --requests 24 --modes auto,off --seed 53 --json $O/serve-cpu23.json
stamp done
kill $SAMPLER
kill -INT $SERVE; wait $SERVE
