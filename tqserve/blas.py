"""An optimized BLAS for MLX's CPU backend on Linux, loaded before MLX is imported.

The `mlx[cpu]` wheel bundles the reference (Netlib) BLAS: an fp32 512x512x1536 matmul runs
at ~5 GFLOP/s on it, ~260 with OpenBLAS (DESIGN.md §5). MLX calls three CBLAS functions
(cblas_sgemm, cblas_dgemm, cblas_cgemm); a library exporting them, loaded with RTLD_GLOBAL
before `mlx.core`, takes over those calls. `find()` picks, in order:

1. the system's OpenBLAS (KNOWN_PATHS: Debian/Ubuntu, Fedora/RHEL, Arch packages);
2. the `scipy-openblas32` wheel, a dependency of tqserve on Linux: its symbols carry a
   `scipy_` prefix, so tqserve builds a 20-line shim once (SHIM_SOURCE, with the C compiler
   that mx.compile needs on the CPU anyway) into ~/.cache/tqserve that forwards the three
   calls to it;
3. nothing: MLX keeps its own, and one HINT line says how to get a fast one.

The choice is TQSERVE_BLAS (`auto`, the default; `none`; or a library's path), read once
by `preload()` when `tqserve.engine` is first imported, so the embedded API gets the same
BLAS as `serve` and `generate` (whose `--blas` flag sets it). In a process that imported
MLX first, nothing can be loaded any more: `open_engine` then says so once. macOS uses
Accelerate and is left alone. Imports no MLX (that is the point): ctypes only.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ENV = "TQSERVE_BLAS"
# Debian/Ubuntu (libopenblas0-pthread, libopenblas0-openmp), Fedora/RHEL, Arch.
KNOWN_PATHS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/*-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
HINT = ("tqserve: MLX is using its bundled reference BLAS, which is slow on the CPU; tqserve "
        "loads the system's OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread) or "
        "builds a shim over the scipy-openblas32 wheel with a C compiler (cc), and found "
        "neither (see --blas)")
TOO_LATE = ("tqserve: MLX was imported before tqserve, so its slow reference BLAS stays; "
            "import tqserve first (or set TQSERVE_BLAS before MLX loads) for OpenBLAS")
SHIM_SOURCE = r"""
#include <dlfcn.h>
typedef void (*sgemm_t)(int, int, int, int, int, int, float, const float *, int,
                        const float *, int, float, float *, int);
typedef void (*dgemm_t)(int, int, int, int, int, int, double, const double *, int,
                        const double *, int, double, double *, int);
typedef void (*cgemm_t)(int, int, int, int, int, int, const void *, const void *, int,
                        const void *, int, const void *, void *, int);
