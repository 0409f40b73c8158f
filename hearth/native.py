"""Build hearth's C++ kernels on first use.

`build(name, sources, what, ...)` JIT-compiles one extension's C++ sources with PyTorch's extension
tooling (ninja runs gcc with -march=native and OpenMP on each source, several at once, then links
them) and returns the module, or None where it cannot be built (no compiler, HEARTH_KERNELS=0, not
x86-64/arm64): callers then take their pure-torch path, and a warning says why (the compiler's own
first error line, or "HEARTH_KERNELS=0 is set") and what that costs. The sources include no torch
header, so a build takes seconds of CPU per source; the Python side checks and allocates tensors and
passes data pointers.

A build says so on stderr before it starts ("compiling hearth's CPU kernels for ... (once, about
N s)"), then one line per source as its object appears, then the time it took: the first command
otherwise sat silent for a minute or more.

Each build has its own folder under ~/.cache/hearth/kernels (or $HEARTH_KERNELS_DIR), named by a
hash of every file it reads (the sources and the headers they include, found by their `#include
"..."` lines), this CPU's instruction sets and torch's version: a machine never loads a build made
for another CPU or other sources, and copies of the project with different sources (two checkouts)
do not rebuild over each other. A build already there is imported directly (a few milliseconds);
only a missing one pays for the extension tooling (setuptools, ninja) and gcc. A process builds or
imports each extension once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import platform
import re
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

log = logging.getLogger(__name__)

# C++20 whatever torch asks for (torch 2.11 and older build extensions as C++17: the kernels use `requires`)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++20"]
_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_built: dict[str, ModuleType | None] = {}  # by name and key: what this process built or imported, None if it failed
_said: set[str] = set()  # the extensions whose absence was logged


def build(name: str, sources: list[Path], what: str, seconds: int, without: str,
          flags: tuple[str, ...] = ()) -> ModuleType | None:
    """The compiled module `name` from `sources`, or None (logged once, saying `without`: what runs
    instead). `seconds`: about how long the build takes (measured on a 2-core machine), for the notice.
    `flags`: compiler flags beyond the common ones (e.g. -ffp-contract=off where results must be exact)."""
    reason = _unavailable()
    if reason is not None:
        _warn_once(name, f"hearth: {what} kernels are off ({reason}); {without}")
        return None
    full_name = f"{name}_{_key(sources, flags)}"
    if full_name not in _built:
        _built[full_name] = _import_built(full_name, _kernels_dir() / full_name) or _compile(
            full_name, sources, what, seconds, without, [*_FLAGS, *flags])
    return _built[full_name]


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive flock on `path` (where there is no fcntl, as on Windows: no lock). The kernel
    releases it when its holder dies, however it dies; torch's own lock (a file named `lock` that its
    loader creates and deletes) stays behind when a build is killed (a tensor-parallel worker ended
    mid-build, a test run stopped), and every later build of those sources would wait on it forever."""
    with open(path, "a") as file:
        if fcntl is not None:
            fcntl.flock(file, fcntl.LOCK_EX)
        yield


def _unavailable() -> str | None:
    if os.environ.get("HEARTH_KERNELS", "1") == "0":
        return "HEARTH_KERNELS=0 is set"
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"no kernels for {platform.machine()}"
    return None


def _warn_once(name: str, message: str) -> None:
    if name not in _said:
        _said.add(name)
        log.warning(message)


def _compile(full_name: str, sources: list[Path], what: str, seconds: int, without: str,
             flags: list[str]) -> ModuleType | None:
    from torch.utils import cpp_extension

    folder = _kernels_dir() / full_name
    # its warnings are about compilers and torch's C++ ABI, which matter for sources that include
    # torch's headers; these include none (a missing compiler's own error is logged below)
    torch_log = logging.getLogger(cpp_extension.__name__)
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _locked(folder / "build.lock"):
            (folder / "lock").unlink(missing_ok=True)  # under the flock: a killed build's (see _locked)
            built = _import_built(full_name, folder)  # another process built it while this one waited
            if built is not None:
                return built
            with _Progress(what, sources, folder, seconds):
                return cpp_extension.load(
                    name=full_name,
                    sources=[str(source) for source in sources],
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(folder),
                    verbose=False,
                )
    except Exception as e:  # no compiler, no headers, an unknown -march: the torch path still works
        log.warning("hearth: %s kernels could not be built (%s); %s", what, _first_error(e), without)
        return None
    finally:
        torch_log.setLevel(level)


def _first_error(e: Exception) -> str:
    """The compiler's (or the shell's) first error line in a failed build's output, else its last line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("FAILED:", "ninja:", "Error building extension")):
            continue
        if re.search(r"error:|not found|No such file|cannot execute|Permission denied", line):
            return line
    return lines[-1] if lines else type(e).__name__


class _Progress:
    """Says on stderr that `sources` are being compiled into `folder`, one line per object as ninja
    writes it, and the time the build took."""

    def __init__(self, what: str, sources: list[Path], folder: Path, seconds: int):
        self.what, self.sources, self.folder, self.seconds = what, sources, folder, seconds
        self.done = threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> _Progress:
        self.start = time.time()
        _say(f"hearth: compiling hearth's CPU kernels for {self.what} (once, about {self.seconds} s): "
             f"{len(self.sources)} sources")
        self.watcher.start()
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.done.set()
        self.watcher.join()
        if kind is None:
            _say(f"hearth: {self.what} kernels compiled in {time.time() - self.start:.0f} s, cached in {self.folder}")

    def _watch(self) -> None:
        pending = [source.stem for source in self.sources]
        while pending:
            stop = self.done.wait(0.25)
            for stem in list(pending):
                built = self.folder / f"{stem}.o"
                if built.exists() and built.stat().st_mtime >= self.start - 1:
                    pending.remove(stem)
                    count = len(self.sources) - len(pending)
                    _say(f"hearth:   {stem}.cpp ({count}/{len(self.sources)}, {time.time() - self.start:.0f} s)")
            if stop:
                return


def _say(message: str) -> None:
    """A line on stderr above any progress bar on screen (the loading bar sits there meanwhile)."""
    from tqdm import tqdm

    with tqdm.external_write_mode(file=sys.stderr):
        print(message, file=sys.stderr, flush=True)


def _key(sources: list[Path], flags: tuple[str, ...] = ()) -> str:
    digest = hashlib.sha256(f"{_cpu_flags()}\n{torch.__version__}\n{' '.join([*_FLAGS, *flags])}\n".encode())
    for path in sorted(_read_files(sources)):
        digest.update(f"{path.name}\n".encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def _read_files(sources: list[Path]) -> set[Path]:
    """The sources and every header they include with quotes, transitively."""
    seen: set[Path] = set()
    pending = [source.resolve() for source in sources]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        pending += [(path.parent / include.decode()).resolve() for include in _INCLUDE.findall(path.read_bytes())]
    return seen


def cpu_has(flag: str) -> bool:
    """Whether this CPU reports `flag` (/proc/cpuinfo's name, e.g. avx512_vnni)."""
    return flag in _cpu_flags().split()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _kernels_dir() -> Path:
    if os.environ.get("HEARTH_KERNELS_DIR"):
        return Path(os.environ["HEARTH_KERNELS_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hearth" / "kernels"


def _import_built(full_name: str, folder: Path) -> ModuleType | None:
    """The module cpp_extension.load built in `folder` before, or None (not built, or unreadable:
    a build another process is still writing; then _compile waits for the build's flock)."""
    library = folder / f"{full_name}.so"
    if not library.exists() or (folder / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(full_name, library)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module
