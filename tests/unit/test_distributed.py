"""engine.distributed without a model group: the plan codec, the shard check, the refusals,
the SSD tier's recovery agreement, and the plan broadcast and the replies' gather over 2
real ring ranks (a tiny script under mlx.launch)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tqserve.actors.shard_group import agreed
from tqserve.api.cli import main
from tqserve.engine.config import Config
from tqserve.engine.distributed import check_shardable, init_group
from tqserve.engine.plan_channel import BLOCK, decode, encode
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.step import NewRow, PrefillChunk, StepPlan
from tqserve.engine.speculative.policy import SpecChoice
from tqserve.engine.structured import ResponseFormat
from tests.e2e.test_distributed import LAUNCH

REPO = Path(__file__).resolve().parents[2]


def test_a_plan_round_trips_and_foreign_classes_are_refused() -> None:
    plan = StepPlan(
        release=("a", "b"), release_tokens=((1, 2), ()),
        new_rows=(NewRow(request_id="x", row_id=3, prompt=tuple(range(2000, 4000)),
                         params=SamplingParams(temperature=0.7, seed=5, stop=("\n\n",),
                                               top_logprobs=2),
                         reuse="k1", cached=12,
                         response_format=ResponseFormat(kind="regex", grammar="{}"),
                         speculative=SpecChoice(method="lookup"), group=2),),
        prefill=(PrefillChunk(request_id="x", start=12, end=899, group=2, columns=887),),
        join=("x",), decode=("x",), snapshot=(("a", "k2"),), prompt_snapshot=(("x", "k3"),),
        persist=True, spill=("k4",), drop=("k5",))
    data = encode("execute", (plan,))
    assert len(data) > BLOCK  # a long prompt: the broadcast's second all_sum carries it
    assert decode(data) == ("execute", (plan,))
    assert decode(encode("retain", (("k1", "k2"),))) == ("retain", (("k1", "k2"),))
    for foreign in (os.system, Path("/")):
        with pytest.raises(pickle.UnpicklingError, match="a plan may not carry"):
            decode(pickle.dumps(("execute", (foreign,))))


def test_shard_check_names_what_does_not_divide(draft_model: Any) -> None:
    check_shardable(draft_model.model, 1)
    with pytest.raises(ValueError, match=r"layer 0: 2 attention heads do not divide by 3"):
        check_shardable(draft_model.model, 3)
    with pytest.raises(ValueError, match=r"layer 0: 1 KV heads do not divide by 2 ranks"):
        check_shardable(draft_model.model, 2)
    with pytest.raises(ValueError, match="has no shard"):
        check_shardable(object(), 2)


def test_refusals_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    Config(distributed=True, cache_dir="/tmp/x")  # each rank keeps its own shard files
    with pytest.raises(ValueError, match="--speculative is not supported with --distributed"):
        Config(distributed=True, speculative="lookup")
    with pytest.raises(ValueError, match="needs 2 or more processes started by mlx.launch"):
        init_group()
    assert main(["serve", "--distributed", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tqserve: error: --distributed needs 2 or more processes"), err
    assert "Traceback" not in err


def test_recovery_indexes_only_the_keys_every_rank_holds() -> None:
    assert agreed({"a", "b", "c"}, [{"a", "b"}, {"b", "c", "d"}]) == {"b"}
    assert agreed({"a"}, []) == {"a"}
    assert agreed(set(), [{"a"}]) == set()


BROADCAST = """
from tqserve.engine.distributed import init_group
from tqserve.engine.plan_channel import PlanChannel
channel = PlanChannel(init_group())
sizes = [0, 1, {block} - 4, {block} - 3, 3 * {block} + 17]
for size in sizes:
    payload = bytes((i * 7 + size) % 251 for i in range(size))
    if channel.rank == 0:
        channel.send(payload)
    else:
        got = channel.receive()
        assert got == payload, (size, len(got))
replies = [(b"", b""), (b"", b"r1"), (b"r0", b""), (b"zero", bytes(range(256)) * 20)]
for mine in replies:  # every rank gets every rank's reply, empty ones included
    assert channel.gather(mine[channel.rank]) == list(mine), mine
print(f"rank {{channel.rank}} ok {{len(sizes)}}", flush=True)
"""


@pytest.mark.skipif(LAUNCH is None, reason="mlx.launch not found next to the interpreter "
                                          "or on PATH")
def test_plan_broadcast_over_two_ring_ranks() -> None:
    out = subprocess.run(
        [str(LAUNCH), "-n", "2", "--backend", "ring", "--", sys.executable, "-c",
         BROADCAST.format(block=BLOCK)], cwd=REPO, capture_output=True, text=True,
        timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert sorted(out.stdout.split("\n")[:2]) == ["rank 0 ok 5", "rank 1 ok 5"], (
        out.stdout, out.stderr)
    assert "Node with rank" not in out.stderr, out.stderr


WATCHED = """
import time
from tqserve.engine.distributed import Watchdog
dog = Watchdog(3, 0.5)
with dog.watch("a quick step"):
    time.sleep(0.1)
print("quick ok", flush=True)
with dog.watch("a stuck collective"):
    time.sleep(30)
print("not reached", flush=True)
"""


def test_the_watchdog_ends_a_stuck_rank_with_one_line() -> None:
    out = subprocess.run([sys.executable, "-c", WATCHED], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert out.stdout == "quick ok\n", out.stdout
    assert out.stderr == ("tqserve: error: tensor-parallel group failed: rank 3: a stuck "
                          "collective took over 0.5 s (a peer died or hangs; "
                          "--distributed-timeout)\n"), out.stderr


DIVERGED = """
import sys
from tqserve.engine.distributed import PING, Watchdog, init_group
from tqserve.engine.follower import follow
from tqserve.engine.plan_channel import PlanChannel, encode
from tqserve.engine.model import load_model
from tqserve.engine.runner import Runner
from tqserve.engine.scheduler import StepPlan
channel = PlanChannel(init_group())
if channel.rank == 0:  # rank 0 says it sampled token 7 for row "x"; rank 1 sampled nothing
    channel.send(encode(PING, ()))
    channel.send(encode("execute", (StepPlan(), ())))
    channel.send(encode("execute", (StepPlan(), (("x", (7,)),))))
    sys.exit(0)
runner = Runner(load_model(dtype="float32").model)
sys.exit(follow(runner, channel, Watchdog(channel.rank, 60.0)))
"""


@pytest.mark.skipif(LAUNCH is None, reason="mlx.launch not found next to the interpreter "
                                          "or on PATH")
def test_a_rank_that_sampled_other_tokens_ends_the_group() -> None:
    out = subprocess.run(
        [str(LAUNCH), "-n", "2", "--backend", "ring", "--", sys.executable, "-c", DIVERGED],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert ("tqserve: error: tensor-parallel group failed: rank 1: GroupFailure: diverged: "
            "rank 0 sampled (('x', (7,)),), this rank () in the previous step") in out.stderr, \
        out.stderr
    assert "Node with rank 1 exited with code 1" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
