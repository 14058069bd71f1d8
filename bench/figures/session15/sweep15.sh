#!/bin/bash
# Issue 11's load sweep on this VM: AUTO vs OFF, closed loop 1..16 clients, 16 requests x 64 tokens, fresh service.
cd /work/main
B=.venv/bin; O=bench/out
echo "== $(date -u +%H:%M:%S) serve"
$B/specdec -v serve --config configs/default.yaml > $O/sweep15-serve.log 2>&1 &
pid=$!
for i in $(seq 1 120); do curl -s -o /dev/null http://127.0.0.1:9400/metrics && break; sleep 2; done
sleep 3
echo "== $(date -u +%H:%M:%S) sweep"
$B/specdec bench serve --server 127.0.0.1:50051 --prompts humaneval:16 --max-tokens 64 --concurrency 1,2,4,8,16 \
  --requests 16 --modes auto,off --metrics-url http://127.0.0.1:9400/metrics --json $O/serve-sweep15.json
kill -INT $pid; wait $pid
$B/specdec bench plot $O/serve-sweep15.json --out $O/serve-sweep15.png 2>&1 | tail -2
echo "== $(date -u +%H:%M:%S) done"
