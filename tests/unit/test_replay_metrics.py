"""tools/replay's sans-io parts: metric arithmetic on hand-made results with known answers,
ideal reuse, the Mooncake block scaling, family subsampling, the recording format."""

from __future__ import annotations

import json

import pytest

from tqserve.tools.replay.metrics import RequestResult, ideal_reuse, parse_goodput, summarize, \
    time_series
from tqserve.storage.recording import RecordingWriter, read_recording
from tqserve.tools.replay.traces import load_mooncake, subsample_families

R0 = RequestResult(index=0, send_s=0.0, prompt_tokens=10, token_times=(1.0, 1.5, 2.0),
                   done_s=2.0, completion_tokens=3, output_tokens=(5, 6, 7),
                   finish_reason="length")
R1 = RequestResult(index=1, send_s=1.0, prompt_tokens=20, token_times=(1.2, 1.4), done_s=1.4,
                   completion_tokens=2, cached_tokens=8, cached_tier="ram")
R2 = RequestResult(index=2, send_s=2.0, prompt_tokens=5, error="overloaded")


def test_summary_known_answers():
    s = summarize([R0, R1, R2], goodput=parse_goodput(["ttft:500", "tpot:300"]))
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["duration_s"] == pytest.approx(2.0)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 5)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(17.5)
    expect = {"ttft": (600, 600, 992), "tpot": (350, 350, 497), "itl": (400, 500, 500),
              "e2el": (1200, 1200, 1984)}
    for name, (mean, median, p99) in expect.items():
        assert s[f"mean_{name}_ms"] == pytest.approx(mean), name
        assert s[f"median_{name}_ms"] == pytest.approx(median), name
        assert s[f"p99_{name}_ms"] == pytest.approx(p99), name
    assert s["request_goodput"] == pytest.approx(0.5)  # only R1 meets TTFT 500 ms
    assert s["goodput_fraction"] == pytest.approx(1 / 3)
    assert s["achieved_reuse_fraction"] == pytest.approx(8 / 30)
    assert s["by_outcome"]["miss"]["requests"] == 1
    assert s["by_outcome"]["ram"] == {"requests": 1, "prompt_tokens": 20, "cached_tokens": 8,
                                      "mean_ttft_ms": pytest.approx(200),
                                      "median_ttft_ms": pytest.approx(200),
                                      "p99_ttft_ms": pytest.approx(200)}
    assert s["by_outcome"]["ssd"]["requests"] == 0
    assert s["errors"] == {"overloaded": 1}
    assert R1.outcome == "ram" and R0.outcome == "miss"
    row = R0.to_json()
    assert row["ttft_ms"] == pytest.approx(1000) and row["output_tokens"] == [5, 6, 7]
    json.dumps(row)


def test_goodput_parse_errors_name_the_item():
    for bad, word in ((["ttfb:5"], "ttfb"), (["ttft:x"], "ttft:x"), (["tpot:-1"], "tpot:-1")):
        with pytest.raises(ValueError, match=word):
            parse_goodput(bad)


def test_ideal_reuse_infinite_and_donor_finished():
    a, b, c, d = [1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 3, 4, 5], [7]
    r = ideal_reuse([a, b, c, d], send_s=[0.0, 1.0, 0.2, 4.0], done_s=[0.5, 2.0, 3.0, None])
    assert r["prompt_tokens"] == 14
    # infinite: C reuses A's 4 (its last token must run: cap 4 of 5), B 3 of A/C, D none
    assert r["ideal_reuse_infinite"] == pytest.approx(7 / 14)
    # donor finished: C is sent before A finishes; only B finds A finished (3 tokens)
    assert r["ideal_reuse_donor_finished"] == pytest.approx(3 / 14)


def test_time_series_bins():
    ts = time_series([R0, R1, R2], bin_s=1.0)
    assert ts["t_s"] == [1.0, 2.0, 3.0]
    assert ts["output_tokens_per_s"] == [0.0, 4.0, 1.0]  # tokens at 1.0,1.2,1.4,1.5 | 2.0
    assert ts["cached_fraction"][1] == pytest.approx(8 / 20)


def _mooncake(tmp_path, rows):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_blocks_scale_and_last_block_cut_in_proportion(tmp_path):
    path = _mooncake(tmp_path, [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]},
        {"timestamp": 6000, "input_length": 300, "output_length": 7, "hash_ids": [9]}])
    r0, r1, r2 = load_mooncake(path, block_tokens=16, vocab_size=8192, max_output=20)
    assert len(r0.prompt_tokens) == 16 + 15   # last block 488 of 512 -> round(15.25)
    assert len(r1.prompt_tokens) == 32 + 2    # 76 of 512 -> round(2.375)
    assert len(r2.prompt_tokens) == 9         # 300 of 512 -> round(9.375)
    assert r0.implied_input_tokens == pytest.approx(31.25)
    assert r1.prompt_tokens[:31] == r0.prompt_tokens  # shared blocks give shared tokens
    assert r2.prompt_tokens[0] != r0.prompt_tokens[0] or r2.prompt_tokens != r0.prompt_tokens[:9]
    assert all(2 <= t < 8192 for t in r0.prompt_tokens + r1.prompt_tokens)
    assert (r0.max_tokens, r1.max_tokens, r2.max_tokens) == (5, 20, 7)
    assert (r1.arrival_s, r1.family) == (3.0, "0:1")
    full = load_mooncake(path, block_tokens=512, vocab_size=8192)
    assert [len(r.prompt_tokens) for r in full] == [1000, 1100, 300]
    again = load_mooncake(path, block_tokens=16, vocab_size=8192)
    assert again[1].prompt_tokens == r1.prompt_tokens  # deterministic


def test_mooncake_refuses_other_block_sizes(tmp_path):
    path = _mooncake(tmp_path, [{"timestamp": 0, "input_length": 1000, "output_length": 5,
                                 "hash_ids": list(range(63))}])  # 16-token blocks
    with pytest.raises(ValueError, match="512"):
        load_mooncake(path, block_tokens=16, vocab_size=8192)
    with pytest.raises(ValueError, match="block-tokens"):
        load_mooncake(path, block_tokens=0, vocab_size=8192)


def test_family_subsampling_keeps_whole_families(tmp_path):
    rows = [{"timestamp": i, "input_length": 600, "output_length": 1,
             "hash_ids": [0, 100 + i % 10]} for i in range(200)]
    reqs = load_mooncake(_mooncake(tmp_path, rows), block_tokens=4, vocab_size=8192)
    kept = subsample_families(reqs, 0.5)
    families = {r.family for r in kept}
    assert 0 < len(families) < 10
    assert len(kept) == sum(1 for r in reqs if r.family in families)


def test_recording_round_trip_and_torn_tail(tmp_path):
    path = tmp_path / "rec.tqrec"
    w = RecordingWriter(path, {"model": "m", "config": {}})
    records = [{"request_id": f"r{i}", "arrival_s": i * 0.5, "prompt_tokens": [2, 3, i + 4],
                "params": {"max_tokens": 4, "seed": None}, "output_tokens": [9] * i,
                "finish_reason": "length", "cached_tokens": 0} for i in range(3)]
    for r in records:
        w.write(r)
    w.close()
    header, got = read_recording(path)
    assert header["model"] == "m" and header["version"] == 1 and got == records
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # a killed server: the frame's end is missing
    assert read_recording(path)[1] == records
    (tmp_path / "x").write_bytes(b"not zstd at all")
    with pytest.raises(ValueError, match="not a"):
        read_recording(tmp_path / "x")
