"""tools/route_sim: routing prediction over a Mooncake trace with the router's own core."""

import json

from tqserve.tools.route_sim import main, read_trace, simulate


def _trace(tmp_path):
    rows = []
    for conv in range(7):  # 7 conversations of 3 turns, each turn extends the last
        ids = [0]  # the shared system prompt block
        for turn in range(3):
            ids = ids + [100 * conv + 10 * turn + 1, 100 * conv + 10 * turn + 2]
            rows.append({"timestamp": 0, "input_length": 512 * len(ids) - 100,
                         "output_length": 5, "hash_ids": list(ids)})
    rows.sort(key=lambda r: len(r["hash_ids"]))  # first turns first, interleaved
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_prefix_routing_keeps_the_single_replica_reuse(tmp_path, capsys):
    rows = read_trace(str(_trace(tmp_path)))
    one = simulate(rows, 1, "prefix")
    # turn 1: block 0 only (not the very first); turns 2, 3: all but the last 2 blocks
    total = sum(n for n, _ in rows)
    want = sum(min(512 * (len(ids) - 2) if len(ids) > 3 else 512, n - 1) for n, ids in rows)
    want -= 512
    assert abs(one["reused_fraction"] - want / total) < 1e-12
    three = simulate(rows, 3, "prefix")
    rr = simulate(rows, 3, "round-robin")
    assert three["reused_fraction"] > rr["reused_fraction"]
    assert three["reused_fraction"] >= one["reused_fraction"] - 512 * 2 / total  # block 0
    assert rr["balance"] == 1.0
    tiny = simulate(rows, 1, "prefix", replica_blocks=2)
    assert tiny["reused_fraction"] < one["reused_fraction"]
    out = tmp_path / "r.json"
    assert main([str(tmp_path / "t.jsonl"), "--replicas", "1", "3", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["results"]) == 3
    assert "round-robin" in capsys.readouterr().out


def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main([str(bad)]) == 2
    assert "bad.jsonl:1: not a Mooncake row" in capsys.readouterr().err
    assert main([str(_trace(tmp_path)), "--replicas", "0"]) == 2
    assert main([str(tmp_path / "missing.jsonl")]) == 2
