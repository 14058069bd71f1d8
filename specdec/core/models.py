"""Loading causal LMs: by model pack name, local HF folder, GGUF file, or pulled hub id
(the sources of :mod:`specdec.core.model_source`); nothing here downloads."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdec.core.dtypes import DTYPE_NAMES

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
DEVICES = ("cpu", "cuda")


class ModelLoadError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module  # a transformers PreTrainedModel in eval mode
    tokenizer: object  # a transformers tokenizer
    dtype: torch.dtype
    device: torch.device

    @property
    def eos_token_ids(self) -> set[int]:
        """EOS ids from the generation config and the tokenizer (chat models often have several)."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def parse_device(name: str | torch.device) -> torch.device:
    device = torch.device(name)
    if device.type not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available on this machine")
    return device


def _resolve(spec: str) -> tuple[str, str | None]:
    """Return (local folder, gguf file name or None) for a model spec (specdec.core.model_source)."""
    from specdec.core.model_source import ModelSourceError, local_files

    try:
        folder, gguf_file = local_files(spec)
    except ModelSourceError as exc:  # a worker reports it as FAILED_PRECONDITION (specdec.rpc.errors)
        raise ModelLoadError(str(exc)) from exc
    return str(folder), gguf_file


def load_model(spec: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu") -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype, torch_device = parse_dtype(dtype), parse_device(device)
    source, gguf_file = _resolve(spec)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    log.info("loading %s (%s, %s)", spec, torch_dtype, torch_device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, local_files_only=True, **kwargs)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot load {spec!r}: {exc}. Use a model pack name (see `specdec models list`), "
            "a local folder, a .gguf file, or a pulled hub id ORG/NAME@REVISION"
        ) from exc
    model.to(torch_device).eval()
    return LoadedModel(spec, model, tokenizer, torch_dtype, torch_device)


def load_config(spec: str):
    """The transformers config of a model spec, without loading its weights."""
    from transformers import AutoConfig

    source, gguf_file = _resolve(spec)
    try:
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        return AutoConfig.from_pretrained(source, local_files_only=True, **kwargs)
    except OSError as exc:
        raise ModelLoadError(f"cannot read the config of {spec!r}: {exc}") from exc
