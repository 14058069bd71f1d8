#!/bin/bash
# A/B: a drafter's Prefill of the chunks before the last of a prompt the target caches whole (new, /work/dpf15)
# vs none (old, /work/main). AUTO at c=1 and c=8, 8 requests x 32 tokens (one burst at c=8), fresh service per run.
cd /work/main
B=/work/main/.venv/bin
O=/work/main/bench/out
run() {  # arm tag modes
  local arm=$1 tag=$2 modes=$3 pp=""
  [ $arm = new ] && pp=/work/dpf15
  echo "== $(date -u +%H:%M:%S) $tag ($arm)"
  PYTHONPATH=$pp $B/specdec -v serve --config configs/default.yaml > $O/ab15b-$tag.log 2>&1 &
  local pid=$!
  for i in $(seq 1 120); do curl -s -o /dev/null http://127.0.0.1:9400/metrics && break; sleep 2; done
  sleep 3
  $B/specdec bench serve --server 127.0.0.1:50051 --prompts humaneval:8 --max-tokens 32 --concurrency 1,8 \
    --requests 8 --modes $modes --seed 1 --metrics-url http://127.0.0.1:9400/metrics \
    --json $O/ab15b-$tag.json 2>&1 | grep -E "^(closed|poisson)"
  kill -INT $pid; wait $pid
}
run old old1 auto
run new new1 auto
run old old2 auto
run new new2 auto
run old off off
echo "== $(date -u +%H:%M:%S) done"
