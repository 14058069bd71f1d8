"""One-row Verifies of a serve log window, the worker's compute by draft tokens (median, count).

Usage: python v1row.py LOG HH:MM:SS-HH:MM:SS ..."""

import re
import statistics as st
import sys

pat = re.compile(
    r"^\S+ (\S+) DEBUG router.target_balance: round on \S+: (.*?); c .* "
    r"draft wait (\d+) ms, verify (\d+) ms(?: \(computed (\d+)\))?"
)
log = sys.argv[1]
for win in sys.argv[2:]:
    a, b = win.split("-")
    by = {}
    for line in open(log):
        m = pat.match(line)
        if not m or not (a <= m.group(1) <= b):
            continue
        items = m.group(2).split()
        if len(items) != 1:
            continue
        k = int(items[0].split(":")[1].split("/")[1][1:])
        by.setdefault(min(k, 9), []).append(int(m.group(5) or m.group(4)))
    print(win, " ".join(f"d{k}:{st.median(v):.0f}(n{len(v)})" for k, v in sorted(by.items())))
