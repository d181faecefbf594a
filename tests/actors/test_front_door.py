"""The front door: `from tqserve import ...` embeds the engine; `import tqserve` stays light."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parents[2]
NAMES = ("open_engine", "Engine", "Config", "GenerateRequest", "SamplingParams", "load_model",
         "serve", "ServerConfig", "Queued", "Token", "Done", "Error")


def test_import_tqserve_and_the_client_load_no_mlx():
    code = ("import sys, tqserve, tqserve.client\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('mlx', 'mlx_lm', 'tqserve.engine')))\n"
            "print(sorted(set(tqserve.__all__) - set(dir(tqserve))))\n"
            "tqserve.Config\n"
            "print('mlx' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "[]", "True"]  # lazy, listed, then loaded


def test_all_lists_the_front_door_and_unknown_names_fail():
    import pytest

    import tqserve

    assert set(tqserve.__all__) == {*NAMES, "__version__"}
    assert set(NAMES) <= set(dir(tqserve))
    with pytest.raises(AttributeError, match="no attribute 'Enjin'"):
        tqserve.Enjin  # noqa: B018


def test_the_front_door_names_are_the_internal_ones():
    import tqserve
    from tqserve.actors.engine import open_engine
    from tqserve.actors.facade import Engine
    from tqserve.actors.messages import Done, Error, Queued, Token
    from tqserve.api.config import ServerConfig
    from tqserve.api.server import serve
    from tqserve.engine.config import Config
    from tqserve.engine.model import load_model
    from tqserve.engine.request import GenerateRequest
    from tqserve.engine.sampling import SamplingParams

    internal = (open_engine, Engine, Config, GenerateRequest, SamplingParams, load_model,
                serve, ServerConfig, Queued, Token, Done, Error)
    assert all(getattr(tqserve, n) is obj for n, obj in zip(NAMES, internal, strict=True))


async def _greedy(api, loaded) -> tuple[list[int], str]:
    """One short greedy generate through `api` (a module-like namespace of the names)."""
    request = api.GenerateRequest(prompt="def add(a, b):",
                                  params=api.SamplingParams(max_tokens=12, temperature=0.0))
    async with api.open_engine(api.Config(), loaded=loaded) as engine:
        assert isinstance(engine, api.Engine)
        events = [event async for event in engine.generate(request)]
    assert isinstance(events[0], api.Queued) and isinstance(events[-1], api.Done)
    assert not any(isinstance(e, api.Error) for e in events)
    return [e.token_id for e in events if isinstance(e, api.Token)], events[-1].finish_reason


async def test_embedding_through_the_front_door_gives_the_internal_tokens(draft_model):
    import types

    import tqserve
    from tqserve.actors.engine import open_engine
    from tqserve.actors.facade import Engine
    from tqserve.actors.messages import Done, Error, Queued, Token
    from tqserve.engine.config import Config
    from tqserve.engine.request import GenerateRequest
    from tqserve.engine.sampling import SamplingParams

    internal = types.SimpleNamespace(
        open_engine=open_engine, Engine=Engine, Config=Config, GenerateRequest=GenerateRequest,
        SamplingParams=SamplingParams, Queued=Queued, Token=Token, Done=Done, Error=Error)
    with trio.fail_after(120):  # a hang guard
        front = await _greedy(tqserve, tqserve.load_model(dtype="float32"))
        reference = await _greedy(internal, draft_model)
    assert front == reference and len(front[0]) == 12 and front[1] == "length"
