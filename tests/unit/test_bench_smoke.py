"""tools.bench end to end at tiny sizes on the bundled model: every key, positive figures.

No wall-clock assertions (DESIGN.md §5): only that both sides ran and were measured.
"""

import json
import subprocess
import sys

import pytest

from tqserve.engine.model import DEFAULT_MODEL
from tqserve.tools.bench import FIGURES, QUICK, build_parser, main


def test_quick_bench_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--model", str(DEFAULT_MODEL), "--out", str(out)]) == 0
    report = json.loads(out.read_text())

    assert set(report) == {"machine", "model", "settings", *FIGURES}
    assert {"platform", "cpu_count", "mlx", "mlx_lm", "device", "dtype", "blas",
            "fp32_matmul_gflops"} <= set(report["machine"])
    assert report["machine"]["dtype"] == report["model"]["dtype"] == "float32"
    assert report["model"]["name"] == DEFAULT_MODEL.name
    assert report["settings"]["concurrency"] == QUICK["concurrency"] == 2
    assert report["settings"]["new_tokens"] == QUICK["new_tokens"] == 8
    for name in FIGURES:
        figure = report[name]
        assert set(figure) == {"tqserve", "mlx_lm", "ratio", "outputs_match"}
        for side in ("tqserve", "mlx_lm"):
            assert len(figure[side]["runs"]) == QUICK["repeats"]
            assert figure[side]["median"] > 0
            assert all(v > 0 for v in figure[side]["runs"])
        assert figure["ratio"] > 0
        assert figure["outputs_match"] is True, (name, figure)
    assert "aggregate decode tok/s (x2)" in capsys.readouterr().out


def test_blas_flag_takes_auto_none_or_a_library_and_refuses_the_rest(tmp_path, capsys):
    """`--blas` speaks serve's words (auto | none | PATH); a bad value is one line, exit 2
    (it was a traceback: the bench passed "auto" to the loader as a path)."""
    parser = build_parser()
    assert parser.parse_args(["--blas", "none"]).blas == "none"
    assert parser.parse_args(["--blas", "auto"]).blas is not None  # a library, or "none"
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--blas", str(tmp_path / "missing.so")])
    assert exited.value.code == 2 and "no such file" in capsys.readouterr().err
    not_a_library = tmp_path / "fake.so"
    not_a_library.write_text("not ELF")
    run = subprocess.run([sys.executable, "-m", "tqserve.tools.bench", "--quick", "--blas",
                          str(not_a_library)], capture_output=True, text=True, timeout=120)
    err = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(err) == 1 and "--blas: cannot load" in err[0], run.stderr


def test_all_decoding_rate_leaves_out_what_came_before_every_request_decoded():
    from tqserve.tools.bench import Trace, all_decoding_rate, burst_rate

    early = Trace(times=[0.0, 1.0, 2.0, 3.0, 4.0], tokens=[1] * 5)  # decoding from t=0
    late = Trace(times=[3.0, 4.0, 4.0, 4.0], tokens=[2] * 4)       # prefilled until t=3
    # after t=3: early's token at 4.0, late's three at 4.0 (one verify step): 4 in 1 s
    assert all_decoding_rate([early, late]) == 4.0
    assert burst_rate([early, late]) == 7 / 4  # the window from the first token: 7 in 4 s
    assert all_decoding_rate([Trace(times=[1.0], tokens=[1])]) == 0.0
