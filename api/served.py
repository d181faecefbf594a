"""The names the server answers to (`--served-model-name`) and the `model` field's check.

Without --served-model-name the model directory's name is served and any `model` value is
accepted (one model is served); with it, a `model` naming none of them is a 404
`model_not_found` naming those served, as OpenAI and vLLM answer. Answers carry the first
name.
"""

from __future__ import annotations

from tqserve.actors.facade import Engine
from tqserve.api.httpcommon import ApiError


class ServedNames:
    def __init__(self, engine: Engine, served_model_name: tuple[str, ...]) -> None:
        self.names = served_model_name or (engine.model.path.name,)
        self.checked = bool(served_model_name)

    @property
    def primary(self) -> str:
        return self.names[0]

    def check(self, model: object) -> None:
        """ApiError 404 when --served-model-name is set and `model` is none of them."""
        if self.checked and model is not None and model not in self.names:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves "
                                f"{', '.join(self.names)}", "model", "model_not_found")


def model_card(name: str, max_model_len: int) -> dict[str, object]:
    """One entry of GET /v1/models (and GET /v1/models/{id}); `max_model_len` is vLLM's
    name for the context (prompt + output tokens)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "tqserve",
            "max_model_len": max_model_len}
