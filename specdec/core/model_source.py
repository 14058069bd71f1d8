"""Where a model comes from: the one string ``--target``, ``--draft``, ``target.model`` and
``specdec models prepare`` take (torch-free, offline).

A model source is one of (docs/models.md):

- a **pack name**: the offline demo catalog (:mod:`specdec.core.packs`);
- a **local Hugging Face folder** (config.json, tokenizer files, safetensors), used in place;
- a **GGUF file**: a path ending ``.gguf``, dequantised by transformers when loaded;
- a **hub id with a revision**, ``ORG/NAME@REVISION``: pulled once into the model cache by
  :mod:`specdec.core.hub_pull`, then read from there; serving never talks to the hub.

:func:`parse_source` says which, :func:`local_files` where the files are on this machine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from specdec.core import packs

__all__ = [
    "HUB_MARKER",
    "ModelSource",
    "ModelSourceError",
    "ModelNotPulled",
    "parse_source",
    "local_files",
    "hub_repo_dir",
    "hub_snapshot_dir",
    "read_hub_marker",
    "pulled_models",
]

HUB_MARKER = "specdec_source.json"  # written last into a pulled snapshot: its presence means "complete"

# A hub repo id (ORG/NAME, the hub's own character set) and an optional @REVISION (branch, tag or commit).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


class ModelSourceError(packs.PackError):
    """A model string names no usable model (a missing file, a hub id without a revision, ...)."""


class ModelNotPulled(ModelSourceError):
    """A hub model is not in the model cache yet."""


@dataclass(frozen=True)
class ModelSource:
    spec: str  # the string as given
    kind: str  # "pack", "folder", "gguf" or "hub"
    path: Path | None = None  # folder or .gguf file (kinds folder, gguf)
    repo: str | None = None  # ORG/NAME (kind hub)
    revision: str | None = None  # branch, tag or 40-hex commit (kind hub)


def _hub_hint(repo: str) -> str:
    return (
        f"pin a revision: {repo}@main (a branch or tag, resolved to its commit when pulled) or "
        f"{repo}@<40-hex commit>, and pull it with `specdec models pull {repo}@main`"
    )


def parse_source(spec: str) -> ModelSource:
    """Classify a model string; raises ModelSourceError (saying what would work) when it is none."""
    if spec in packs.PACKS:
        return ModelSource(spec, "pack")
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"{spec}: no such file or folder")
        return ModelSource(spec, "gguf", path=path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{spec}: folder has no config.json; is it a Hugging Face model folder?")
        return ModelSource(spec, "folder", path=path)
    match = _HUB_ID.match(spec)
    if spec.startswith((".", "/", "~")):
        raise ModelSourceError(f"{spec}: no such file or folder")
    if match is None:
        raise ModelSourceError(
            f"{spec}: not a model pack ({', '.join(packs.PACKS)}), an existing folder or .gguf file, "
            "nor a hub id ORG/NAME@REVISION"
        )
    if match["revision"] is None:
        raise ModelSourceError(f"hub model {spec!r} has no revision: {_hub_hint(spec)}")
    return ModelSource(spec, "hub", repo=match["repo"], revision=match["revision"])


# --------------------------------------------------------------------------- hub models in the cache


def hub_repo_dir(repo: str) -> Path:
    """``<cache>/hub/ORG/NAME``: ``<commit>/`` snapshots and ``refs/<revision>`` files naming one."""
    org, name = repo.split("/", 1)
    return packs.cache_root() / "hub" / org / name


def ref_file(repo: str, revision: str) -> Path:
    return hub_repo_dir(repo) / "refs" / revision.replace("/", "%2F")


def hub_snapshot_dir(repo: str, commit: str) -> Path:
    return hub_repo_dir(repo) / commit


def read_hub_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / HUB_MARKER).read_text())
    except (OSError, ValueError):
        return None


def pulled_models() -> list[tuple[Path, dict]]:
    """(snapshot folder, marker) of every complete hub snapshot in the model cache."""
    found = []
    for folder in sorted((packs.cache_root() / "hub").glob("*/*/*")):
        marker = read_hub_marker(folder) if COMMIT.match(folder.name) else None
        if marker is not None:
            found.append((folder, marker))
    return found


def pinned_commit(repo: str, revision: str) -> str | None:
    """The commit a revision was pinned to when it was pulled (a commit pins itself), or None."""
    if COMMIT.match(revision):
        return revision
    try:
        commit = ref_file(repo, revision).read_text().strip()
    except OSError:
        return None
    return commit if COMMIT.match(commit) else None


def hub_local_dir(source: ModelSource) -> Path:
    """The complete pulled snapshot of a hub source; ModelNotPulled (saying how) otherwise."""
    assert source.repo is not None and source.revision is not None
    commit = pinned_commit(source.repo, source.revision)
    folder = hub_snapshot_dir(source.repo, commit) if commit else None
    if folder is None or read_hub_marker(folder) is None:
        raise ModelNotPulled(
            f"hub model {source.spec!r} is not in the model cache {packs.cache_root()}; "
            f"run `specdec models pull {source.spec}` first (serving never downloads)"
        )
    return folder


def local_files(spec: str | ModelSource) -> tuple[Path, str | None]:
    """(folder, GGUF file name in it or None) holding the model on this machine, without touching
    the network; raises PackNotReady / ModelNotPulled (saying which command prepares it)."""
    source = parse_source(spec) if isinstance(spec, str) else spec
    if source.kind == "pack":
        return packs.resolve_pack(source.spec), None
    if source.kind == "gguf":
        assert source.path is not None
        return source.path.parent, source.path.name
    if source.kind == "folder":
        assert source.path is not None
        return source.path, None
    return hub_local_dir(source), None
