"""Per request, a bench serve run's records beside one simulated draw of the same scenario: start,
TTFT, TPOT, rounds, accepted / drafted.

Usage (from the repository root): python perreq.py TAG cal|poisson X MODE, e.g. perreq.py 19 cal 2 auto, for
bench/out/serve-bf16-{cal,poisson}TAG.json and bench/out/bf16-calTAG-profile.json (or the profile in $PROF)."""

import json
import statistics as st
import sys

import cluster.planning.predict as P
from cluster.config import load_config
from cluster.planning.profile import Profile

T, which, x, mode = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
OUT = "bench/out"
captured = []
orig = P.simulate


def grab(*a, **k):
    r = orig(*a, **k)
    captured.append(r)
    return r


P.simulate = grab
prof = Profile.load(__import__("os").environ.get("PROF") or f"{OUT}/bf16-cal{T}-profile.json")
serve = load_config("configs/default.yaml")
meas = json.load(open(f"{OUT}/serve-bf16-{which}{T}.json"))
after = json.load(open(f"{OUT}/serve-bf16-cal{T}.json")) if which == "poisson" else None
sc, opts = P.scenarios_of(meas)
n_after = 0
if after:
    n_after = len(P.scenarios_of(after)[0]) * len(after["options"].get("modes") or ["auto", "off"])
pred = P.predict_bench(
    prof,
    serve,
    sc,
    opts.get("requests"),
    opts.get("max_tokens"),
    tuple(opts.get("modes")),
    opts.get("seed"),
    True,
    1,
    after,
)
sims = captured[n_after:]
i = [k for k, r in enumerate(pred["results"]) if r["x"] == x and r["mode"] == mode][0]
sim = sims[i].records
svc = [r for r in meas["results"] if r["x"] == x and r["mode"] == mode][0]["records"]
t0s = min(r["t_start"] for r in svc)


def row(r, t0):
    n = r["tokens"]
    tp = (r["t_last"] - r["t_first"]) / (n - 1) * 1e3
    ttft = 1e3 * (r["t_first"] - r["t_start"])
    acc = f"{r['stats'].get('accepted', 0):3d}/{r['stats'].get('drafted', 0):3d}"
    return f"start {r['t_start'] - t0:6.2f} ttft {ttft:6.0f} tpot {tp:5.0f} rounds {r['stats']['rounds']:3d} acc {acc}"


print(f"{'svc':55s} | sim")
for a, b in zip(sorted(svc, key=lambda r: r["t_start"]), sorted(sim, key=lambda r: r["t_start"])):
    print(a["id"][-3:], row(a, t0s), "|", b["id"][-12:], row(b, 0))
for name, rs in (("svc", svc), ("sim", sim)):
    tp = [(r["t_last"] - r["t_first"]) / (r["tokens"] - 1) * 1e3 for r in rs]
    print(
        name,
        "tpot p50",
        round(st.median(tp)),
        "ttft p50",
        round(st.median([1e3 * (r["t_first"] - r["t_start"]) for r in rs])),
        "rounds",
        sum(r["stats"]["rounds"] for r in rs),
    )
