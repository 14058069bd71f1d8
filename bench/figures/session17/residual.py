"""A serve log's rounds priced by the simulator's cost model: each Verify's compute time over what
`ProfileCosts.verify_s` prices for its rows and packed width (as the simulator prices a round), median
by rows and by kind (plain: no row drafted; speculative: every row drafted; mixed).

Usage: python residual.py PROFILE "LOG|HH:MM:SS|HH:MM:SS" ... (run from the repository root)"""

import re
import statistics
import sys

from cluster.planning.costs import ProfileCosts
from cluster.planning.profile import Profile

ROUND = re.compile(
    r"^\S+ (\S+) DEBUG router.target_balance: round on \S+: (.*?); c .* "
    r"draft wait (\d+) ms, verify (\d+) ms(?: \(computed (\d+)\))?"
)


def main(profile: str, windows: list[str]) -> None:
    costs = ProfileCosts(Profile.load(profile))
    groups: dict[tuple[str, str], list[float]] = {}
    for window in windows:
        log, start, end = window.split("|")
        for line in open(log):
            m = ROUND.match(line)
            if not m or not (start <= m.group(1)[:8] <= end):
                continue
            drafted = [int(item.split("/d")[1]) for item in m.group(2).split()]
            rows, width = len(drafted), sum(d + 1 for d in drafted) / len(drafted)
            ratio = int(m.group(5) or m.group(4)) / (1e3 * costs.verify_s(rows, width, 0))
            kind = "plain" if max(drafted) == 0 else "speculative" if min(drafted) > 0 else "mixed"
            groups.setdefault((str(rows) if rows < 4 else "4+", kind), []).append(ratio)
    for (rows, kind), ratios in sorted(groups.items()):
        print(f"rows {rows:2} {kind:11} {len(ratios):4} rounds, measured / priced {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
