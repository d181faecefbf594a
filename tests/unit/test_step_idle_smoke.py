"""tools.step_idle end to end at tiny sizes on the bundled model: the runner timed its
step gaps and the JSON holds one row per batch size (no wall-clock assertions)."""

import json

from tqserve.engine.model import DEFAULT_MODEL
from tqserve.tools.step_idle import main


def test_step_idle_writes_gaps_per_batch(tmp_path, capsys):
    out = tmp_path / "idle.json"
    assert main(["--model", str(DEFAULT_MODEL), "--batches", "1", "3", "--new-tokens", "8",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    [result] = report["results"]
    assert result["model"] == DEFAULT_MODEL.name and result["dtype"] == "float32"
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["steps_timed"] >= 7  # every decode step after the first is timed
        assert row["gap_ms_median"] > 0 and row["gap_ms_mean"] > 0
        assert 0 < row["gap_share_of_wall"] < 1
        assert row["steps"] >= 8 and row["trio_cpu_ms_per_step"] > 0
    assert "B3: gap median" in capsys.readouterr().out
