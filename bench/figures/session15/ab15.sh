#!/bin/bash
# A/B of the chunked-prefill budget rule: old (tokens committed, /work/main) vs new (verify time, /work/budget15),
# AUTO at c=8 (24 requests) and Poisson 0.548/s (seed 23, 24 requests), fresh service per run; OFF once at the end.
cd /work/main
B=/work/main/.venv/bin
O=/work/main/bench/out
run() {  # arm tag modes
  local arm=$1 tag=$2 modes=$3 pp=""
  [ $arm = new ] && pp=/work/budget15
  echo "== $(date -u +%H:%M:%S) $tag ($arm)"
  PYTHONPATH=$pp $B/specdec -v serve --config configs/default.yaml > $O/ab15-$tag.log 2>&1 &
  local pid=$!
  for i in $(seq 1 120); do curl -s -o /dev/null http://127.0.0.1:9400/metrics && break; sleep 2; done
  sleep 3
  $B/specdec bench serve --server 127.0.0.1:50051 --prompts humaneval:8 --max-tokens 32 --concurrency 8 \
    --rate 0.548 --requests 24 --modes $modes --seed 23 --metrics-url http://127.0.0.1:9400/metrics \
    --json $O/ab15-$tag.json 2>&1 | grep -E "^(closed|poisson)"
  kill -INT $pid; wait $pid
}
run old old1 auto
run new new1 auto
run old old2 auto
run new new2 auto
run new off off
echo "== $(date -u +%H:%M:%S) done"
