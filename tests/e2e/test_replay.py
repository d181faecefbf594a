"""tqserve replay end to end: slices of the shared traces against a real server and an
embedded engine (request and token totals), record -> verify, a changed config found
divergent, restart on the same cache dir, A/B, connections past the stream limit."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import trio

from tqserve.engine.config import Config
from tqserve.engine.model import DEFAULT_MODEL
from tests.conftest import REPO, start_server
from tqserve.tools.replay.cli import main
from tqserve.storage.recording import read_recording
from tqserve.tools.replay.run import replay
from tqserve.tools.replay.targets import EngineTarget, UrlTarget
from tqserve.tools.replay.traces import (corpus_tokens, default_corpus_paths, load_azure,
                                 load_mooncake)

TRACES = REPO.parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_conversation_trace.jsonl"
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"
N = 6


def _need(path: Path) -> None:
    if not path.is_file():
        pytest.skip(f"shared trace not found at {path}")


def _mooncake_implied(n: int, block_tokens: int) -> int:
    """Tokens the first n Mooncake rows imply at this block size (computed from the raw
    rows: full blocks, and the last block's share of 512 rounded)."""
    total = 0
    with open(MOONCAKE) as f:
        for line, _ in zip(f, range(n)):
            row = json.loads(line)
            k = len(row["hash_ids"])
            last = row["input_length"] - 512 * (k - 1)
            total += (k - 1) * block_tokens + max(1, round(last * block_tokens / 512))
    return total


async def _run_both(reqs, draft_model, nursery, **server_kw):
    server = await start_server(nursery, draft_model, **server_kw)
    out = {}
    async with UrlTarget(server.ws_url, streams_per_connection=2) as target:
        before = await target.stats()
        out["server"] = await replay(target, reqs, concurrency=len(reqs))
        after = await target.stats()
        assert target.num_connections == math.ceil(len(reqs) / 2)  # past the stream limit
    assert after["requests_total"] - before["requests_total"] == len(reqs)
    async with EngineTarget(Config(model=str(DEFAULT_MODEL), dtype="float32")) as target:
        out["embedded"] = await replay(target, reqs, time_scale=0.001)
    return out


async def test_mooncake_slice_totals_on_server_and_embedded(draft_model, nursery):
    _need(MOONCAKE)
    reqs = load_mooncake(MOONCAKE, block_tokens=2, vocab_size=8192, max_output=3)[:N]
    implied = _mooncake_implied(N, 2)
    assert sum(r.implied_input_tokens for r in reqs) == pytest.approx(implied, abs=N)
    runs = await _run_both(reqs, draft_model, nursery, max_streams_per_connection=2)
    for name, results in runs.items():
        assert [r.index for r in results] == list(range(N)), name
        assert all(r.ok for r in results), name
        assert sum(r.prompt_tokens for r in results) == implied, name  # as the engine counted
        assert all(1 <= r.completion_tokens <= 3 for r in results)
    assert [r.output_tokens for r in runs["server"]] == [r.output_tokens for r in runs["embedded"]]


async def test_azure_slice_totals_on_server_and_embedded(draft_model, nursery):
    _need(AZURE)
    corpus = corpus_tokens(draft_model.tokenizer, default_corpus_paths()[:12])
    reqs = load_azure(AZURE, corpus=corpus, length_scale=0.02, max_output=3)[:N]
    with open(AZURE) as f:
        rows = [line.split(",") for line in list(f)[1:N + 1]]
    implied = sum(max(1, round(int(r[1]) * 0.02)) for r in rows)
    assert [r.max_tokens for r in reqs] == [min(3, int(r[2])) for r in rows]
    assert reqs[1].arrival_s == pytest.approx(4.3145788, abs=1e-4)
    runs = await _run_both(reqs, draft_model, nursery, max_streams_per_connection=2)
    for name, results in runs.items():
        assert all(r.ok for r in results), name
        assert sum(r.prompt_tokens for r in results) == implied, name


def _record(tmp_path: Path, draft_model) -> tuple[Path, list]:
    """Serve with --record and replay a Mooncake slice on it (odd requests seeded)."""
    from tqserve.api.config import ServerConfig
    from tqserve.api.server import serve

    rec = tmp_path / "run.tqrec"
    reqs = load_mooncake(MOONCAKE, block_tokens=2, vocab_size=8192, max_output=6)[:N]
    reqs = [r if r.index % 2 == 0 else
            type(r)(**{**_fields(r), "params": {"temperature": 1.0, "seed": 7 + r.index}})
            for r in reqs]

    async def run() -> list:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(lambda task_status: serve(
                ServerConfig(port=0), loaded=draft_model, record=str(rec),
                task_status=task_status))
            async with UrlTarget(url.replace("http", "ws") + "/v1/stream") as target:
                results = await replay(target, reqs, time_scale=0.001)
            nursery.cancel_scope.cancel()
        return results

    return rec, trio.run(run)


def _fields(r):
    import attrs

    return attrs.asdict(r, recurse=False)


def test_record_then_verify_and_a_changed_seed_diverges(tmp_path, draft_model, capsys):
    _need(MOONCAKE)
    rec, results = _record(tmp_path, draft_model)
    header, records = read_recording(rec)
    assert header["config"]["max_batch"] == 32 and len(records) == N
    by_prompt = {tuple(r["prompt_tokens"]): r for r in records}
    for res in results:
        assert res.ok
    seeds = sorted(r["params"]["seed"] for r in records if r["params"]["seed"] is not None)
    assert seeds == [8, 10, 12]
    assert sorted(len(r["output_tokens"]) for r in records) == \
        sorted(r.completion_tokens for r in results)
    assert all(r["arrival_s"] >= 0 and r["finish_reason"] in ("stop", "length")
               for r in by_prompt.values())

    same = tmp_path / "same"
    common = [str(rec), "--verify", "--model", str(DEFAULT_MODEL), "--dtype", "float32",
              "--no-load-check", "--no-progress", "--no-plots"]
    assert main(common + ["--out", str(same)]) == 0
    summary = json.loads((same / "A" / "summary.json").read_text())
    assert summary["verify"] == {"compared": N, "identical": N, "divergent": 0, "skipped": 0}
    assert summary["trace"]["tokens_sent"] == summary["total_input_tokens"]

    changed = tmp_path / "changed"
    assert main(common + ["--seed", "999", "--out", str(changed)]) == 1
    summary = json.loads((changed / "A" / "summary.json").read_text())
    assert summary["verify"]["divergent"] >= 1
    assert summary["verify"]["identical"] >= 3  # the greedy requests ignore the seed
    repros = sorted((changed / "divergences-A").glob("*.json"))
    assert len(repros) == summary["verify"]["divergent"]
    repro = json.loads(repros[0].read_text())
    first = repro["first_divergent_index"]
    assert repro["request"]["seed"] == 999 and repro["request"]["max_tokens"] == first + 1
    assert repro["expected"][:first] == repro["got"][:first]
    assert repro["expected"][first] != repro["got"][first]
    assert repro["request"]["prompt_tokens"] in [r["prompt_tokens"] for r in records]
    assert "divergent" in capsys.readouterr().out


def _family_trace(tmp_path: Path, output_length: int = 2) -> Path:
    rows = [{"timestamp": 0, "input_length": 1200, "output_length": 2, "hash_ids": [0, 1, 2]},
            {"timestamp": 0, "input_length": 900, "output_length": 2, "hash_ids": [3, 4]},
            # a filler: on main a snapshot spills at the engine's next step, which this gives
            {"timestamp": 1000, "input_length": 600, "output_length": 2, "hash_ids": [7, 8]},
            {"timestamp": 2000, "input_length": 1800, "output_length": 2,
             "hash_ids": [0, 1, 2, 5]},
            {"timestamp": 2000, "input_length": 1400, "output_length": 2,
             "hash_ids": [3, 4, 6]}]
    path = tmp_path / "family.jsonl"
    path.write_text("".join(json.dumps({**r, "output_length": output_length}) + "\n"
                            for r in rows))
    return path


@pytest.mark.parametrize("how", ["--model", "--spawn"])
def test_restart_on_the_same_cache_dir_serves_ssd_hits(tmp_path, how, capsys):
    out = tmp_path / "out"
    target = ["--model", str(DEFAULT_MODEL)] if how == "--model" else ["--spawn"]
    argv = [str(_family_trace(tmp_path)), *target, "--block-tokens", "8",
            "--cache-dir", str(tmp_path / "cache"), "--ram-cache-bytes", "1",
            "--restart-at", "3", "--concurrency", "1", "--no-progress",
            "--goodput", "ttft:100000", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "A" / "summary.json").read_text())
    assert summary["completed"] == 5 and summary["failed"] == 0
    assert summary["by_outcome"]["ssd"]["requests"] == 2  # both after the restart
    assert summary["by_outcome"]["ssd"]["cached_tokens"] == 19 + 14  # the donors' prompts
    assert summary["reuse"]["ideal_reuse_donor_finished"] == pytest.approx(
        summary["achieved_reuse_fraction"])
    assert summary["trace"]["tokens_sent"] == summary["total_input_tokens"] == 19 + 14 + 9 + 28 + 22
    assert summary["request_goodput"] > 0
    lines = (out / "A" / "requests.jsonl").read_text().splitlines()
    assert [json.loads(x)["outcome"] for x in lines] == ["miss", "miss", "miss", "ssd", "ssd"]
    assert (out / "A" / "replay.png").stat().st_size > 1000


