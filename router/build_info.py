"""Which build a router runs, for ``specdec_build_info``: versions read from the installed
distributions' metadata, so the router never imports torch to learn its version (the workers do;
one image installs both)."""

from __future__ import annotations

import platform
from importlib import metadata

__all__ = ["build_versions"]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def build_versions() -> tuple[str, str, str, str]:
    """specdec, Python, grpcio and torch versions, from the installed distributions' metadata:
    the router never imports torch (the workers do; one image installs both)."""
    return _version("specdec"), platform.python_version(), _version("grpcio"), _version("torch")
