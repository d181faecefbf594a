"""tools.bench_join end to end at tiny sizes: every kind on the slots side, plain KV also
on mlx-lm's merge side, is measured; an unknown kind is a CLI error (exit 2). No wall-clock assertions."""

import json

import pytest

from tqserve.tools.bench_join import KINDS, main, sides_of


def test_bench_join_every_kind_and_side(tmp_path, capsys):
    out = tmp_path / "bench_join.json"
    assert main(["--rows", "2", "--context", "8", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["kinds"] == list(KINDS)
    assert set(report["figures"]) == {f"{k}_r2_{s}" for k in KINDS for s in sides_of(k)}
    assert {"plain_r2_merge", "plain_r2_slots", "tq-k4v4_r2_slots"} <= set(report["figures"])
    for figure in report["figures"].values():
        assert figure["join_ms"] > 0 and figure["retire_ms"] > 0
    assert "tq-k4v4_r2_slots: join" in capsys.readouterr().out


def test_bench_join_refuses_an_unknown_kind(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--kinds", "plain,nope", "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert "unknown nope" in capsys.readouterr().err
