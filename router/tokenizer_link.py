"""The router's tokenizer from the target worker, and the draft/target tokenizer check.

The router needs the target's tokenizer to build text and apply stop strings; it asks the target
worker for it (``GetTokenizer``), so the node the router runs on needs no model files. A drafter
must speak the target's token ids: its vocabulary fingerprint (``WorkerInfo``) must equal the
target's, checked at start-up and whenever a drafter (re)joins; a mismatch refuses that drafter.
"""

from __future__ import annotations

import logging

from router.detok import Detokenizer
from router.workers import WorkerClient
from specdec.core.tokenizer_spec import vocab_fingerprint
from specdec.rpc import worker_pb2

log = logging.getLogger(__name__)

__all__ = ["TokenizerMismatch", "fetch_detokenizer", "drafter_mismatch"]


class TokenizerMismatch(RuntimeError):
    pass


async def fetch_detokenizer(target: WorkerClient, timeout: float = 30.0) -> tuple[Detokenizer, str]:
    """The target's detokenizer and vocabulary fingerprint, from its GetTokenizer answer."""
    resp = await target.call("GetTokenizer", worker_pb2.GetTokenizerRequest(), timeout=timeout)
    detok = Detokenizer.from_json(resp.tokenizer_json, resp.clean_up_tokenization_spaces)
    got = vocab_fingerprint(detok.vocab())
    if got != resp.fingerprint:  # the fingerprint must describe the tokenizer that travelled
        raise TokenizerMismatch(
            f"target worker {target.name}: GetTokenizer's fingerprint {resp.fingerprint} does not match "
            f"its tokenizer.json ({got})"
        )
    log.info("tokenizer of target %s loaded over gRPC (%s)", target.name, got)
    return detok, got


def drafter_mismatch(draft_fingerprint: str, draft_name: str, targets: dict[str, str]) -> str | None:
    """Why drafter ``draft_name`` cannot serve ``targets`` (target name -> fingerprint), or None.

    An empty draft fingerprint is a drafter without a tokenizer (n-gram): it works on the
    target's ids, so it always fits. A shared drafter must fit every target it may serve.
    """
    if not draft_fingerprint:
        return None
    bad = sorted(name for name, fp in targets.items() if fp and fp != draft_fingerprint)
    if not bad:
        return None
    return (
        f"draft worker {draft_name} refused: its tokenizer ({draft_fingerprint}) differs from target "
        f"{', '.join(f'{n} ({targets[n]})' for n in bad)}; a drafter must use the target's vocabulary "
        "(same token ids). Serve it with a draft model that shares the target's tokenizer."
    )
