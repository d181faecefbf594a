"""Keep the descriptor limit the user set when mlx-lm is imported.

mlx_lm.utils (0.32) runs `resource.setrlimit(RLIMIT_NOFILE, (2048, 4096))` when it is
imported. Where the hard limit is above 4,096 that lowers it, and an unprivileged process
cannot raise it back: `--max-connections` above about 3,800 would be cut to fit. Where the
hard limit is below 4,096 the call raises ValueError, so the import, and the server, dies.

`import tqserve` installs `guard()`: a one-shot import hook that runs mlx_lm.utils with a
setrlimit that only raises the soft limit toward the 2,048 mlx-lm asks for (it opens many
weight files), within the hard limit, and never lowers either limit. A program that
imported mlx_lm.utils before tqserve already has mlx-lm's limits; see docs/limits.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import resource
import sys
from types import ModuleType
from typing import Any, Callable, Sequence

TARGET = "mlx_lm.utils"


def raise_only(real: Callable[[int, tuple[int, int]], None]
               ) -> Callable[[int, tuple[int, int]], None]:
    """`real` (resource.setrlimit) for every resource but RLIMIT_NOFILE; for that one,
    raise the soft limit toward the asked soft limit, capped by the hard limit."""

    def setrlimit(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            real(which, limits)
            return
        soft, hard = resource.getrlimit(which)
        want = limits[0] if hard == resource.RLIM_INFINITY else min(limits[0], hard)
        if soft != resource.RLIM_INFINITY and soft < want:
            real(which, (want, hard))

    return setrlimit


class _Loader(importlib.abc.Loader):
    """mlx_lm.utils' own loader, executing the module under `raise_only`."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        real = resource.setrlimit
        resource.setrlimit = raise_only(real)
        try:
            self.inner.exec_module(module)
        finally:
            resource.setrlimit = real

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: the inner's
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]  # one shot
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def guard() -> None:
    """Install the hook (idempotent; nothing to do once mlx_lm.utils is imported)."""
    if TARGET in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
