"""The configurations `specdec bench generate` compares, by name (a family, plus k for fixed-k ones)."""

from __future__ import annotations

HF_TARGET, HF_ASSISTED, HF_ASSISTED_K = "hf_target", "hf_assisted", "hf_assisted_k"
SPEC_TARGET, SPEC_DRAFT_K, SPEC_ADAPTIVE, SPEC_NGRAM, SPEC_DEFAULT = (
    "specdec_target",
    "specdec_draft_k",
    "specdec_draft_adaptive",  # the draft model's chain, adaptive k
    "specdec_ngram",
    "specdec_default",  # what `specdec generate` runs with the draft model: DraftOptions as given
)
FAMILIES = (HF_TARGET, HF_ASSISTED, HF_ASSISTED_K, SPEC_TARGET, SPEC_DRAFT_K, SPEC_ADAPTIVE, SPEC_NGRAM, SPEC_DEFAULT)
NEEDS_DRAFT = (HF_ASSISTED, HF_ASSISTED_K, SPEC_DRAFT_K, SPEC_ADAPTIVE, SPEC_DEFAULT)


def family(name: str) -> str:
    for fam in (SPEC_DRAFT_K, HF_ASSISTED_K):
        if name.startswith(fam) and name[len(fam) :].isdigit():
            return fam
    return name


def fixed_k(name: str) -> int | None:
    fam = family(name)
    return int(name[len(fam) :]) if fam in (SPEC_DRAFT_K, HF_ASSISTED_K) else None