def test_a_warm_cache_labels_the_ideals_and_speculation_is_recorded(tmp_path, capsys):
    """The second run on the same --cache-dir starts with the first's entries: its ideals
    (this run's prompts only) sit below the achieved fraction, and the table says why."""
    argv = [str(_family_trace(tmp_path, 8)), "--model", str(DEFAULT_MODEL), "--block-tokens",
            "8", "--cache-dir", str(tmp_path / "cache"), "--concurrency", "1", "--no-progress",
            "--no-plots"]
    assert main(argv + ["--out", str(tmp_path / "cold")]) == 0
    cold = json.loads((tmp_path / "cold" / "A" / "summary.json").read_text())
    assert cold["warm_entries"] == 0 and "speculative" not in cold
    capsys.readouterr()
    assert main(argv + ["--speculative", "lookup", "--out", str(tmp_path / "warm")]) == 0
    warm = json.loads((tmp_path / "warm" / "A" / "summary.json").read_text())
    assert warm["warm_entries"] >= 3
    assert warm["achieved_reuse_fraction"] > warm["reuse"]["ideal_reuse_infinite"]
    out = capsys.readouterr().out
    assert (f"(ideals count this run's prompts only: the target's cache held "
            f"{warm['warm_entries']} entries before it, so achieved can exceed them)") in out
    rows = [json.loads(x) for x in (tmp_path / "warm" / "A" / "requests.jsonl").read_text()
            .splitlines()]
    spec = [r["speculative"] for r in rows if r["speculative"] is not None]
    assert spec and all(set(x) >= {"proposed", "accepted"} for x in spec)
    assert warm["speculative"]["requests"] == len(spec)
    assert warm["speculative"]["proposed"] == sum(x["proposed"] for x in spec)
    assert "Speculative: accepted / proposed" in out


