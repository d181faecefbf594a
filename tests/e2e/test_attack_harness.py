"""tools.attack at a tiny scale against subprocess servers: its invariants hold.

100 deflate bombs (1 GiB inflated each) and 100 oversize frames: the server's RSS comes
back within 50 MB of its baseline, /health answers throughout, the server lives on.
"""

from __future__ import annotations

import json

from tqserve.tools.attack import main


def test_attack_harness_invariants(tmp_path):
    out = tmp_path / "attack.json"
    code = main(["--fuzz", "150", "--cancels", "30", "--pings", "50", "--slowloris", "10",
                 "--random", "20", "--connections", "50", "--bombs", "100", "--oversize", "100",
                 "--overload", "30", "--ws-message-timeout", "2", "--idle", "60",
                 "--trickle", "10", "--oversize-bodies", "10", "--http-timeout", "2",
                 "--prefill-rounds", "3", "--kv-rows", "12",
                 "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["invariants"] == {k: True for k in result["invariants"]}, result
    assert code == 0
    memory = result["memory"]
    assert (memory["bombs"], memory["oversize_frames"]) == (100, 100)
    assert memory["bomb_inflated_bytes"] == 1 << 30
    assert memory["rss_after_mb"] - memory["rss_baseline_mb"] <= 50
    assert result["fuzz"]["internal_error"] == 0 and result["fuzz"]["frames"] == 150
    assert result["overload"]["replies"].get("overloaded", 0) > 0
    assert result["slow"]["rows_active_after"] == 0
    assert result["stall"]["victim_tokens_during"] > 0
    web = result["http"]
    assert (web["idle_closed"], web["trickle_408"], web["oversize_413"]) == (60, 10, 10)
    assert result["grammars"]["statuses"] == [400, 400]
    assert result["prefill_cancel"]["internal_error"] == 0
    assert result["cache_dir"]["tmp_symlink_removed"] and result["cache_dir"]["ssd_errors"] >= 1
    assert result["router"]["silent"]["code"] == "backend_timeout"
    assert result["router"]["keys"]["drain_client_key"] == 401
    assert result["kv_budget"]["peak_kv_bytes"] <= result["kv_budget"]["kv_budget_bytes"]
