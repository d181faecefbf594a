"""tqserve: an async actor LLM serving engine on MLX.

The installed distribution puts every part under this one namespace: `tqserve.engine`,
`tqserve.actors`, `tqserve.api`, `tqserve.storage`, `tqserve.tools`, and the bundled model
as package data (`tqserve/models/`). The repository keeps the parts as top-level folders;
pyproject.toml maps each onto its place here (an editable install does the same).
`tqserve.client` is the Python client of the WebSocket protocol; it needs no MLX.
"""

__version__ = "0.1.0"
