"""The actor graph drawn in actors/engine.py's docstring is the graph open_engine builds:
the same mailboxes, only the drawn messages cross each, and no cycle but the reply edges."""

import re

import trio
import trio.testing

from tqserve.actors import engine as engine_module
from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Token, decode
from tqserve.engine.config import Config
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams

EDGE = re.compile(r"^    (\w+) -> (\w+): ([\w ]+?)( \(reply edge\))?$")
# the mailboxes read by another actor's task
OWNER = {"admission_replies": "admission", "speculation_replies": "scheduler",
         "spill_replies": "scheduler"}
SPECULATION = {"speculation", "speculation_replies"}  # only with speculation
SPILL = {"spill", "spill_replies"}  # only with a cache dir


def drawn_edges():
    edges = [EDGE.match(line) for line in engine_module.__doc__.splitlines()]
    return [(m[1], m[2], set(m[3].split()), bool(m[4])) for m in edges if m]


def test_the_drawn_graph_is_a_dag_plus_reply_edges():
    edges = drawn_edges()
    assert len(edges) == 11
    graph: dict[str, set[str]] = {}
    for sender, mailbox, _, reply in edges:
        if not reply:
            graph.setdefault(sender, set()).add(OWNER.get(mailbox, mailbox))
    done: set[str] = set()

    def visit(node, path):
        assert node not in path, f"cycle through {path + [node]}"
        if node not in done:
            for nxt in graph.get(node, ()):
                visit(nxt, path + [node])
            done.add(node)

    for node in list(graph):
        visit(node, [])
    replies = [(s, OWNER.get(m, m)) for s, m, _, reply in edges if reply]
    assert replies == [("scheduler", "admission"), ("hub", "scheduler"),
                       ("speculation", "scheduler"), ("spill", "scheduler")]


async def test_open_engine_creates_the_drawn_mailboxes_and_only_drawn_messages_cross(
        draft_model):
    seen: list[tuple[str, str]] = []
    raw: list[tuple[str, bytes]] = []
    params = dict(temperature=0.0, max_tokens=30)

    def record(name: str, data: bytes) -> None:
        seen.append((name, type(decode(data)).__name__))
        raw.append((name, data))

    async with open_engine(Config(), loaded=draft_model, recorder=record) as engine:
        plain = [e async for e in engine.generate(GenerateRequest(
            prompt="def f(x):\n", params=SamplingParams(**params)))]
        text = "".join(e.text for e in plain if isinstance(e, Token))
        stop = text[len(text) // 3:len(text) // 3 + 2]  # met mid-stream: the hub cancels
        stopped = [e async for e in engine.generate(GenerateRequest(
            prompt="def f(x):\n", params=SamplingParams(**params, stop=[stop])))]
        assert stopped[-1].finish_reason == "stop"
        async for event in engine.generate(GenerateRequest(  # the caller cancels
                prompt="def g(y):\n", params=SamplingParams(**params))):
            if isinstance(event, Token):
                break
        await engine.wait_idle()
        mailboxes = engine.mailboxes
    edges = [e for e in drawn_edges() if e[1] not in SPECULATION | SPILL]
    assert set(mailboxes) == {mailbox for _, mailbox, _, _ in edges}
    assert all(size >= 1 for size in mailboxes.values())
    allowed = {}
    for _, mailbox, messages, _ in edges:
        allowed.setdefault(mailbox, set()).update(messages)
    crossed = set(seen)
    assert all(kind in allowed[name] for name, kind in crossed), crossed
    for sender, mailbox, messages, _ in edges:  # every drawn edge carried something
        assert {kind for name, kind in crossed if name == mailbox} & messages, (sender, mailbox)
    assert ("hub", "StepTokens") in crossed and ("hub", "Token") not in crossed
    # admission forwards a Submit as it came: encoded once, the same bytes on both edges
    submits = {name: data for name, data in raw if type(decode(data)).__name__ == "Submit"}
    assert submits["admission"] is submits["scheduler"]
    assert seen.count(("admission", "Cancel")) == 1  # the caller's
    assert seen.count(("scheduler", "Cancel")) == 2  # the caller's, forwarded, and the hub's


async def test_with_speculation_the_speculation_edges_carry_steps_and_decisions(draft_model):
    seen: list[tuple[str, str]] = []
    config = Config(max_batch=2, speculative="lookup", speculative_time_policy=False)
    async with open_engine(config, loaded=draft_model,
                           recorder=lambda name, data: seen.append(
                               (name, type(decode(data)).__name__))) as engine:
        async with trio.open_nursery() as nursery:
            for prompt in ("def f(x):\n    return x\n\ndef f(", "import os\nimport "):
                nursery.start_soon(_drain, engine, prompt)
        await engine.wait_idle()
        await trio.testing.wait_all_tasks_blocked()  # the speculation actor read the last step
        mailboxes = engine.mailboxes
        stats = engine.statistics().speculative
    edges = [e for e in drawn_edges() if e[1] not in SPILL]
    assert set(mailboxes) == {mailbox for _, mailbox, _, _ in edges}
    allowed = {}
    for _, mailbox, messages, _ in edges:
        allowed.setdefault(mailbox, set()).update(messages)
    assert all(kind in allowed[name] for name, kind in set(seen)), set(seen)
    steps = seen.count(("speculation", "SpecStep"))
    # one SpecStep per engine step, one decision per SpecStep (but the last, which the
    # shutdown may cancel before it is answered)
    assert steps >= 10
    assert seen.count(("speculation_replies", "SpecDecision")) in (steps - 1, steps)
    assert stats.num_rows == 0  # every row's books were released when it ended
    assert stats.num_proposed > 0


async def _drain(engine, prompt):
    async for _ in engine.generate(GenerateRequest(
            prompt=prompt, params=SamplingParams(temperature=0.0, max_tokens=24))):
        pass


async def test_with_a_cache_dir_the_spill_edges_carry_every_file_operation(draft_model,
                                                                        tmp_path):
    """Writes, loads and removals reach the SSD tier only as orders in the spill actor's
    mailbox, and its answers come back on its reply edge: a request's snapshots are
    written (SpillWrite -> SpillWritten), a superseded prompt file is removed
    (SpillRemove), and after a restart with a 1-byte RAM tier a repeat is an SSD hit
    (SpillLoad -> SpillLoaded)."""
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    seen: list[tuple[str, str]] = []
    config = Config(cache_dir=str(tmp_path), ssd_flush="sync", ram_cache_bytes=1)
    for _ in range(2):
        async with open_engine(config, loaded=draft_model,
                               recorder=lambda name, data: seen.append(
                                   (name, type(decode(data)).__name__))) as engine:
            events = [e async for e in engine.generate(GenerateRequest(
                prompt=prompt, params=SamplingParams(temperature=0.0, max_tokens=8)))]
            await engine.wait_idle()
            mailboxes = engine.mailboxes
    assert events[-1].cached_tier == "ssd", events[-1]
    edges = drawn_edges()
    assert set(mailboxes) == {mailbox for _, mailbox, _, _ in edges} - SPECULATION
    allowed = {}
    for _, mailbox, messages, _ in edges:
        allowed.setdefault(mailbox, set()).update(messages)
    assert all(kind in allowed[name] for name, kind in set(seen)), set(seen)
    for message in ("SpillWrite", "SpillLoad", "SpillRemove"):
        assert ("spill", message) in seen, message
    assert seen.count(("spill_replies", "SpillWritten")) == seen.count(("spill", "SpillWrite"))
    assert seen.count(("spill_replies", "SpillLoaded")) == seen.count(("spill", "SpillLoad"))
