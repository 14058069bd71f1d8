"""Pulling a hub model ``ORG/NAME@REVISION`` into the model cache, pinned and verified.

``pull`` asks the hub (``huggingface_hub``; ``HF_ENDPOINT`` and ``HF_TOKEN`` are read at call time)
which commit the revision names and what each file's hashes are, downloads the files a model
needs into a work folder under ``<cache>/.tmp``, checks every file (size, and sha256 against the
hub's LFS metadata, or the git blob id for small non-LFS files), writes the marker last and
renames the folder into ``<cache>/hub/ORG/NAME/<commit>`` (docs/models.md). A failed or
interrupted pull leaves nothing a server could pick up. A branch or tag is recorded in
``refs/<revision>`` so ``serve`` finds its commit offline.
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specdec.core import packs
from specdec.core.model_source import (
    HUB_MARKER,
    ModelSource,
    ModelSourceError,
    hub_snapshot_dir,
    parse_source,
    read_hub_marker,
    ref_file,
)

log = logging.getLogger(__name__)

# What a causal LM needs, top-level files only: no PyTorch pickles (*.bin: code runs on load),
# no ONNX or GGUF variants, no `original/` checkpoints.
WANTED = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")
_CHUNK = 8 << 20


class HubPullError(ModelSourceError):
    """A hub model cannot be pulled or does not verify."""


def _wanted(path: str) -> bool:
    return "/" not in path and any(fnmatch.fnmatch(path, pattern) for pattern in WANTED)


def _git_blob_id(path: Path) -> str:
    """The git object id of a file (what the hub reports for files not stored in LFS)."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _verify(repo: str, commit: str, sibling, path: Path) -> dict:
    """Check one downloaded file against the hub's metadata; returns its record for the marker."""
    name, size = sibling.rfilename, path.stat().st_size
    if sibling.lfs is not None:
        expected, actual, what = sibling.lfs.sha256, _sha256(path), "sha256"
        expected_size = sibling.lfs.size
    else:
        expected, actual, what = sibling.blob_id, _git_blob_id(path), "git blob id"
        expected_size = sibling.size
    if expected is None:
        raise HubPullError(f"{repo}@{commit}: the hub reports no hash for {name}; refusing an unverifiable file")
    if (expected_size is not None and size != expected_size) or actual != expected:
        raise HubPullError(
            f"{repo}@{commit}: {name} does not match the hub's {what}: expected {expected} "
            f"({expected_size} bytes), got {actual} ({size} bytes); nothing was written to the model cache"
        )
    return {"size": size, ("sha256" if sibling.lfs is not None else "git_blob_id"): actual}


