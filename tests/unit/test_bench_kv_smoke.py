"""tools.bench_kv end to end at tiny sizes on the bundled model: several rows, a scheme
subset, the affine scheme; a bad scheme or --rows is a CLI error (exit 2).

No wall-clock assertions (DESIGN.md §5): only that every scheme ran and was measured.
"""

import json

import pytest

from tqserve.engine.model import DEFAULT_MODEL
from tqserve.tools.bench_kv import main


def test_bench_kv_rows_and_schemes(tmp_path, capsys):
    out = tmp_path / "bench_kv.json"
    assert main(["--model", str(DEFAULT_MODEL), "--contexts", "40", "--rows", "2",
                 "--steps", "1", "--repeats", "1", "--prefill-chunk", "30",
                 "--schemes", "fused,affine8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == 2
    schemes = report["results"]["40"]
    assert set(schemes) == {"plain", "k4v4-fused", "affine8"}
    for figure in schemes.values():
        assert figure["ms_per_step"] > 0 and figure["kv_bytes"] > 0
        assert figure["tokens_per_s"] == pytest.approx(2000.0 / figure["ms_per_step"])
    assert schemes["k4v4-fused"]["kv_bytes"] < schemes["affine8"]["kv_bytes"] < \
        schemes["plain"]["kv_bytes"]
    assert "2 rows" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [(["--schemes", "nope"], "unknown schemes"),
                                          (["--rows", "0"], "must be positive")])
def test_bench_kv_refuses_bad_arguments(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(DEFAULT_MODEL), "--contexts", "8", "--steps", "1",
              "--out", str(tmp_path / "x.json"), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
