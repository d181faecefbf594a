"""The installed distribution: one `tqserve` namespace, the bundled model as package data.

A real wheel is built from the checkout and installed (not editable) into a fresh venv; its
`tqserve generate` must run from a directory that holds no checkout, with the test
environment's packages (MLX and the rest) visible only as plain path entries, so nothing of
the repository can leak in through the editable install.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PARTS = ("engine", "actors", "api", "storage", "tools")


def _declared() -> tuple[list[str], dict[str, str]]:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return setuptools["packages"], setuptools["package-dir"]


def test_every_package_folder_is_in_the_distribution():
    packages, package_dir = _declared()
    for part in PARTS:
        assert package_dir[f"tqserve.{part}"] == part
        for init in sorted((REPO / part).rglob("__init__.py")):
            dotted = ".".join(init.parent.relative_to(REPO).parts)
            assert f"tqserve.{dotted}" in packages, f"{init.parent} is not shipped"


def test_wheel_installs_under_one_namespace_and_generates(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(wheels), str(REPO)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("tqserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.endswith(".dist-info/RECORD")}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tqserve"}
    assert "tqserve/models/pycoder-draft-4m/model.safetensors" in names
    assert not [n for n in names if re.search(r"(^|/)tests?/", n)]

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                              "--no-index", str(wheel)], capture_output=True, text=True,
                             timeout=300)
    assert install.returncode == 0, install.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]  # deps only: .pth files not run
    where = subprocess.run([str(python), "-c", "import tqserve.engine.model as m; "
                            "print(m.__file__); print(m.DEFAULT_MODEL)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env)
    assert where.returncode == 0, where.stderr
    module_file, model_dir = where.stdout.split()
    assert Path(module_file).is_relative_to(env_dir) and Path(model_dir).is_relative_to(env_dir)

    result = subprocess.run([str(env_dir / "bin" / "tqserve"), "generate", "--prompt",
                             "def add(a, b):", "--max-tokens", "8", "--dtype", "float32"],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
