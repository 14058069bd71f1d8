"""The mixed request set of the service's 16-stream test (tests/integration/test_service.py)."""

from __future__ import annotations

from specdec.core.params import SamplingParams


def mixed_requests(base: list[list[int]], greedy_ref) -> list[tuple[dict, SamplingParams | None]]:
    """16 requests over the prompts ``base`` (6 token lists): greedy in every speculation mode
    and k, seeded (invariant) sampling, stops (cut from ``greedy_ref``, the engine's greedy output
    for ``base[0]`` at 40 tokens), and unseeded sampling (checked for shape only). Each with the
    SamplingParams of its engine reference (None: not comparable)."""
    text = greedy_ref.text
    stop_str = text[len(text) // 3 : len(text) // 3 + 2]
    assert len(stop_str) == 2
    stop_tok = greedy_ref.token_ids[12]
    reqs: list[tuple[dict, SamplingParams | None]] = []
    for i, mode in enumerate(["auto", "draft", "ngram", "off", "draft", "auto"]):
        reqs.append(
            (
                dict(prompt_token_ids=base[i], max_tokens=30 + i, ignore_eos=True, mode=mode, k=[0, 2, 3, 0, 5, 1][i]),
                SamplingParams(max_tokens=30 + i, ignore_eos=True),
            )
        )
    for i, seed in enumerate([1, 7, 42, 2**63 + 5]):
        kw = dict(temperature=0.8, top_p=0.9, top_k=[0, 20, 0, 50][i], seed=seed)
        reqs.append(
            (
                dict(
                    prompt_token_ids=base[i + 1],
                    max_tokens=25,
                    ignore_eos=True,
                    mode=["draft", "ngram", "auto", "off"][i],
                    **kw,
                ),
                SamplingParams(max_tokens=25, ignore_eos=True, **kw),
            )
        )
    reqs.append(
        (
            dict(prompt_token_ids=base[0], max_tokens=40, ignore_eos=True, stop=[stop_str]),
            SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop_str,)),
        )
    )
    reqs.append(
        (
            dict(prompt_token_ids=base[0], max_tokens=40, ignore_eos=True, stop_token_ids=[stop_tok]),
            SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop_tok,)),
        )
    )
    reqs.append(
        (
            dict(prompt_token_ids=base[2], max_tokens=40, mode="draft"),  # EOS may stop it
            SamplingParams(max_tokens=40),
        )
    )
    for i in range(3):  # unseeded sampling (rejection): the target's distribution, not comparable
        reqs.append(
            (
                dict(
                    prompt_token_ids=base[3 + i],
                    max_tokens=20,
                    temperature=1.0,
                    ignore_eos=True,
                    mode=["draft", "ngram", "auto"][i],
                ),
                None,
            )
        )
    assert len(reqs) == 16
    return reqs
