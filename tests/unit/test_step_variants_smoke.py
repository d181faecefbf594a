"""tools/step_variants at toy sizes on the bundled model: every variant runs and reports."""

import json

import pytest

from tqserve import blas
from tqserve.engine.model import DEFAULT_MODEL
from tqserve.tools import step_variants


def test_every_variant_reports_a_step_time_and_the_checks(tmp_path, capsys):
    out = tmp_path / "variants.json"
    assert step_variants.main(["--model", str(DEFAULT_MODEL), "--dtype", "float32",
                               "--batches", "1,2", "--prompt-tokens", "8", "--warm", "1",
                               "--steps", "3", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())["default"]
    for variant in step_variants.VARIANTS:
        for batch in (1, 2):
            figure = report[f"{variant}_b{batch}"]
            assert figure["ms_per_step"] > 0 and len(figure["runs"]) == 1, figure
    # the fused and compiled forwards compute the model's own logits (CPU, float32: bit for
    # bit on MLX's reference BLAS, within float32 rounding on OpenBLAS: tests/unit/test_fastpath)
    limit = 0.0 if blas.loaded is None else 1e-4
    for check in ("check_fused", "check_compiled"):
        assert report[check]["argmax_equal"] is True
        assert 0.0 <= report[check]["max_abs_logit_diff"] <= limit, report[check]
    assert "runner_fast_b2" in capsys.readouterr().out


def test_an_unknown_variant_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        step_variants.main(["--model", str(DEFAULT_MODEL), "--variants", "warp"])
    assert exc.value.code == 2
    assert "unknown --variants ['warp']" in capsys.readouterr().err
