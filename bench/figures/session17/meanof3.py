"""A protocol run's prediction against the mean of the service's passes of the same arrivals, with the
passes' own spread (max / min - 1): the service's run-to-run noise beside the simulator's error.

Usage: python meanof3.py DIR RUN... (DIR holds predict-bf16-poissonN.json, serve-bf16-poissonN.json and
its -rep1 / -rep2 passes, as bench/figures/session16/protocol.sh writes them)."""

import json
import statistics
import sys


def rows(folder: str, run: str) -> None:
    predicted = json.load(open(f"{folder}/predict-bf16-poisson{run}.json"))
    passes = [json.load(open(f"{folder}/serve-bf16-poisson{run}{s}.json")) for s in ("", "-rep1", "-rep2")]
    for row in predicted["results"]:
        measured = [
            r["summary"]
            for p in passes
            for r in p["results"]
            if r["mode"] == row["mode"] and abs(r["x"] - row["x"]) < 1e-6
        ]
        for key in ("throughput_tok_s", "tpot_ms_p50"):
            values = [m[key] for m in measured]
            mean, pred = statistics.mean(values), row["summary"][key]
            print(
                f"{run} {row['x']:.3f}/s {row['mode']:4} {key:16} predicted {pred:7.1f} passes "
                f"{' '.join(f'{v:6.1f}' for v in values):21} mean {mean:7.1f} error {100 * (pred / mean - 1):+4.0f} % "
                f"spread {100 * (max(values) / min(values) - 1):3.0f} %"
            )


if __name__ == "__main__":
    for tag in sys.argv[2:]:
        rows(sys.argv[1], tag)