def test_ab_two_configs_ratio_table(tmp_path, capsys):
    argv = [str(_family_trace(tmp_path)), "--model", str(DEFAULT_MODEL), "--block-tokens", "4",
            "--time-scale", "0.01", "--ab-config", "turboquant=k4v4", "--no-progress",
            "--no-plots", "--out", str(tmp_path / "ab")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "B/A" in out and "request_throughput" in out
    b = json.loads((tmp_path / "ab" / "B" / "summary.json").read_text())
    assert b["compare_with_A"]["compared"] == 5
    assert b["completed"] == 5
    # open loop, per target: offered (as sent, reuse counted) vs measured; the busiest 10 s
    assert captured.err.count("load check: trace offers") == 2
    assert captured.err.count("load check: busiest 10 s: 5 requests") == 2


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    trace = _family_trace(tmp_path)
    for argv, word in (([str(trace), "--url", "ws://x/v1/stream", "--restart-at", "1"],
                        "--restart-at"),
                       ([str(trace), "--verify"], "--verify"),
                       ([str(trace), "--block-tokens", "0"], "block-tokens"),
                       ([str(tmp_path / "missing.jsonl")], "missing"),
                       ([str(trace), "--goodput", "ttfb:3"], "ttfb"),
                       ([str(trace), "--spawn", "--cache-dir", str(trace)],
                        "did not start: tqserve: error: --cache-dir")):
        assert main(argv + ["--no-load-check", "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and word in err and "Traceback" not in err


async def test_readme_client_example_runs(server):
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- example:client -->")[1].split("<!-- /example:client -->")[0]
    code = block.split("```python")[1].split("```")[0]
    assert "ws://127.0.0.1:8000/v1/stream" in code
    code = code.replace("ws://127.0.0.1:8000/v1/stream", server.ws_url)
    result = await trio.run_process([sys.executable, "-c", code], cwd=REPO,
                                    capture_stdout=True, capture_stderr=True)
    out = result.stdout.decode()
    assert out.rstrip().endswith("[length, cached {'ram': 0, 'ssd': 0}]"), out


async def test_stats_and_limits_pass_the_api_key(draft_model, nursery):
    server = await start_server(nursery, draft_model, api_key="sesame", max_queued_requests=9)
    async with UrlTarget(server.ws_url, api_key="sesame") as target:
        assert (await target.stats())["requests_total"] == 0
        assert await target.limits() == {"max_model_len": 32768, "max_batch": 32,
                                         "max_queued_requests": 9, "max_queued_tokens": 65536}
    async with UrlTarget(server.ws_url) as target:  # no key: the server says 401
        assert await target.stats() is None and await target.limits() == {}
