"""The draft prefill scale each prefilling Propose of a serve log window needed: its compute less its draft
steps (as the calibrated profile prices them) over the profile's prefill curve, the prompts priced as one
sequence or one by one (the prompts a call carried guessed at 158 tokens each).

Usage (from the repository root): python prefmodel.py TAG LOG HH:MM:SS-HH:MM:SS ..."""

import re
import statistics as st
import sys

from cluster.planning.costs import ProfileCosts
from cluster.planning.profile import Profile

T, log = sys.argv[1], sys.argv[2]
prof = Profile.load(f"bench/out/bf16-cal{T}-profile.json")
c = ProfileCosts(prof, "draft")
g = prof.draft_prefill
pat = re.compile(
    r"^\S+ (\S+) DEBUG router.drafter_pool: propose on \S+: (\d+) rows, (\d+) steps, (\d+) new tokens; "
    r"queued (\d+) ms, ran (\d+) ms \(computed (\d+)\)"
)
for win in sys.argv[3:]:
    a, b = win.split("-")
    out = []
    for line in open(log):
        m = pat.match(line)
        if not m or not (a <= m.group(1) <= b):
            continue
        rows, steps, new, q, ran, comp = map(int, m.groups()[1:])
        if new < 64:
            continue
        npr = max(1, round(new / 158))
        pre = comp - 1e3 * c.draft_s(rows, steps, 0)
        out.append((npr, pre / g.at(new), pre / (npr * g.at(new / npr)), pre, new))
    if out:
        calls = f"n {len(out)} prompts/call {st.mean(o[0] for o in out):.1f} tokens {st.mean(o[4] for o in out):.0f}"
        scales = f"one sequence {st.median(o[1] for o in out):.2f}, per prompt {st.median(o[2] for o in out):.2f}"
        print(f"{win} {calls}: needed scale, {scales}")
