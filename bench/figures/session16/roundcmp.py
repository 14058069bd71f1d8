"""Round statistics of a `specdec -v serve` log's window, or of a `specdec -v simulate` log's rounds between
two finished requests: rows, k, draft wait and verify, by rows in the round.

Usage: python roundcmp.py "LOG|HH:MM:SS|HH:MM:SS" "SIMLOG|#64|#88" ..."""

import re
import statistics as st
import sys

pat = re.compile(
    r"^\S+ (\S+) DEBUG router.target_balance: round on \S+: (.*?); c (\S+) r (\S+); "
    r"draft wait (\d+) ms, verify (\d+) ms"
)


def rounds(path, a, b):
    fin = 0
    out = []
    sim = a.startswith("#")
    for line in open(path):
        if sim and "sequence finished" in line:
            fin += 1
            continue
        m = pat.match(line)
        if not m:
            continue
        if sim:
            if not (int(a[1:]) <= fin < int(b[1:])):
                continue
        elif not (a <= m.group(1) <= b):
            continue
        items = m.group(2).split()
        ks = [int(i.split(":")[1].split("/")[0][1:]) for i in items]
        out.append(
            dict(rows=len(items), k=ks, c=float(m.group(3)), r=float(m.group(4)), w=int(m.group(5)), v=int(m.group(6)))
        )
    return out


def show(name, rs):
    rows = sum(r["rows"] for r in rs)
    ks = [k for r in rs for k in r["k"]]
    zero = sum(k == 0 for k in ks)
    print(
        f"{name}: rounds {len(rs)} rows/round {rows / len(rs):.2f} k {st.mean(ks):.2f} k0 {zero}/{len(ks)} "
        f"c {st.mean(r['c'] for r in rs):.3f} r {st.mean(r['r'] for r in rs):.3f} "
        f"wait {st.mean(r['w'] for r in rs):.0f} verify {st.mean(r['v'] for r in rs):.0f}"
    )
    by = {}
    for r in rs:
        by.setdefault(min(r["rows"], 6), []).append(r)
    for n in sorted(by):
        g = by[n]
        kk = [k for r in g for k in r["k"]]
        line = f"   rows {n}: {len(g)} rounds, verify {st.mean(r['v'] for r in g):.0f}"
        drafting = [r for r in g if max(r["k"]) > 0]
        if drafting:
            per_step = st.mean(r["w"] / max(r["k"]) for r in drafting)
            line += f", k {st.mean(kk):.2f}, wait {st.mean(r['w'] for r in g):.0f}, wait/step {per_step:.1f}"
        print(line)


for spec in sys.argv[1:]:
    p, a, b = spec.split("|")
    show(p.split("/")[-1] + f" [{a}..{b}]", rounds(p, a, b))
