"""An optimized BLAS for MLX's CPU backend on Linux, loaded before MLX is imported.

The `mlx[cpu]` wheel bundles the reference (Netlib) BLAS: an fp32 512x512x1536 matmul runs at
~5 GFLOP/s on it, ~260 with OpenBLAS (DESIGN.md §5). A library exporting the same CBLAS
symbols, loaded with RTLD_GLOBAL before `mlx.core`, takes over MLX's calls. `serve` and
`generate` do that by default (`--blas auto`): the first library found among KNOWN_PATHS,
or nothing plus one hint line (HINT) where the system has none. `--blas none` keeps MLX's
own; `--blas PATH` loads that file. macOS uses Accelerate and is left alone.

Imports no MLX (that is the point); ctypes only.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

# Debian/Ubuntu (libopenblas0-pthread, libopenblas0-openmp), Fedora/RHEL, Arch.
KNOWN_PATHS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/*-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
HINT = ("tqserve: MLX is using its bundled reference BLAS, which is slow on the CPU; install "
        "an optimized one (Debian/Ubuntu: apt-get install libopenblas0-pthread) and tqserve "
        "loads it at start (see --blas)")


def find() -> str | None:
    """The first optimized BLAS found on this system, or None (always None off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    for pattern in KNOWN_PATHS:
        for path in sorted(glob.glob(pattern)):
            if os.path.isfile(path):
                return path
    return None


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
    """Load `path` with RTLD_GLOBAL. RuntimeError once MLX is imported (too late to count);
    ValueError (naming --blas) if the file is not a loadable library."""
    if "mlx.core" in sys.modules:
        raise RuntimeError("a BLAS must be loaded before mlx is imported")
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise ValueError(f"--blas: cannot load {path}: {exc}") from None


def choice_in(argv: list[str]) -> str:
    """The --blas value in a command line (parsed before argparse, which imports MLX)."""
    for i, arg in enumerate(argv):
        if arg == "--blas" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--blas="):
            return arg.split("=", 1)[1]
    return "auto"