static sgemm_t s; static dgemm_t d; static cgemm_t c;
int tqserve_blas_bind(const char *path) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) return 1;
  s = (sgemm_t)dlsym(h, "scipy_cblas_sgemm");
  d = (dgemm_t)dlsym(h, "scipy_cblas_dgemm");
  c = (cgemm_t)dlsym(h, "scipy_cblas_cgemm");
  return !(s && d && c);
}
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float al, const float *a,
                 int lda, const float *b, int ldb, float be, float *cc, int ldc)
{ s(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, cc, ldc); }
void cblas_dgemm(int o, int ta, int tb, int m, int n, int k, double al, const double *a,
                 int lda, const double *b, int ldb, double be, double *cc, int ldc)
{ d(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, cc, ldc); }
void cblas_cgemm(int o, int ta, int tb, int m, int n, int k, const void *al, const void *a,
                 int lda, const void *b, int ldb, const void *be, void *cc, int ldc)
{ c(o, ta, tb, m, n, k, al, a, lda, b, ldb, be, cc, ldc); }
"""
SHIM_BUILD_SECONDS = 60
loaded: str | None = None   # what preload() or load() put in place (None: MLX's own)
chosen: str | None = None   # TQSERVE_BLAS as preload() found it
late = False                # preload() came after MLX was imported: nothing could load
said = False                # say_once() printed its line


def _system() -> str | None:
    for pattern in KNOWN_PATHS:
        for path in sorted(glob.glob(pattern)):
            if os.path.isfile(path):
                return path
    return None


def wheel_library() -> str | None:
    """libscipy_openblas.so of the scipy-openblas32 wheel, if installed (not imported)."""
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "lib" / "libscipy_openblas.so"
    return str(path) if path.is_file() else None


def shim() -> str | None:
    """The shim over the wheel's library, built once into the cache dir; None without the
    wheel or a C compiler (or if the build fails)."""
    library = wheel_library()
    compiler = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if library is None or compiler is None:
        return None
    digest = hashlib.sha256((SHIM_SOURCE + library).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tqserve"
    target = cache / f"blas-shim-{digest}.so"
    if target.is_file():
        return str(target)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as work:
            source = Path(work) / "shim.c"
            source.write_text(SHIM_SOURCE)
            built = Path(work) / "shim.so"
            subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(source),
                            "-ldl"], check=True, capture_output=True, timeout=SHIM_BUILD_SECONDS)
            os.replace(built, target)  # atomic: a concurrent build finds one whole file
    except (OSError, subprocess.SubprocessError):
        return None
    return str(target)


def find() -> str | None:
    """The optimized BLAS to load on this system (module doc), or None (off Linux too)."""
    if not sys.platform.startswith("linux"):
        return None
    return _system() or shim()


def resolve(choice: str) -> str | None:
    """`auto` -> find(); `none` -> None; anything else is a path that must exist.

    ValueError (naming --blas) for a path that is not a file."""
    if choice == "none":
        return None
    if choice == "auto":
        return find()
    if not os.path.isfile(choice):
        raise ValueError(f"--blas: no such file: {choice}")
    return choice


def load(path: str) -> None:
    """Load `path` with RTLD_GLOBAL (a shim is bound to the wheel's library). RuntimeError
    once MLX is imported (too late to count); ValueError (naming --blas) if the file is not
    a loadable library."""
    global loaded
    if "mlx.core" in sys.modules:
        raise RuntimeError("a BLAS must be loaded before mlx is imported")
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise ValueError(f"--blas: cannot load {path}: {exc}") from None
    bind = getattr(lib, "tqserve_blas_bind", None)
    if bind is not None:
        target = wheel_library()
        if target is None or bind(target.encode()) != 0:
            raise ValueError(f"--blas: the shim {path} cannot bind to scipy-openblas32")
    loaded = path


def preload() -> str | None:
    """Load the BLAS that TQSERVE_BLAS names, once per process and only while MLX is not
    imported yet; never raises (a bad choice leaves MLX's own, and says why on stderr)."""
    global chosen, late
    if chosen is not None or not sys.platform.startswith("linux"):
        return loaded
    chosen = os.environ.get(ENV, "auto")
    if "mlx.core" in sys.modules:
        late = chosen != "none"
        return None
    try:
        path = resolve(chosen)
        if path is not None:
            load(path)
    except (ValueError, RuntimeError) as exc:
        print(f"tqserve: {exc}", file=sys.stderr)
    return loaded


def report() -> str | None:
    """One line on the BLAS of this Linux CPU process: the library loaded, TOO_LATE (MLX
    was imported first), HINT (none found), or None (`none` chosen, or not Linux)."""
    if loaded is not None:
        return f"tqserve: BLAS {loaded}"
    if not sys.platform.startswith("linux") or chosen == "none":
        return None
    return TOO_LATE if late else HINT


def say_once(line: str | None) -> None:
    """Print a BLAS line to stderr, once per process (the CLI's report and the engine's
    warning about a slow BLAS are the same news)."""
    global said
    if line is not None and not said:
        said = True
        print(line, file=sys.stderr, flush=True)


def warn_if_slow() -> None:
    """Say once that MLX's reference BLAS stays (HINT or TOO_LATE); silent when fast or
    chosen `none` (engine.model calls it for models loaded on the CPU backend)."""
    line = report()
    if line in (HINT, TOO_LATE):
        say_once(line)


def choice_in(argv: list[str]) -> str:
    """The --blas value in a command line (parsed before argparse, which imports MLX)."""
    for i, arg in enumerate(argv):
        if arg == "--blas" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--blas="):
            return arg.split("=", 1)[1]
    return "auto"
