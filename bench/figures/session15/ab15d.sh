#!/bin/bash
# A/B as ab15c.sh, the arm set by the file in /work/main itself (the draft worker is a Ray actor:
# PYTHONPATH reaches it, but whether it wins over the driver's directory is not checked).
cd /work/main
B=/work/main/.venv/bin
O=/work/main/bench/out
run() {
  local arm=$1 tag=$2
  if [ $arm = new ]; then cp /work/split15/specdec/core/drafters.py specdec/core/drafters.py; else git checkout -q specdec/core/drafters.py; fi
  echo "== $(date -u +%H:%M:%S) $tag ($arm) $(grep -c _LONG_FEED specdec/core/drafters.py)"
  $B/specdec -v serve --config configs/default.yaml > $O/ab15d-$tag.log 2>&1 &
  local pid=$!
  for i in $(seq 1 120); do curl -s -o /dev/null http://127.0.0.1:9400/metrics && break; sleep 2; done
  sleep 3
  $B/specdec bench serve --server 127.0.0.1:50051 --prompts humaneval:8 --max-tokens 32 --concurrency "" \
    --rate 0.632 --requests 24 --modes auto --seed 29 --metrics-url http://127.0.0.1:9400/metrics \
    --json $O/ab15d-$tag.json 2>&1 | grep -E "^(closed|poisson)"
  kill -INT $pid; wait $pid
}
run new new1; run old old1; run new new2; run old old2
git checkout -q specdec/core/drafters.py
echo "== $(date -u +%H:%M:%S) done"
