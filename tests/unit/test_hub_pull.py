"""`specdec models pull` / `prepare` against a local stand-in of the hub (tests/hub_standin.py):
the revision pinned to a commit, every file verified, nothing partial left, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.core.model_source import HUB_MARKER, local_files
from tests.hub_standin import HubStandin, specdec_cli

REPO = "acme/tiny-llama"


@pytest.fixture
def files(tiny_paths) -> dict[str, bytes]:
    return HubStandin.folder_files(tiny_paths["llama"])


def _cache_files(cache: Path) -> list[str]:
    """Everything in the cache but lock files (a lock is only a name to flock)."""
    if not cache.exists():
        return []
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and p.suffix != ".lock")


def test_pull_by_branch_pins_the_commit(tmp_path: Path, files, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    with HubStandin() as hub:
        first = hub.add_commit(REPO, files)
        result = specdec_cli(hub, cache, "models", "pull", f"{REPO}@main")
        assert result.returncode == 0, result.stderr
        snapshot = cache / "hub" / "acme" / "tiny-llama" / first
        assert result.stdout.strip() == f"{REPO}@main: {snapshot}"
        # every file was fetched at the commit, never at the moving branch
        resolves = [path for method, path in hub.requests if "/resolve/" in path]
        assert resolves and all(f"/resolve/{first}/" in path for path in resolves)

        marker = json.loads((snapshot / HUB_MARKER).read_text())
        assert (marker["repo"], marker["revision"], marker["commit"]) == (REPO, "main", first)
        assert set(marker["files"]) == set(files)
        assert "sha256" in marker["files"]["model.safetensors"]  # LFS: checked against lfs.sha256
        assert "git_blob_id" in marker["files"]["config.json"]  # small files: against the blob id
        assert all((snapshot / name).read_bytes() == data for name, data in files.items())
        assert sorted(p.name for p in snapshot.iterdir()) == sorted([*files, HUB_MARKER])  # nothing else
        assert {oct(p.stat().st_mode & 0o777) for p in [snapshot, *snapshot.iterdir()]} == {"0o755", "0o644"}

        # main moves on: serving keeps the pinned commit until the next pull
        second = hub.add_commit(REPO, {**files, "config.json": files["config.json"].replace(b"{", b"{ ", 1)})
        assert local_files(f"{REPO}@main")[0] == snapshot
        result = specdec_cli(hub, cache, "models", "pull", f"{REPO}@main")
        assert result.returncode == 0, result.stderr
        assert local_files(f"{REPO}@main")[0] == snapshot.parent / second
        assert local_files(f"{REPO}@{first}")[0] == snapshot  # a commit pins itself

        listed = json.loads(specdec_cli(hub, cache, "models", "list", "--json").stdout)
        hub_rows = [(r["name"], r["path"]) for r in listed if r["role"] == "hub"]
        assert hub_rows == sorted([(f"{REPO}@{c}", str(snapshot.parent / c)) for c in (first, second)])

        # pulling again is a no-op: one info request, no download
        before = len(hub.requests)
        assert specdec_cli(hub, cache, "models", "pull", f"{REPO}@main").returncode == 0
        assert [p for _, p in hub.requests[before:] if "/resolve/" in p] == []
    assert not list((cache / ".tmp").glob("hub-*/"))  # no work folder left


def test_a_corrupted_file_is_refused_and_nothing_is_left(tmp_path: Path, files) -> None:
    cache = tmp_path / "cache"
    with HubStandin() as hub:
        commit = hub.add_commit(REPO, files)
        hub.repos[REPO].corrupt.add("model.safetensors")  # bytes differ from the reported sha256
        result = specdec_cli(hub, cache, "models", "prepare", f"{REPO}@main")
    assert result.returncode == 1
    err = result.stderr
    assert f"{REPO}@{commit}: model.safetensors does not match the hub's sha256" in err, err
    assert "Traceback" not in err
    assert _cache_files(cache) == []  # no snapshot, no ref, no partial download


def test_an_intact_repository_pulls_where_the_corrupted_one_did_not(tmp_path: Path, files) -> None:
    # the control for the test above: the same files, served intact, pass the same checks
    cache = tmp_path / "cache"
    with HubStandin() as hub:
        commit = hub.add_commit(REPO, files)
        result = specdec_cli(hub, cache, "models", "prepare", f"{REPO}@main")
    assert result.returncode == 0, result.stderr
    assert f"pulled and verified: {cache / 'hub' / 'acme' / 'tiny-llama' / commit}" in result.stdout


def test_a_gated_repository_needs_hf_token(tmp_path: Path, files) -> None:
    cache = tmp_path / "cache"
    with HubStandin() as hub:
        hub.add_commit(REPO, files, token="hf_granted")
        result = specdec_cli(hub, cache, "models", "pull", f"{REPO}@main")
        assert result.returncode == 1
        assert "the repository is gated: HF_TOKEN is not set" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        assert _cache_files(cache) == []

        wrong = specdec_cli(hub, cache, "models", "pull", f"{REPO}@main", token="hf_other")
        assert "the repository is gated: HF_TOKEN is set but" in wrong.stderr
        granted = specdec_cli(hub, cache, "models", "pull", f"{REPO}@main", token="hf_granted")
        assert granted.returncode == 0, granted.stderr


def test_unknown_repository_and_revision_say_so(tmp_path: Path, files) -> None:
    cache = tmp_path / "cache"
    with HubStandin() as hub:
        hub.add_commit(REPO, files)
        missing = specdec_cli(hub, cache, "models", "pull", "acme/nothing@main")
        assert missing.returncode == 1 and "no such repository, or a private one" in missing.stderr
        revision = specdec_cli(hub, cache, "models", "pull", f"{REPO}@v9")
        assert revision.returncode == 1 and "revision 'v9' does not exist" in revision.stderr


def test_a_repository_without_safetensors_is_refused(tmp_path: Path, files) -> None:
    cache = tmp_path / "cache"
    with HubStandin() as hub:
        hub.add_commit(REPO, {k: v for k, v in files.items() if not k.endswith(".safetensors")})
        result = specdec_cli(hub, cache, "models", "pull", f"{REPO}@main")
    assert result.returncode == 1 and "no config.json and safetensors weights" in result.stderr
    assert _cache_files(cache) == []


def test_pull_and_prepare_refuse_a_hub_id_without_revision_before_any_request(tmp_path: Path) -> None:
    with HubStandin() as hub:
        for command in ("pull", "prepare"):
            result = specdec_cli(hub, tmp_path, "models", command, REPO)
            assert result.returncode == 2
            assert f"{REPO}@main" in result.stderr and "no revision" in result.stderr
        assert hub.requests == []


def test_prepare_uses_a_folder_and_a_gguf_in_place(tmp_path: Path, tiny_paths) -> None:
    from tests.tiny_gguf import write_tiny_llama_gguf

    gguf = write_tiny_llama_gguf(tiny_paths["llama"], tmp_path / "tiny.gguf")
    with HubStandin() as hub:
        result = specdec_cli(hub, tmp_path / "cache", "models", "prepare", str(tiny_paths["llama"]), str(gguf))
        assert hub.requests == []
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{tiny_paths['llama']}: used in place: {tiny_paths['llama']}",
        f"{gguf}: used in place: {gguf}",
    ]
    assert not (tmp_path / "cache").exists()  # nothing copied


def test_offline_mode_refuses_to_pull_with_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # this process runs with HF_HUB_OFFLINE=1 (tests/conftest.py), as a server does
    from huggingface_hub import constants

    from specdec.core.hub_pull import HubPullError, pull

    assert constants.is_offline_mode()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    with pytest.raises(HubPullError, match="HF_HUB_OFFLINE is set: unset it where the pull runs"):
        pull(f"{REPO}@main", progress=False)
