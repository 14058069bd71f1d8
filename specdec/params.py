"""Request parameters and the verification mode, importable without torch (the router uses them)."""

from specdec.sampling import InvalidParams, SamplingParams
from specdec.verify import VerifyMode, choose_mode

__all__ = ["InvalidParams", "SamplingParams", "VerifyMode", "choose_mode"]
