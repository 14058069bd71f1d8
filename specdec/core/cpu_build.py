"""Compiled CPU loops (specdec/core/*.c): each built once per machine, loaded with ctypes.

A source is compiled with the machine's own instruction set (-march=native) and torch's OpenMP
runtime (the process's one thread pool) into ``$SPECDEC_CACHE/kernels``, under a name that holds a
hash of the source, compiler, flags and CPU. Without a C compiler, with ``SPECDEC_CPU_KERNELS=0``,
or when a build fails, `library` gives None and the caller keeps torch's path; a process keeps
what it got for its whole life, so its outputs stay self-consistent.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from specdec.core.packs import cache_root

log = logging.getLogger(__name__)

# The order of arithmetic is the source's: no contraction of a*b+c the source does not write.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math")
FLAGS += ("-fopenmp", "-shared", "-fPIC")
ENV_SWITCH = "SPECDEC_CPU_KERNELS"


class KernelBuildError(RuntimeError):
    pass


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build(source: Path, compiler: str, out_dir: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """Compile `source` with `compiler` into `out_dir` (once: the name holds a hash of the source,
    compiler, flags and CPU); return the library's path."""
    text = source.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(b"\0".join([text, version.encode(), " ".join(flags).encode(), _cpu_id().encode()]))
    path = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and moved there in one step: processes starting together each
    # build their own copy, and none loads a half-written one.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelBuildError(f"{compiler} could not build {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def load(path: Path, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL:
    """A built library with its functions' signatures set by `declare`."""
    lib = ctypes.CDLL(str(path))
    declare(lib)
    return lib


def library(source: Path, declare: Callable[[ctypes.CDLL], None], what: str) -> ctypes.CDLL | None:
    """`source` built (or found) and loaded, its signatures set by `declare`; None when switched off,
    without a compiler, or when the build fails (logged, naming `what` runs as torch ops instead)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler: the CPU's %s runs as torch ops (slower)", what)
        return None
    try:
        path = build(source, compiler, cache_root() / "kernels")
        lib = load(path, declare)
    except (KernelBuildError, OSError) as exc:
        log.warning("the CPU's compiled %s is not available, torch ops instead: %s", what, exc)
        return None
    log.info("the CPU's %s runs compiled: %s", what, path)
    return lib
