"""tools.bench_prefix end to end at tiny sizes on the bundled model: every key, real hits.

No wall-clock assertions (DESIGN.md §5): only that each tier was hit and measured.
"""

import json

from tqserve.engine.model import DEFAULT_MODEL
from tqserve.tools.bench_prefix import main


def test_quick_bench_prefix_hits_each_tier(tmp_path, capsys):
    out = tmp_path / "bench_prefix.json"
    assert main(["--quick", "--model", str(DEFAULT_MODEL), "--out", str(out)]) == 0
    report = json.loads(out.read_text())

    assert set(report) == {"machine", "model", "settings", "ttft", "snapshot_bytes"}
    prompt = report["settings"]["prompt_tokens"]
    ttft = report["ttft"]
    assert set(ttft) == {"cold", "ram", "ssd", "cold_spilling"}
    for name, figure in ttft.items():
        assert figure["median_s"] > 0 and figure["same_tokens_as_cold"], name
    assert ttft["ram"]["cached_tokens"] == ttft["ssd"]["cached_tokens"] == [prompt - 1]
    assert ttft["ram"]["speedup_vs_cold"] > 0 and ttft["ssd"]["speedup_vs_cold"] > 0
    sizes = report["snapshot_bytes"]
    assert sizes["plain"]["cache_kind"] == "kv"
    assert sizes["turboquant_k4v4"]["cache_kind"] == "turboquant"
    for size in sizes.values():
        assert size["tokens"] >= prompt and size["ram_bytes"] > 0 and size["disk_bytes"] > 0
    assert sizes["turboquant_k4v4"]["ram_bytes"] < sizes["plain"]["ram_bytes"]
    assert "SSD hit after restart" in capsys.readouterr().out


def test_index_bench_reports_publish_and_lookup_percentiles(tmp_path, capsys):
    out = tmp_path / "bench_index.json"
    assert main(["--index", "--entries", "200", "--prompt-tokens", "256",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"machine", "settings", "index"}
    assert report["settings"]["entries"] == 200
    for name in ("publish", "lookup"):
        figure = report["index"][name]
        assert 0 < figure["p50_us"] <= figure["p99_us"] <= figure["max_us"], name
    assert report["index"]["entries_at_end"] == 400
    assert "lookup" in capsys.readouterr().out
