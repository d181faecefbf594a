"""tqserve: an async actor LLM serving engine on MLX.

The front door: everything an embedding program needs, from one import, e.g.
`from tqserve import open_engine, Config, GenerateRequest, SamplingParams, Token, Done`
(docs/embedding.md); `serve` and its `ServerConfig` (which holds a Config) run the server.
The names load lazily (PEP 562): `import tqserve` and `import tqserve.client` import no
MLX; the first use of an engine name does.

The installed distribution puts every part under this one namespace: `tqserve.engine`,
`tqserve.actors`, `tqserve.api`, `tqserve.storage`, `tqserve.tools`, and the bundled model
as package data (`tqserve/models/`). The repository keeps the parts as top-level folders;
pyproject.toml maps each onto its place here (an editable install does the same).
`tqserve.client` is the Python client of the WebSocket protocol; it needs no MLX.
"""

import importlib as _importlib
from typing import TYPE_CHECKING, Any

from tqserve.fdlimit import guard as _guard_descriptor_limit

__version__ = "0.1.0"

_guard_descriptor_limit()  # before anything imports mlx_lm.utils (tqserve/fdlimit.py)

_FRONT_DOOR = {  # public name -> the module that defines it
    "open_engine": "tqserve.actors.engine",
    "Engine": "tqserve.actors.facade",
    "Config": "tqserve.engine.config",
    "GenerateRequest": "tqserve.engine.request",
    "SamplingParams": "tqserve.engine.sampling",
    "load_model": "tqserve.engine.model",
    "serve": "tqserve.api.server",
    "ServerConfig": "tqserve.api.config",
    "Queued": "tqserve.actors.messages",
    "Token": "tqserve.actors.messages",
    "Done": "tqserve.actors.messages",
    "Error": "tqserve.actors.messages",
}

__all__ = ["Config", "Done", "Engine", "Error", "GenerateRequest", "Queued", "SamplingParams",
           "ServerConfig", "Token", "__version__", "load_model", "open_engine",
           "serve"]  # = _FRONT_DOOR

if TYPE_CHECKING:
    from tqserve.actors.engine import open_engine
    from tqserve.actors.facade import Engine
    from tqserve.actors.messages import Done, Error, Queued, Token
    from tqserve.api.config import ServerConfig
    from tqserve.api.server import serve
    from tqserve.engine.config import Config
    from tqserve.engine.model import load_model
    from tqserve.engine.request import GenerateRequest
    from tqserve.engine.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    """Import a front-door name's module on first use and keep the name here."""
    module = _FRONT_DOOR.get(name)
    if module is None:
        raise AttributeError(f"module 'tqserve' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_FRONT_DOOR})
