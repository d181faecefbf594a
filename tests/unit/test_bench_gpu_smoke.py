"""tools/bench_gpu at toy sizes on the bundled model (real weights, so tokens must match)."""

import json

from tqserve.tools import bench_gpu


def test_bench_gpu_bundled_tiny(tmp_path, capsys):
    """With --fast-decode on (the GPU default) the engine runs a fused copy of the model and
    mlx-lm the model as loaded: the tokens still match (float32 on the CPU: bit-equal)."""
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(["--shape", "bundled", "--dtype", "float32", "--concurrency", "2,1",
                           "--new-tokens", "4", "--prompt-tokens", "8", "--repeats", "1",
                           "--max-step-tokens", "16", "--equality-model", "bundled",
                           "--equality-count", "3", "--fast-decode", "on",
                           "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["concurrency"] == [1, 2]
    assert report["settings"]["fast_decode"] == "on"
    assert report["settings"]["max_step_tokens"] == 16
    assert report["equality"]["batch_match"] is True and report["equality"]["stream_match"] is True
    figures = report["figures"]
    assert set(figures) == {"c1", "c2"} and "decode_vs_stream" in figures["c1"]
    assert report["engine_start_s"] > 0
    for fig in figures.values():
        for name in ("decode", "all_first"):
            assert fig[name]["outputs_match"] is True
            assert fig[name]["tqserve"]["median"] > 0 and fig[name]["mlx_lm"]["median"] > 0
    assert fig["decode"]["ratio"] == (fig["decode"]["tqserve"]["median"]
                                      / fig["decode"]["mlx_lm"]["median"])
    printed = capsys.readouterr().out
    assert "vs stream_generate" in printed and "greedy equality" in printed
