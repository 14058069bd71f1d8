#!/usr/bin/env bash
# The capacity simulator against the service on this machine (docs/results.md, "The simulator
# against the service"): profile the machine, start a fresh `specdec serve`, calibrate the profile
# with a serve run, write the prediction for a Poisson run at 1/6, 1/2 and 1 of OFF's saturating
# rate, then run it (the two loaded rates REPEATS more times on the same service and arrivals, to
# show the machine's own spread) and print the comparisons.
#
# Run from the repository root, with nothing else running on the machine:
#   bench/plan_accuracy.sh
#   TAG=b SEED=59 CAL=1,2,4,8,1,2,4,8 CAL_RATE=0.3,0.3,0.3 bench/plan_accuracy.sh
#
# Settings (environment):
#   OUT        where files go (bench/out, ignored by git); each file name carries TAG
#   TAG        a name for this run's files (default: the UTC time)
#   PROFILE    an existing profile to reuse (default: OUT/profile-TAG.json, made when missing)
#   TARGET, DRAFT, DTYPE, CONFIG   the models and the service's config (the bf16 Qwen pair, configs/default.yaml)
#   CAL        the calibration's closed-loop levels; repeat them (1,2,4,8,1,2,4,8) on a machine whose
#              speed drifts, so each calibrated scale averages two moments
#   CAL_RATE   Poisson scenarios in the calibration too (e.g. 0.3,0.3,0.3), so rounds of one or two
#              rows under arrivals are measured, which closed loops do not
#   SEED       the Poisson arrivals' seed
#   REQUESTS   requests per rate (24); MAX_TOKENS tokens per request (32)
#   REPEATS    extra passes of the loaded rates (default "1 2"; "" for none)
#   SPECDEC    the command (default: .venv/bin/specdec when present, else specdec)
#   PYTHON     a Python with nothing special (default: .venv/bin/python when present, else python3)
# The service listens where CONFIG says (configs/default.yaml: 127.0.0.1:50051, metrics on 9400).
set -euo pipefail

OUT=${OUT:-bench/out}
TAG=${TAG:-$(date -u +%Y%m%dT%H%M%S)}
TARGET=${TARGET:-qwen2.5-coder-1.5b-instruct}
DRAFT=${DRAFT:-qwen2.5-coder-0.5b-instruct}
DTYPE=${DTYPE:-bfloat16}
CONFIG=${CONFIG:-configs/default.yaml}
CAL=${CAL:-1,2,4,8}
CAL_RATE=${CAL_RATE:-}
SEED=${SEED:-23}
REQUESTS=${REQUESTS:-24}
MAX_TOKENS=${MAX_TOKENS:-32}
REPEATS=${REPEATS-1 2}
SERVER=${SERVER:-127.0.0.1:50051}
METRICS=${METRICS:-http://127.0.0.1:9400/metrics}
if [ -z "${SPECDEC:-}" ]; then
  if [ -x .venv/bin/specdec ]; then SPECDEC=.venv/bin/specdec; else SPECDEC=specdec; fi
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

mkdir -p "$OUT"
PROFILE=${PROFILE:-$OUT/profile-$TAG.json}
CAL_JSON=$OUT/serve-cal-$TAG.json
CAL_PROFILE=$OUT/profile-cal-$TAG.json
PREDICT=$OUT/predict-$TAG.json
RUN=$OUT/serve-poisson-$TAG

stamp() { echo "== $(date -u +%H:%M:%S) $*"; }

if [ ! -f "$PROFILE" ]; then
  stamp profile
  "$SPECDEC" profile --target "$TARGET" --draft "$DRAFT" --dtype "$DTYPE" --threads 2 \
    --prompts humaneval:8 --max-tokens "$MAX_TOKENS" --batches 1,2,4,8,16 --config "$CONFIG" \
    --drafters draft --budget-s 840 -o "$PROFILE"
fi

stamp serve
"$SPECDEC" -v serve --config "$CONFIG" >"$OUT/serve-$TAG.log" 2>&1 &
SERVE=$!
trap 'kill -INT $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
  curl -s -o /dev/null "$METRICS" && break
  sleep 2
done
sleep 5

stamp calibration
"$SPECDEC" bench serve --server "$SERVER" --prompts humaneval:8 --max-tokens "$MAX_TOKENS" \
  --concurrency "$CAL" --rate "$CAL_RATE" --requests 8 --modes auto,off --seed 1 \
  --metrics-url "$METRICS" --json "$CAL_JSON"

stamp recalibrate
"$SPECDEC" profile --recalibrate "$PROFILE" --serve-json "$CAL_JSON" --config "$CONFIG" -o "$CAL_PROFILE"

# The saturating rate: OFF's closed-loop throughput at 8 clients over the tokens per request.
SAT=$("$PYTHON" -c "
import json, sys
r = json.load(open(sys.argv[1]))
t = [x['summary']['throughput_tok_s'] for x in r['results'] if x['mode'] == 'off' and x['kind'] == 'closed' and x['x'] == 8]
print(round(sum(t) / len(t) / int(sys.argv[2]), 3))" "$CAL_JSON" "$MAX_TOKENS")
RATES=$("$PYTHON" -c "import sys; s = float(sys.argv[1]); print(','.join(str(round(s * f, 3)) for f in (1 / 6, 1 / 2, 1)))" "$SAT")
echo "saturating $SAT/s, rates $RATES"

stamp predict
"$SPECDEC" simulate --profile "$CAL_PROFILE" --rate "$RATES" --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" \
  --seed "$SEED" --draws 20 --after "$CAL_JSON" --config "$CONFIG" --json "$PREDICT"

stamp poisson
"$SPECDEC" bench serve --server "$SERVER" --prompts humaneval:8 --max-tokens "$MAX_TOKENS" --concurrency "" \
  --rate "$RATES" --requests "$REQUESTS" --modes auto,off --seed "$SEED" --metrics-url "$METRICS" --json "$RUN.json"
for REP in $REPEATS; do
  stamp "pass $((REP + 1)) of the loaded rates"
  "$SPECDEC" bench serve --server "$SERVER" --prompts humaneval:8 --max-tokens "$MAX_TOKENS" --concurrency "" \
    --rate "${RATES#*,}" --requests "$REQUESTS" --modes auto,off --seed "$SEED" --metrics-url "$METRICS" \
    --json "$RUN-pass$((REP + 1)).json"
done

stamp compare
"$SPECDEC" simulate --profile "$CAL_PROFILE" --compare "$RUN.json" --draws 20 --after "$CAL_JSON" --config "$CONFIG"
for REP in $REPEATS; do
  "$SPECDEC" simulate --profile "$CAL_PROFILE" --compare "$RUN-pass$((REP + 1)).json" --draws 20 \
    --after "$CAL_JSON" --config "$CONFIG" | grep "^poisson.*|" || true
done
stamp done
