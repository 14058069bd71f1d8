"""The draft runner's forward of a new prompt beside one-token rows: one forward, or apart.

Usage: python mixed_forward.py   (the Qwen 0.5B draft in bf16, as drafters build it; 2 threads)
"""

import time

import torch

from specdec.core.build import make_draft_runner
from specdec.core.models import load_model


def main() -> None:
    torch.set_num_threads(2)
    runner = make_draft_runner(load_model("qwen2.5-coder-0.5b-instruct", "bfloat16"), num_slots=8, max_len=4096)
    gen = torch.Generator().manual_seed(0)
    ctx = [torch.randint(100, 5000, (180,), generator=gen).tolist() for _ in range(4)]
    for slot in (1, 2, 3):  # three decoding rows holding 180 tokens each
        runner.forward([slot], [ctx[slot]], num_logits=0)

    def prompt_alone() -> None:
        runner.rollback(0, 0)
        runner.forward([0], [ctx[0]])

    def decode_rows() -> None:
        for slot in (1, 2, 3):
            runner.rollback(slot, 180)
        runner.forward([1, 2, 3], [[7], [8], [9]])

    def together() -> None:
        runner.rollback(0, 0)
        for slot in (1, 2, 3):
            runner.rollback(slot, 180)
        runner.forward([0, 1, 2, 3], [ctx[0], [7], [8], [9]], num_logits=1)

    for name, fn in (("prompt alone", prompt_alone), ("3 decode rows", decode_rows), ("together", together)):
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(f"{name}: {1e3 * sorted(times)[3]:.1f} ms (median of 7)")


if __name__ == "__main__":
    main()
