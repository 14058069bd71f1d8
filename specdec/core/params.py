"""Request parameters and the verification mode: torch-free, so the router can use them.

:class:`SamplingParams` validates itself, naming the bad field (:class:`InvalidParams`, mapped to
INVALID_ARGUMENT at the edge); :func:`choose_mode` picks the lossless verification mode.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["InvalidParams", "SamplingParams", "VerifyMode", "choose_mode"]

_U64 = 2**64


class InvalidParams(ValueError):
    """A request parameter is out of range; ``field`` names it (mapped to INVALID_ARGUMENT at the edge)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):  # picklable across processes (Ray actors re-raise pickled exceptions)
        return (type(self), (self.field, self.message))


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool) or getattr(getattr(x, "dtype", None), "kind", None) == "b"


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not _is_bool(x)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not _is_bool(x)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters.

    ``stop`` and ``stop_token_ids`` accept any sequence (lists from JSON/protobuf) and are
    stored as tuples so the object stays hashable; a bare string ``stop="x"`` means ``("x",)``.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, vocab_size: int | None = None, max_context: int | None = None, prompt_len: int = 0) -> None:
        """Raise :class:`InvalidParams` naming the first bad field and its allowed range."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidParams("max_tokens", f"must be an integer >= 1 (got {self.max_tokens!r})")
        if max_context is not None:
            if prompt_len >= max_context:
                raise InvalidParams(
                    "prompt",
                    f"prompt has {prompt_len} tokens; the model's context is {max_context} tokens, "
                    "which leaves no room to generate",
                )
            if prompt_len + self.max_tokens > max_context:
                raise InvalidParams(
                    "max_tokens",
                    f"must be in [1, {max_context - prompt_len}]: prompt ({prompt_len} tokens) + "
                    f"max_tokens ({self.max_tokens}) exceeds the model's context of {max_context}",
                )
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidParams("temperature", f"must be a finite number >= 0 (got {self.temperature!r})")
        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            raise InvalidParams("top_p", f"must be in (0, 1] (got {self.top_p!r})")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidParams("top_k", f"must be an integer >= 0, 0 = off (got {self.top_k!r})")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < _U64)):
            raise InvalidParams("seed", f"must be an integer in [0, 2**64) (got {self.seed!r})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParams("stop", f"stop strings must be non-empty strings (got {s!r})")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                upper = f"{vocab_size})" if vocab_size is not None else "vocab_size)"
                raise InvalidParams("stop_token_ids", f"ids must be in [0, {upper} (got {t!r})")
        if not _is_bool(self.ignore_eos):
            raise InvalidParams("ignore_eos", f"must be a boolean (got {self.ignore_eos!r})")


class VerifyMode(StrEnum):
    GREEDY = "greedy"
    REJECTION = "rejection"
    INVARIANT = "invariant"


def choose_mode(params: SamplingParams, requested: str | VerifyMode | None = None) -> VerifyMode:
    """Pick the verification mode for a request.

    temperature 0 -> greedy (whatever was requested: all modes coincide there).  Otherwise
    ``requested`` wins; by default seeded requests use ``invariant`` and the rest ``rejection``.
    Asking for ``invariant`` without a seed, or ``greedy`` with temperature > 0 (which would not be
    lossless), raises :class:`InvalidParams`.
    """
    if requested is not None and not isinstance(requested, VerifyMode):
        try:
            requested = VerifyMode(str(requested).lower())
        except ValueError:
            allowed = ", ".join(m.value for m in VerifyMode)
            raise InvalidParams("verify_mode", f"must be one of {allowed} (got {requested!r})") from None
    if params.greedy:
        return VerifyMode.GREEDY
    if requested is VerifyMode.GREEDY:
        raise InvalidParams(
            "verify_mode", "'greedy' verification needs temperature 0 (it is not lossless when sampling)"
        )
    if requested is VerifyMode.INVARIANT and params.seed is None:
        raise InvalidParams("verify_mode", "'invariant' verification needs a seed (set seed >= 0)")
    if requested is not None:
        return requested
    return VerifyMode.INVARIANT if params.seed is not None else VerifyMode.REJECTION