def _hub_error(source: ModelSource, exc: Exception) -> HubPullError:
    """A hub failure in words a person can act on (which variable to set, what to check)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    token = "HF_TOKEN is set but" if os.environ.get("HF_TOKEN") else "HF_TOKEN is not set:"
    if isinstance(exc, GatedRepoError):
        why = f"the repository is gated: {token} set it to a token of an account granted access"
    elif isinstance(exc, RevisionNotFoundError):
        why = f"revision {source.revision!r} does not exist (a branch, tag or commit of the repository)"
    elif isinstance(exc, RepositoryNotFoundError):
        why = f"no such repository, or a private one: {token} a token with read access is needed"
    elif isinstance(exc, OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE is set: unset it where the pull runs (serving needs no hub)"
    else:
        why = f"{type(exc).__name__}: {exc}"
    return HubPullError(f"cannot pull {source.spec} from {endpoint}: {why}")


@contextmanager
def _repo_lock(repo: str) -> Iterator[Path]:
    """A per-repository lock and the work root; two pulls of one repository never interleave."""
    work_root = packs.cache_root() / ".tmp"
    work_root.mkdir(parents=True, exist_ok=True)
    with open(work_root / f"hub-{repo.replace('/', '--')}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even on a crash
        yield work_root


def _record_ref(source: ModelSource, commit: str) -> None:
    if source.revision == commit:
        return
    ref = ref_file(source.repo, source.revision)
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(ref.name + ".tmp")
    tmp.write_text(commit + "\n")
    tmp.replace(ref)  # atomic: a reader sees the old commit or the new one


def pull(spec: str, progress: bool = True) -> Path:
    """Pull ``ORG/NAME@REVISION`` into the model cache (idempotent); returns the snapshot folder."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    source = parse_source(spec)
    if source.kind != "hub":
        raise HubPullError(f"{spec}: only a hub id ORG/NAME@REVISION is pulled (this is a {source.kind})")
    endpoint = os.environ.get("HF_ENDPOINT") or None
    api = HfApi(endpoint=endpoint)
    try:
        info = api.model_info(source.repo, revision=source.revision, files_metadata=True)
    except (HfHubHTTPError, OfflineModeIsEnabled, OSError) as exc:
        raise _hub_error(source, exc) from exc
    commit = info.sha
    if not commit:
        raise HubPullError(f"{spec}: the hub named no commit for revision {source.revision!r}")
    final = hub_snapshot_dir(source.repo, commit)
    if read_hub_marker(final) is not None:
        _record_ref(source, commit)
        log.info("%s: already pulled (commit %s): %s", spec, commit, final)
        return final
    siblings = [s for s in info.siblings or [] if _wanted(s.rfilename)]
    names = {s.rfilename for s in siblings}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise HubPullError(
            f"{spec}: the repository at {commit} has no config.json and safetensors weights "
            "(a Hugging Face model folder is needed; a GGUF repository: download the .gguf and give its path)"
        )
    total = sum((s.lfs.size if s.lfs else s.size) or 0 for s in siblings)
    log.info("%s: pulling %d files (%.1f MB) at commit %s", spec, len(siblings), total / 1e6, commit)
    t0 = time.monotonic()
    bars_were_off = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        with _repo_lock(source.repo) as work_root:
            if read_hub_marker(final) is not None:  # another process finished while we waited
                _record_ref(source, commit)
                return final
            prefix = f"hub-{source.repo.replace('/', '--')}."
            for stale in work_root.glob(f"{prefix}*"):  # an interrupted pull's files (we hold the lock)
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
            work = Path(tempfile.mkdtemp(prefix=prefix, dir=work_root))
            try:
                files = {}
                for sibling in siblings:
                    try:
                        got = hf_hub_download(
                            source.repo, sibling.rfilename, revision=commit, local_dir=work, endpoint=endpoint
                        )
                    except (HfHubHTTPError, OfflineModeIsEnabled, OSError) as exc:
                        raise _hub_error(source, exc) from exc
                    files[sibling.rfilename] = _verify(source.repo, commit, sibling, Path(got))
                shutil.rmtree(work / ".cache", ignore_errors=True)  # huggingface_hub's download notes
                marker = {
                    "repo": source.repo,
                    "revision": source.revision,
                    "commit": commit,
                    "endpoint": endpoint or "https://huggingface.co",
                    "files": files,
                    "seconds": round(time.monotonic() - t0, 2),
                }
                (work / HUB_MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # last: "complete"
                # mkdtemp makes 0700: the cache is shared read-only with the serving user (docs/models.md)
                work.chmod(0o755)
                for f in work.iterdir():
                    f.chmod(0o644)
                final.parent.mkdir(parents=True, exist_ok=True)
                if final.exists():  # no marker: incomplete, never used (model_source.hub_local_dir)
                    shutil.rmtree(final)
                work.rename(final)  # same filesystem: atomic
            finally:
                shutil.rmtree(work, ignore_errors=True)
            _record_ref(source, commit)
    finally:
        if not progress and not bars_were_off:
            enable_progress_bars()
    log.info("%s: pulled and verified in %.1f s: %s", spec, time.monotonic() - t0, final)
    return final
