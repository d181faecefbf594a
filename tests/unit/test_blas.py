"""`serve`/`generate` load the system's optimized BLAS before MLX, or print how to get one."""

import os
import subprocess
import sys

import pytest

from tqserve.api import cli
from tqserve import blas

OPENBLAS = blas.find()


def test_choices():
    assert blas.resolve("none") is None
    assert blas.resolve("auto") == OPENBLAS
    with pytest.raises(ValueError, match="--blas: no such file: /no/such/libblas.so"):
        blas.resolve("/no/such/libblas.so")
    assert blas.choice_in(["serve", "--port", "1"]) == "auto"
    assert blas.choice_in(["generate", "--blas", "none", "--prompt", "x"]) == "none"
    assert blas.choice_in(["serve", "--blas=/x.so"]) == "/x.so"


def test_too_late_once_mlx_is_imported():
    import mlx.core  # noqa: F401  (already imported by the suite; made explicit)

    with pytest.raises(RuntimeError, match="before mlx is imported"):
        blas.load("/any/path")


def test_in_a_process_already_running_mlx_auto_does_nothing(capsys):
    cli._load_blas("auto")
    cli._load_blas("none")
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="--blas PATH needs a process"):
        cli._load_blas("/some/libblas.so.3")


def test_no_blas_found_prints_the_hint(monkeypatch, capsys):
    for name, value in (("loaded", None), ("chosen", None), ("late", False), ("said", False)):
        monkeypatch.setattr(blas, name, value)
    monkeypatch.setattr(blas, "KNOWN_PATHS", ())
    monkeypatch.setattr(blas, "shim", lambda: None)
    monkeypatch.setenv(blas.ENV, "auto")
    monkeypatch.delitem(sys.modules, "mlx.core")  # as in a fresh `tqserve` process
    cli._report(cli._blas_line("auto"))
    err = capsys.readouterr().err
    if sys.platform.startswith("linux"):
        assert err.strip() == blas.HINT and "libopenblas0-pthread" in err
    cli._report(cli._blas_line("none"))
    assert capsys.readouterr().err == ""


def test_the_shim_over_the_wheel_is_built_once_and_exports_mlxs_calls(tmp_path, monkeypatch):
    if blas.wheel_library() is None or blas.shim() is None:
        pytest.skip("scipy-openblas32 or a C compiler is missing here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = blas.shim()
    assert built is not None and built.startswith(str(tmp_path)) and blas.shim() == built
    import ctypes

    lib = ctypes.CDLL(built)
    assert lib.tqserve_blas_bind(blas.wheel_library().encode()) == 0
    for name in ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm"):
        assert getattr(lib, name) is not None


def test_the_embedded_api_gets_the_blas_and_mlx_first_is_said_once():
    """`import tqserve.engine` before MLX loads the BLAS (TQSERVE_BLAS auto); MLX first
    keeps the reference one and load_model says so on one line."""
    probe = ("import {first}; import tqserve.engine; import mlx.core as mx; "
             "from tqserve import blas; from tqserve.engine.model import load_model; "
             "load_model(dtype='float32'); load_model(dtype='float32'); "
             "x = mx.ones((64, 64)) @ mx.ones((64, 64)); mx.eval(x); "
             "print(blas.loaded in open('/proc/self/maps').read() if blas.loaded else None)")
    env = dict(os.environ, **{blas.ENV: "auto"})  # (a bench earlier in the run may set it)
    engine_first = subprocess.run([sys.executable, "-c", probe.format(first="tqserve")],
                                  capture_output=True, text=True, timeout=120, env=env)
    assert engine_first.returncode == 0, engine_first.stderr
    if OPENBLAS is not None:
        assert engine_first.stdout.strip() == "True" and engine_first.stderr == ""
    mlx_first = subprocess.run([sys.executable, "-c", probe.format(first="mlx.core")],
                               capture_output=True, text=True, timeout=120, env=env)
    assert mlx_first.returncode == 0, mlx_first.stderr
    assert mlx_first.stdout.strip() == "None"
    if sys.platform.startswith("linux"):
        assert mlx_first.stderr == blas.TOO_LATE + "\n"


def test_bad_blas_path_is_one_line_and_exit_2_before_the_model_loads():
    result = subprocess.run([sys.executable, "-m", "tqserve.api.cli", "generate", "--blas",
                             "/no/such/libblas.so", "--model", "/no/such/model", "--prompt", "x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == "tqserve: error: --blas: no such file: /no/such/libblas.so\n"


@pytest.mark.skipif(OPENBLAS is None, reason="no optimized BLAS installed "
                    "(Debian: apt-get install libopenblas0-pthread)")
def test_auto_loads_the_system_blas_into_mlx_process():
    probe = ("from api import cli; cli._load_blas({!r}); import mlx.core as mx; "
             "mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64))); "
             "print(open('/proc/self/maps').read())")
    loaded = subprocess.run([sys.executable, "-c", probe.format("auto")], capture_output=True,
                            text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stderr == f"tqserve: BLAS {OPENBLAS}\n"
    assert OPENBLAS in loaded.stdout
    kept = subprocess.run([sys.executable, "-c", probe.format("none")], capture_output=True,
                          text=True, timeout=120)
    assert kept.returncode == 0 and kept.stderr == ""
    assert OPENBLAS not in kept.stdout
