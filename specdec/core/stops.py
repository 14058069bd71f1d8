"""Stop conditions applied to every accepted token, in order (docs/design.md, invariant 5).

Rules (the same as vLLM's defaults):

* EOS (unless ``ignore_eos``) or a stop token id: the token **is** committed (it is the last token
  id of the output and counts toward max_tokens), its text is **not** added; finish "stop".
* Stop string: the token that completes the stop string is committed; the text is truncated just
  before the stop string (the stop string and anything after it are not in ``text``); finish "stop".
  If several stop strings match, the one that starts earliest wins.
* max_tokens: the max_tokens-th token is committed; finish "length".  A token that is both a stop
  and the max_tokens-th reports "stop".
* Nothing after the stopping token is committed or counted.

Detokenisation is incremental (as in vLLM): each step decodes only the tokens since the last
emitted text plus a few tokens of left context, so a chunk costs O(chunk) rather than O(length),
and multi-byte characters split across tokens are emitted once complete.  Stop strings are
searched only in the tail that the new text could have completed, so matches spanning token
boundaries are found.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from specdec.core.params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["StopChecker"]

_REPLACEMENT = "\ufffd"  # what decoders emit for an incomplete UTF-8 sequence
_CONTEXT_TOKENS = 6  # left context kept so decoders that strip a leading space see it


class StopChecker:
    """Per-sequence stop state.  Feed each round's tokens with :meth:`accept`."""

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: set[int] | frozenset[int] | Sequence[int],
        decode: Callable[[list[int]], str],
        *,
        prompt_tokens: Sequence[int] = (),
    ) -> None:
        self.params = params
        self._stop_ids = frozenset(params.stop_token_ids)
        self._eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._decode = decode
        self._stops = tuple(params.stop)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self.tokens: list[int] = []  # committed generated tokens
        self.finish_reason: str | None = None
        self._text = ""
        # Tokens fed to the detokeniser (stop/EOS tokens excluded): the last few prompt tokens give
        # context, so the first generated token decodes with its leading space.
        self._dec: list[int] = list(prompt_tokens[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._dec)

    # -- public state -----------------------------------------------------------------------
    @property
    def num_generated(self) -> int:
        return len(self.tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """Generated text so far; a matched stop string and everything after it are excluded."""
        return self._text

    @property
    def stable_text(self) -> str:
        """The prefix of :attr:`text` that can no longer change: while running, a tail that could
        still be the start of a stop string is held back (what a streaming API may send)."""
        if self.finished or not self._stops:
            return self._text
        text = self._text
        hold = 0
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                hold = n
                break
        return text[: len(text) - hold]

    # -- feeding ----------------------------------------------------------------------------
    def accept(self, new_tokens: Sequence[int]) -> tuple[list[int], str | None]:
        """Apply the stop rules to this round's tokens in order.

        Returns (tokens to commit, finish_reason); finish_reason is "stop", "length" or None.
        After a finish, further calls commit nothing and repeat the finish reason.
        """
        committed: list[int] = []
        if self.finished:
            return committed, self.finish_reason
        for tok in new_tokens:
            tok = int(tok)
            committed.append(tok)
            self.tokens.append(tok)
            if tok in self._eos or tok in self._stop_ids:
                self._finish("stop")
                break
            new_text = self._detok_step(tok)
            if new_text and self._stops and self._match_stop(len(self._text) - len(new_text)):
                self._finish("stop", flush=False)
                break
            if len(self.tokens) >= self.params.max_tokens:
                self._finish("length")
                break
        return committed, self.finish_reason

    # -- internals --------------------------------------------------------------------------
    def _detok_step(self, tok: int) -> str:
        """Add one token to the detokeniser; return the newly complete text (may be empty)."""
        self._dec.append(tok)
        prefix = self._decode(self._dec[self._prefix_offset : self._read_offset])
        full = self._decode(self._dec[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            new_text = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._dec)
            self._text += new_text
            return new_text
        return ""

    def _flush(self) -> bool:
        """Emit text still held back for an incomplete character (at finish); True if it completed
        a stop string."""
        if self._read_offset < len(self._dec):
            prefix = self._decode(self._dec[self._prefix_offset : self._read_offset])
            full = self._decode(self._dec[self._prefix_offset :])
            if len(full) > len(prefix):
                start = len(self._text)
                self._text += full[len(prefix) :]
                self._read_offset = len(self._dec)
                return bool(self._stops) and self._match_stop(start)
        return False

    def _match_stop(self, new_start: int) -> bool:
        """Find the earliest stop string that ends in the new text; truncate before it."""
        lo = max(0, new_start - self._max_stop + 1)
        best = -1
        for s in self._stops:
            i = self._text.find(s, lo)
            if i != -1 and (best == -1 or i < best):
                best = i
        if best == -1:
            return False
        self._text = self._text[:best]
        return True

    def _finish(self, reason: str, *, flush: bool = True) -> None:
        if flush and self._flush():
            reason = "stop"
        self.finish_reason = reason
        logger.debug("sequence finished (%s) after %d tokens", reason, len(self.tokens))
