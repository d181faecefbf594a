"""tools.bench_lookup end to end at tiny sizes: JSON rows with the three timings, the same
proposal from all, and --out written."""

import json

import pytest

from tqserve.tools.bench_lookup import main


def test_bench_lookup_reports_both_sides(tmp_path, capsys):
    out = tmp_path / "lookup.json"
    assert main(["--contexts", "64,300", "--vocabs", "5,1000", "--repeats", "2",
                 "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    assert [(r["context"], r["vocab"]) for r in report["rows"]] == [
        (64, 5), (64, 1000), (300, 5), (300, 1000)]
    for row in report["rows"]:
        assert row["same_proposal"] is True
        assert row["numpy_ms"] > 0 and row["python_scan_ms"] > 0
        assert row["scan_over_numpy"] == pytest.approx(row["python_scan_ms"] / row["numpy_ms"])
        assert row["index_build_ms"] > 0 and row["index_step_ms"] > 0
        assert row["numpy_over_index_step"] == pytest.approx(
            row["numpy_ms"] / row["index_step_ms"])


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--contexts", "0"])
    assert exc.value.code == 2 and "positive integers" in capsys.readouterr().err
