"""tools.bench_spec end to end at tiny sizes on the bundled model (it verifies itself with
lookup): every task, batch and method has a positive rate, and the
acceptance books add up."""

from __future__ import annotations

import json

from tqserve.engine.model import DEFAULT_MODEL
from tqserve.tools.bench_spec import edit_prompts, main


def test_quick_bench_spec_writes_every_figure(tmp_path, capsys, draft_model):
    out = tmp_path / "spec.json"
    assert main(["--quick", "--model", str(DEFAULT_MODEL), "--methods", "lookup",
                 "--blas", "none", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"continuation", "edit"}
    for per_b in report["results"].values():
        assert set(per_b) == {"2"}
        for per_m in per_b.values():
            assert set(per_m) == {"plain", "lookup"}
            assert all(r["tok_s"] > 0 for r in per_m.values())
            r = per_m["lookup"]
            assert 0 <= r["accepted"] <= r["proposed"] and r["speedup"] > 0
    assert "x plain" in capsys.readouterr().out
    prompts = edit_prompts(draft_model.tokenizer, 3)
    assert len({tuple(p) for p in prompts}) == 3
    assert "renamed to" in draft_model.tokenizer.decode(prompts[0])
