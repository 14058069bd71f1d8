#!/bin/bash
# Issue 14's accuracy protocol (session 15's, bench/figures/session15/protocol.sh), bf16 Qwen pair, on the EPYC VM,
# with the loaded rates run twice more on the same service and arrivals after the first pass:
# the service's own spread from run to run, beside the prediction (written before any of them).
# CAL=1,2,4,8,1,2,4,8: the calibration's levels in two passes, so that each scale averages two
# moments of a VM whose speed drifts by 10 % from minute to minute (bench/NOTES.md, sixteenth session).
# CAL_RATE=0.3: a Poisson scenario in the calibration too (its own arrivals, the calibration's seed),
# so that one- and two-row rounds under arrivals are measured, which closed loops do not.
# The rates come from the calibration run: saturating = OFF's closed c=8 throughput / 32 tokens.
set -u
cd /work/main
B=.venv/bin
O=bench/out; mkdir -p $O
T=${TAG:-15}
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
if [ ! -f $O/bf16-profile$T.json ]; then
  stamp profile
  $B/specdec profile --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --dtype bfloat16 \
    --threads 2 --prompts humaneval:8 --max-tokens 32 --batches 1,2,4,8,16 --config configs/default.yaml \
    --drafters draft --budget-s 840 -o $O/bf16-profile$T.json || exit 1
fi
stamp serve
$B/specdec -v serve --config configs/default.yaml > $O/serve$T.log 2>&1 &
SERVE=$!
echo "serve pid $SERVE"
for i in $(seq 1 180); do
  curl -s -o /dev/null http://127.0.0.1:9400/metrics && break
  sleep 2
done
sleep 5
stamp calibration
$B/specdec bench serve --server 127.0.0.1:50051 --prompts humaneval:8 --max-tokens 32 --concurrency ${CAL:-1,2,4,8} \
  --rate "${CAL_RATE:-}" --requests 8 --modes auto,off --seed 1 --metrics-url http://127.0.0.1:9400/metrics --json $O/serve-bf16-cal$T.json || { kill -INT $SERVE; exit 1; }
stamp recalibrate
$B/specdec profile --recalibrate $O/bf16-profile$T.json --serve-json $O/serve-bf16-cal$T.json \
  --config configs/default.yaml -o $O/bf16-cal$T-profile.json
SAT=$($B/python -c "
import json; r=json.load(open('$O/serve-bf16-cal$T.json'))
t=[x['summary']['throughput_tok_s'] for x in r['results'] if x['mode']=='off' and x['kind']=='closed' and x['x']==8]
print(round(sum(t)/len(t)/32, 3))")
RATES=$($B/python -c "s=$SAT; print(','.join(str(round(s*f,3)) for f in (1/6, 1/2, 1)))")
echo "saturating $SAT/s, rates $RATES"
stamp predict
$B/specdec simulate --profile $O/bf16-cal$T-profile.json --rate $RATES --requests 24 --max-tokens 32 \
  --seed ${SEED:-23} --draws 20 --after $O/serve-bf16-cal$T.json --config configs/default.yaml \
  --json $O/predict-bf16-poisson$T.json
stamp poisson
$B/specdec bench serve --server 127.0.0.1:50051 --prompts humaneval:8 --max-tokens 32 --concurrency "" \
  --rate $RATES --requests 24 --modes auto,off --seed ${SEED:-23} --metrics-url http://127.0.0.1:9400/metrics \
  --json $O/serve-bf16-poisson$T.json
for REP in ${REPEATS:-1 2}; do
  stamp "repeat $REP of the loaded rates"
  $B/specdec bench serve --server 127.0.0.1:50051 --prompts humaneval:8 --max-tokens 32 --concurrency "" \
    --rate ${RATES#*,} --requests 24 --modes auto,off --seed ${SEED:-23} --metrics-url http://127.0.0.1:9400/metrics \
    --json $O/serve-bf16-poisson$T-rep$REP.json
done
stamp compare
$B/specdec simulate --profile $O/bf16-cal$T-profile.json --compare $O/serve-bf16-poisson$T.json \
  --draws 20 --after $O/serve-bf16-cal$T.json --config configs/default.yaml
for REP in ${REPEATS:-1 2}; do
  $B/specdec simulate --profile $O/bf16-cal$T-profile.json --compare $O/serve-bf16-poisson$T-rep$REP.json \
    --draws 20 --after $O/serve-bf16-cal$T.json --config configs/default.yaml | grep "^poisson.*|"
done
kill -INT $SERVE; wait $SERVE
stamp done
