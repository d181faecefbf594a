"""tools.bench_grammar end to end at tiny sizes on the bundled model (no wall-clock checks)."""

import json

from tqserve.engine.model import DEFAULT_MODEL
from tqserve.tools.bench_grammar import MODES, main


def test_quick_bench_grammar_reports_every_mode(tmp_path, capsys):
    out = tmp_path / "bench_grammar.json"
    argv = ["--model", str(DEFAULT_MODEL), "--batch", "2", "--steps", "3", "--repeats", "1",
            "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"machine", "model", "settings", "figures"}
    modes = report["figures"]["B2"]
    assert set(modes) == set(MODES)
    for mode, fig in modes.items():
        assert fig["step_ms"] > 0, mode
    assert modes["free"]["mask_ms"] == 0 and modes["free"]["consume_ms"] == 0
    for mode in ("json", "json_inline"):
        assert modes[mode]["mask_ms"] > 0 and modes[mode]["consume_ms"] > 0
        assert modes[mode]["step_vs_free"] > 0
    assert modes["json_inline"]["wait_ms"] == 0  # inline masks are never waited for
    assert "B2 json_inline" in capsys.readouterr().out
