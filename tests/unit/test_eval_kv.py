"""tools.eval_kv end to end at tiny sizes on the bundled draft model; no time assertions."""

import json
import math

import mlx.core as mx
import pytest

from tqserve.engine.model import DEFAULT_MODEL
from tqserve.tools.eval_kv import Scheme, main

SCHEMES = ["plain", "k8v8", "k8v3", "k4v4", "k3v3", "affine8", "affine4", "affine3"]


def test_tiny_eval_writes_report_and_plot(tmp_path, capsys):
    out, png = tmp_path / "eval.json", tmp_path / "kl.png"
    argv = ["--model", str(DEFAULT_MODEL), "--contexts", "64,128", "--score-tokens", "32",
            "--windows", "1", "--chunk", "32", "--codec-vectors", "2000",
            "--out", str(out), "--plot", str(png)]
    assert main(argv) == 0
    report = json.loads(out.read_text())

    assert set(report) == {"machine", "model", "settings", "schemes", "codec", "targets"}
    assert report["model"]["dtype"] == "float32"
    assert report["settings"]["reference"] == "plain mlx-lm KVCache in float32"
    assert list(report["schemes"]) == SCHEMES
    for scheme in report["schemes"].values():
        assert set(scheme) == {"family", "k_bits", "v_bits", "bits_per_value",
                               "stored_bits_per_value", "bytes_per_token_per_layer",
                               "seconds", "contexts"}
        assert set(scheme["contexts"]) == {"64", "128"}
        for r in scheme["contexts"].values():
            assert set(r) == {"ppl", "ppl_change", "mean_kl", "max_kl", "positions"}
            assert math.isfinite(r["ppl"]) and r["ppl"] > 1
            assert r["positions"] == 32
    for c in ("64", "128"):
        assert report["schemes"]["plain"]["contexts"][c]["mean_kl"] == 0
        assert (report["schemes"]["k8v8"]["contexts"][c]["mean_kl"]
                < report["schemes"]["k3v3"]["contexts"][c]["mean_kl"])
    assert [r["bits"] for r in report["codec"]] == [1, 2, 3, 4]
    for r in report["codec"]:
        assert r["measured_mse"] == pytest.approx(r["lloyd_max_mse"], rel=0.05)
    assert set(report["targets"]) == {"k8v8_ppl_within_0.5pct", "k4v4_kl_below_affine4",
                                      "k3v3_kl_below_affine3"}
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "mean KL" in capsys.readouterr().out


@pytest.mark.parametrize("scheme", [Scheme("plain", "plain"), Scheme("k4v4", "turboquant", 4, 4),
                                    Scheme("k8v3", "turboquant", 8, 3),
                                    Scheme("affine4", "affine", 4, 4)])
def test_bytes_per_token_match_the_caches(scheme, draft_model):
    """The stored-bytes formula equals a real cache's nbytes at a whole 256-position step."""
    cache = scheme.make(draft_model.model, seed=0)[0]
    kv = mx.random.normal((1, 2, 256, 128))
    cache.update_and_fetch(kv, kv)
    assert cache.nbytes == 256 * scheme.bytes_per_token(2, 128, 4)
