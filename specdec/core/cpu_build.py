"""Compiled CPU loops (specdec/core/*.c): each built once per machine, loaded with ctypes.

A source is compiled with the machine's own instruction set (-march=native) and torch's OpenMP
runtime (the process's one thread pool) into ``$SPECDEC_CACHE/kernels``, under a name that holds a
hash of the source, compiler, flags and CPU. Without a C compiler (the image's runtime has none),
the library comes prebuilt: ``python -m specdec.core.cpu_build DIR`` builds every source for each
x86-64 level (v2 plain loops, v3 AVX2 and FMA, v4 AVX-512) into DIR, and a process with
``SPECDEC_PREBUILT_KERNELS=DIR`` loads the highest level its CPU runs, if built from the same
source. Each level gives the same bits (the sources fix their order of arithmetic; the tests build
each level and compare). With ``SPECDEC_CPU_KERNELS=0``, or when neither is there, `library`
gives None and the caller keeps torch's path; a process keeps what it got for its whole life, so
its outputs stay self-consistent.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from specdec.core.packs import cache_root

log = logging.getLogger(__name__)

# The order of arithmetic is the source's: no contraction of a*b+c the source does not write.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math")
FLAGS += ("-fopenmp", "-shared", "-fPIC")
ENV_SWITCH = "SPECDEC_CPU_KERNELS"
PREBUILT_ENV = "SPECDEC_PREBUILT_KERNELS"
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
# x86-64 levels, best first, with the /proc/cpuinfo flags each needs beyond the one after it
# (x86-64-v3 also needs OS support for AVX state: "xsave" stands for it).
LEVELS = {
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    "x86-64-v2": {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"},
}


class KernelBuildError(RuntimeError):
    pass


def flags_for(march: str) -> tuple[str, ...]:
    """FLAGS for another instruction set than the machine's own (`-march=<march>`)."""
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


def cpu_levels(flags: set[str] | None = None) -> list[str]:
    """The x86-64 levels this CPU runs (from its /proc/cpuinfo flags), best first; off x86-64, none."""
    if flags is None:
        if platform.machine() not in ("x86_64", "AMD64"):
            return []
        try:
            info = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
        flags = next(
            (set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set()
        )
    names = list(LEVELS)
    return [name for i, name in enumerate(names) if all(LEVELS[n] <= flags for n in names[i:])]


def prebuilt_name(source: Path, level: str) -> str:
    """A prebuilt library's file name: the source's stem, a hash of its text, and the level."""
    return f"{source.stem}-{hashlib.sha256(source.read_bytes()).hexdigest()[:16]}-{level}.so"


def prebuild(out_dir: Path, compiler: str, sources: tuple[Path, ...] = SOURCES) -> list[Path]:
    """Every source built for every x86-64 level into `out_dir` (what the image ships)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    for source in sources:
        for level in LEVELS:
            with tempfile.TemporaryDirectory() as tmp:
                path = build(source, compiler, Path(tmp), flags_for(level))
                built.append(Path(shutil.copy(path, out_dir / prebuilt_name(source, level))))
    return built


def find_prebuilt(source: Path, directory: Path, levels: list[str]) -> tuple[Path, str] | None:
    """The prebuilt library of `source`'s current text for the best of `levels` in `directory`."""
    for level in levels:
        path = directory / prebuilt_name(source, level)
        if path.exists():
            return path, level
    return None


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


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def library(source: Path, declare: Callable[[ctypes.CDLL], None], what: str) -> ctypes.CDLL | None:
    """`source` built (or found) and loaded, its signatures set by `declare`; without a compiler,
    the prebuilt one for this CPU (``SPECDEC_PREBUILT_KERNELS``); None when switched off or when
    neither is there (logged, naming `what` runs as torch ops instead)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        return _load_prebuilt(source, declare, what)
    try:
        path = build(source, compiler, cache_root() / "kernels")
        lib = load(path, declare)
    except (KernelBuildError, OSError) as exc:
        log.warning("the CPU's compiled %s is not available, torch ops instead: %s", what, exc)
        return None
    log.info("the CPU's %s runs compiled: %s", what, path)
    return lib


def _load_prebuilt(source: Path, declare: Callable[[ctypes.CDLL], None], what: str) -> ctypes.CDLL | None:
    directory = os.environ.get(PREBUILT_ENV)
    found = find_prebuilt(source, Path(directory), cpu_levels()) if directory else None
    if found is None:
        where = f"none in {PREBUILT_ENV}={directory} for this source and CPU" if directory else f"{PREBUILT_ENV} unset"
        log.warning("no C compiler and no prebuilt library (%s): the CPU's %s runs as torch ops (slower)", where, what)
        return None
    path, level = found
    try:
        lib = load(path, declare)
    except OSError as exc:
        log.warning("the CPU's prebuilt %s does not load, torch ops instead: %s", what, exc)
        return None
    log.info("the CPU's %s runs compiled (prebuilt for %s): %s", what, level, path)
    return lib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Build every CPU loop for every x86-64 level (an image's runtime has no compiler)."
    )
    p.add_argument("out", type=Path, help="the directory SPECDEC_PREBUILT_KERNELS will name")
    args = p.parse_args(argv)
    compiler = _compiler()
    if compiler is None:
        p.error("no C compiler (gcc or $CC)")
    if platform.machine() not in ("x86_64", "AMD64"):
        print(f"{platform.machine()} is not x86-64: nothing prebuilt (a process there needs a compiler)")
        return 0
    for path in prebuild(args.out, compiler):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
