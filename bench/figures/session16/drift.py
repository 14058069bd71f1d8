"""The VM's drift: the median of one-row plain verifies (the worker's own compute) per minute of
`specdec -v serve` logs. Usage: python drift.py LOG..."""

import re
import statistics
import sys

ROUND = re.compile(
    r"^\S+ (\d\d:\d\d):\S+ DEBUG router.target_balance: round on \S+: (.*?); c .* "
    r"verify (\d+) ms(?: \(computed (\d+)\))?"
)


def main(paths: list[str]) -> None:
    by_minute: dict[str, list[int]] = {}
    for path in paths:
        for line in open(path):
            m = ROUND.match(line)
            if m and len(m.group(2).split()) == 1 and ":k0/" in m.group(2):
                by_minute.setdefault(m.group(1), []).append(int(m.group(4) or m.group(3)))
    for minute, ms in sorted(by_minute.items()):
        if len(ms) >= 5:
            print(minute, round(statistics.median(ms)), f"({len(ms)} rounds)")


if __name__ == "__main__":
    main(sys.argv[1:])
