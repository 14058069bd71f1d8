"""A local stand-in of the Hugging Face hub's file API (this machine cannot reach the hub).

Real HTTP on loopback, answering the requests ``huggingface_hub`` makes for ``model_info`` and
``hf_hub_download`` (read in huggingface_hub's hf_api.py and file_download.py):

- ``GET /api/models/ORG/NAME/revision/REV?blobs=true``: the commit (``sha``) a revision names and
  the files (``siblings``) with size, git blob id and, for LFS files, ``lfs.sha256``;
- ``HEAD|GET /ORG/NAME/resolve/REV/FILE``: a small file answers 200 with ``ETag`` (its blob id),
  ``X-Repo-Commit`` and ``Content-Length``; an LFS file answers 302 to a second origin (the hub's
  CDN) with ``X-Linked-Etag`` (its sha256), ``X-Linked-Size`` and ``Location``, as the hub does;
- errors with the hub's ``X-Error-Code`` header: ``GatedRepo`` (401 without the repository's
  token), ``RepoNotFound``, ``RevisionNotFound``.

A repository can serve bytes that differ from the hashes it reports (``corrupt``), to show a pull
refuses them. Every request is logged (``requests``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_PATTERNS = (".safetensors", ".gguf", ".bin")
REPO_ROOT = Path(__file__).resolve().parents[1]


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class StandinRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> {file: bytes}
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    token: str | None = None  # gated: downloads need "Authorization: Bearer <token>"
    corrupt: set[str] = field(default_factory=set)  # files served with one byte flipped

    def commit_of(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


class HubStandin:
    """``with HubStandin() as hub: hub.add_repo(...); os.environ["HF_ENDPOINT"] = hub.url``."""

    def __init__(self) -> None:
        self.repos: dict[str, StandinRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self._servers: list[ThreadingHTTPServer] = []

    # ------------------------------------------------------------------ content

    def add_commit(self, repo: str, files: dict[str, bytes], ref: str = "main", token: str | None = None) -> str:
        """Add a commit of ``files`` to ``repo`` and point ``ref`` at it; returns the commit id."""
        r = self.repos.setdefault(repo, StandinRepo())
        r.token = token if token is not None else r.token
        listing = json.dumps(sorted((n, hashlib.sha256(d).hexdigest()) for n, d in files.items()))
        commit = hashlib.sha1(f"{repo}\n{listing}\n{len(r.commits)}".encode()).hexdigest()
        r.commits[commit] = dict(files)
        r.refs[ref] = commit
        return commit

    @staticmethod
    def folder_files(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}

    def _sibling(self, name: str, data: bytes) -> dict:
        entry = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
        if name.endswith(LFS_PATTERNS):
            entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
        return entry

    # ------------------------------------------------------------------ server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    def __enter__(self) -> HubStandin:
        for handler in (_api_handler(self), _cdn_handler(self)):
            server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self._servers.append(server)
        return self

    def __exit__(self, *exc) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def blob(self, sha256: str) -> bytes | None:
        for r in self.repos.values():
            for files in r.commits.values():
                for name, data in files.items():
                    if hashlib.sha256(data).hexdigest() == sha256:
                        return _flip(data) if name in r.corrupt else data
        return None


def _flip(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF]) if data else b"\0"


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandin

    def log_message(self, *args) -> None:  # quiet: the test output is not an access log
        pass

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}, body)

    def do_HEAD(self) -> None:
        self.hub.requests.append(("HEAD", self.path))
        self.handle_request()

    def do_GET(self) -> None:
        self.hub.requests.append(("GET", self.path))
        self.handle_request()

    def handle_request(self) -> None:
        raise NotImplementedError


def _api_handler(hub: HubStandin) -> type[_Handler]:
    class Api(_Handler):
        def handle_request(self) -> None:
            parts = [unquote(p) for p in urlparse(self.path).path.split("/")[1:]]
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "revision":
                self._model_info(f"{parts[2]}/{parts[3]}", "/".join(parts[5:]))
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
            else:
                self._error(404, "EntryNotFound", f"no route {self.path}")

        def _repo(self, repo_id: str) -> StandinRepo | None:
            r = hub.repos.get(repo_id)
            if r is None:
                self._error(401, "RepoNotFound", "Repository not found")
            return r

        def _model_info(self, repo_id: str, revision: str) -> None:
            r = self._repo(repo_id)
            if r is None:
                return
            commit = r.commit_of(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return
            files = r.commits[commit]
            body = {
                "id": repo_id,
                "sha": commit,
                "gated": "manual" if r.token else False,
                "private": False,
                "siblings": [hub._sibling(n, d) for n, d in sorted(files.items())],
            }
            self._send(200, {"Content-Type": "application/json"}, json.dumps(body).encode())

        def _resolve(self, repo_id: str, revision: str, filename: str) -> None:
            r = self._repo(repo_id)
            if r is None:
                return
            if r.token and self.headers.get("Authorization") != f"Bearer {r.token}":
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must be authenticated.")
                return
            commit = r.commit_of(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return
            data = r.commits[commit].get(filename)
            if data is None:
                self._error(404, "EntryNotFound", f"{filename} does not exist at {commit}")
                return
            entry = hub._sibling(filename, data)
            served = _flip(data) if filename in r.corrupt else data
            if "lfs" in entry:
                sha = entry["lfs"]["sha256"]
                headers = {
                    "X-Repo-Commit": commit,
                    "X-Linked-Etag": f'"{sha}"',
                    "X-Linked-Size": str(len(data)),
                    "ETag": f'"{entry["blobId"]}"',
                    "Location": f"{hub.cdn_url}/cdn/{sha}",
                }
                self._send(302, headers)
            else:
                headers = {"X-Repo-Commit": commit, "ETag": f'"{entry["blobId"]}"'}
                self._send(200, {**headers, "Content-Length": str(len(served))}, served)

    Api.hub = hub
    return Api


def _cdn_handler(hub: HubStandin) -> type[_Handler]:
    class Cdn(_Handler):
        def handle_request(self) -> None:
            sha = urlparse(self.path).path.rsplit("/", 1)[-1]
            data = hub.blob(sha)
            if data is None:
                self._send(404, {})
            else:
                self._send(200, {"Content-Length": str(len(data)), "ETag": f'"{sha}"'}, data)

    Cdn.hub = hub
    return Cdn


def specdec_cli(hub: HubStandin, cache: Path, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
    """``specdec ARGS`` as the chart's init container runs it, pointed at the stand-in: ``HF_ENDPOINT``
    set, ``HF_TOKEN`` only when given, and not offline (the tests' conftest sets HF_HUB_OFFLINE=1,
    which huggingface_hub reads once, at import: a pull runs in its own process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_ENDPOINT=hub.url, SPECDEC_CACHE=str(cache), HF_HOME=str(cache / "hf-home"))
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if token is not None:
        env["HF_TOKEN"] = token
    cmd = [sys.executable, "-m", "specdec.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
