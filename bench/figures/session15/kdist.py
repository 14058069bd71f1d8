"""Draft lengths per request-round from round lines (a `specdec -v serve` log, or a `specdec -v
simulate` log), optionally within a time window of the service's log.

Usage: python kdist.py LOG [FROM TO]   (FROM, TO as HH:MM:SS,mmm)
"""

import collections
import re
import sys

ROUND = re.compile(r"round on \S+: (.*?); c ")


def main(path: str, start: str = "", end: str = "~") -> None:
    asked: collections.Counter[int] = collections.Counter()
    batches: collections.Counter[int] = collections.Counter()
    rows = rounds = caps = 0
    for line in open(path):
        stamp = line.split()[1] if line.startswith("20") else ""
        if start and not start <= stamp <= end:
            continue
        if "draft length on" in line and "capped" in line:
            caps += 1
        m = ROUND.search(line)
        if not m:
            continue
        items = m.group(1).split()  # p<prompt>@<generated>:k<asked>/d<drafted>
        rounds += 1
        batches[len(items)] += 1
        for item in items:
            asked[int(item.split(":")[1].split("/")[0][1:])] += 1
            rows += 1
    mean_k = sum(k * n for k, n in asked.items()) / max(rows, 1)
    print(f"rounds {rounds}, rows {rows}, mean batch {rows / max(rounds, 1):.2f}, k asked {mean_k:.2f}, caps {caps}")
    print(" k asked:", sorted(asked.items()))
    print(" batch:", sorted(batches.items()))


if __name__ == "__main__":
    main(*sys.argv[1:])
