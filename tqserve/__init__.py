"""tqserve: an async actor LLM serving engine on MLX.

`tqserve.client` is the Python client of the WebSocket protocol; it needs no MLX.
"""

__version__ = "0.1.0"
