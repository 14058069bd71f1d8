#!/bin/bash
# A/B: a prompt catching up forwarded apart from one-token rows in the drafter (new, /work/split15) vs one forward (old).
# AUTO, Poisson 0.632/s (seed 29, 24 requests), 32 tokens, fresh service per run.
cd /work/main
B=/work/main/.venv/bin
O=/work/main/bench/out
run() {
  local arm=$1 tag=$2 pp=""
  [ $arm = new ] && pp=/work/split15
  echo "== $(date -u +%H:%M:%S) $tag ($arm)"
  PYTHONPATH=$pp $B/specdec -v serve --config configs/default.yaml > $O/ab15c-$tag.log 2>&1 &
  local pid=$!
  for i in $(seq 1 120); do curl -s -o /dev/null http://127.0.0.1:9400/metrics && break; sleep 2; done
  sleep 3
  $B/specdec bench serve --server 127.0.0.1:50051 --prompts humaneval:8 --max-tokens 32 --concurrency "" \
    --rate 0.632 --requests 24 --modes auto --seed 29 --metrics-url http://127.0.0.1:9400/metrics \
    --json $O/ab15c-$tag.json 2>&1 | grep -E "^(closed|poisson)"
  kill -INT $pid; wait $pid
}
run old old1; run new new1; run old old2; run new new2
echo "== $(date -u +%H:%M:%S) done"
