"""tools.bench_preempt end to end at tiny sizes on the draft model: every side reports
its figures, the budgeted sides stay within the budget, and every side makes the tokens
of the run without a budget (mlx-lm: as many)."""

from __future__ import annotations

import json

from tqserve.tools.bench_preempt import main


def test_quick_bench_preempt_writes_every_figure(tmp_path, capsys, draft_model):
    out = tmp_path / "preempt.json"
    assert main(["--quick", "--model", str(draft_model.path), "--blas", "none",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    sides = report["sides"]
    assert set(sides) == {"none", "reserve", "preempt", "mlx_lm"}
    made = sum(report["output_lengths"])
    assert 0 < made <= 3 * 24
    for name, side in sides.items():
        assert side["tokens"] == made and side["tokens_per_s"] > 0, name
        assert 1 <= side["max_rows"] <= 3 and side["peak_mlx_bytes"] > 0, name
    for name in ("none", "reserve", "preempt"):
        assert sides[name]["same_tokens_as_none"] == 3, name
    for name in ("reserve", "preempt"):
        assert 0 < sides[name]["peak_kv_bytes"] <= sides[name]["budget_bytes"], name
    assert sides["none"]["budget_bytes"] == 0 and sides["reserve"]["max_rows"] == 1
    assert set(report["ratios"]) == {"preempt/reserve", "preempt/none", "preempt/mlx_lm"}
    assert "preempt/reserve: tok/s" in capsys.readouterr().err


def test_a_bad_size_is_a_usage_error(capsys):
    assert main(["--budget-lives", "1"]) == 2  # preempt needs two lives for one request
    assert "--budget-lives must be >= 2, got 1" in capsys.readouterr().err
    assert main(["--requests", "0"]) == 2
    assert "--requests must be >= 1, got 0" in capsys.readouterr().err
