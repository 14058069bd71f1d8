"""What one benchmark run of one configuration on one prompt recorded (rounds, timings, tokens)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Round:
    seconds: float  # wall time of the round (draft + verify + bookkeeping)
    committed: int  # tokens the round added to the output
    drafted: int  # draft tokens sent for verification
    draft_s: float  # time spent drafting


@dataclass
class Run:
    config: str
    prompt_index: int
    prompt_id: str
    repeat: int
    prompt_tokens: int
    seconds: float
    token_ids: list[int]
    text: str
    finish_reason: str
    rounds: list[Round]
    stats: dict | None = None  # specdec's RequestStats, as it counted them
    load_avg_1m: float | None = None  # the machine's 1-minute load average when the request ended

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def accepted_per_round(self) -> list[tuple[int, int]]:
        """(accepted, drafted) per round usable for the acceptance estimate.

        A round commits its accepted drafts plus the target's own token; the last round of a
        request that ended on EOS may be cut short by the stop rule, so it is left out.
        """
        usable = self.rounds[:-1] if self.finish_reason == "stop" else self.rounds
        return [(max(0, min(r.committed - 1, r.drafted)), r.drafted) for r in usable]

    def as_dict(self) -> dict:
        d = asdict(self)
        d["rounds"] = {
            "seconds": [round(r.seconds, 5) for r in self.rounds],
            "committed": [r.committed for r in self.rounds],
            "drafted": [r.drafted for r in self.rounds],
            "draft_s": [round(r.draft_s, 5) for r in self.rounds],
        }
        d["seconds"] = round(self.seconds, 5)
        d["output_tokens"] = self.tokens
        return d


def run_from_record(rec: dict) -> Run:
    """A :class:`Run` back from its JSON record (to summarise a saved result again)."""
    rd = rec["rounds"]
    rounds = [Round(*vals) for vals in zip(rd["seconds"], rd["committed"], rd["drafted"], rd["draft_s"])]
    return Run(
        rec["config"],
        rec["prompt_index"],
        rec["prompt_id"],
        rec["repeat"],
        rec["prompt_tokens"],
        rec["seconds"],
        rec["token_ids"],
        rec["text"],
        rec["finish_reason"],
        rounds,
        rec.get("stats"),
        rec.get("load_avg_1m"),
    )


# (seconds, output token ids, text, finish reason, rounds, specdec's RequestStats as a dict or None)
Outcome = tuple[float, list[int], str, str, list[Round], dict | None]
