"""Package boundaries: engine imports no trio/quart/msgpack/zstandard; storage no mlx."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "engine": {"trio", "quart", "quart_trio", "hypercorn", "msgpack", "zstandard", "actors",
               "api", "storage"},
    "storage": {"mlx", "mlx_lm", "engine", "actors", "api"},
    "actors": {"api", "quart", "quart_trio", "hypercorn"},
    "tqserve": {"mlx", "mlx_lm", "engine", "actors", "api", "storage", "tools"},  # the client
}
# The front door (tqserve/__init__.py) names engine types for type checkers only, under
# `if TYPE_CHECKING:`; it loads them lazily (test_front_door checks sys.modules for that).
TYPE_ONLY_ALLOWED = {"tqserve"}


def _top(module: str) -> str:
    """The part a module belongs to: `tqserve.engine.kv` -> `engine`, `mlx.core` -> `mlx`."""
    parts = module.split(".")
    return parts[1] if parts[0] == "tqserve" and len(parts) > 1 else parts[0]


def _type_only(tree: ast.AST) -> set[ast.AST]:
    """The nodes inside `if TYPE_CHECKING:` blocks."""
    return {inner for node in ast.walk(tree) if isinstance(node, ast.If)
            and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            for stmt in node.body for inner in ast.walk(stmt)}


def _imports(path: Path, *, type_only_allowed: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_only(tree) if type_only_allowed else set()
    names = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {_top(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(_top(node.module))
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"no modules found in {package}/"
    bad = {}
    for path in files:
        hit = _imports(path, type_only_allowed=package in TYPE_ONLY_ALLOWED) \
            & FORBIDDEN[package]
        if hit:
            bad[str(path.relative_to(REPO))] = sorted(hit)
    assert bad == {}


def test_mlx_is_imported_only_by_engine_and_tools():
    offenders = []
    for package in ("actors", "api", "storage"):
        for path in (REPO / package).rglob("*.py"):
            if _imports(path) & {"mlx", "mlx_lm"}:
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == []
