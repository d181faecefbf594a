"""The decode fast path: fused projection weights and compiled decode layers (issue 9).

On MLX's CUDA backend a decode step is host-bound: every op the model builds costs graph
building in Python and a kernel node in MLX's CUDA graphs, whatever its size. Two
changes cut that, both exact reorganisations of the model's own arithmetic:

* `fuse_projections(model)` concatenates each layer's q/k/v weights (and gate/up
  weights) into one matrix, so a step runs one matmul where it ran three (two). The
  model's own attention and MLP code is untouched: `q_proj`, `k_proj` and `v_proj`
  become views of one `_FusedLinear` that computes the concatenated product once per
  input and hands each caller its slice. Only plain `nn.Linear` layers fuse (quantized or
  tensor-parallel shards keep their own). `copy=True` leaves the given model as it was and
  returns a model that shares every other parameter (benchmarks compare both in one
  process).
* `DecodeForward(model)` runs a forward of one new position per row with each layer's
  work around the attention (norms, projections, RoPE, output projection, MLP) traced
  once per batch size by `mx.compile`; the cache write, the mask and the attention run op
  by op through the model's own attention function (so TurboQuant and affine caches keep
  their dispatch). Qwen3-style layers only (q/k norms, `DecodeForward.supports`).

Both are bit-equal to the model's own forward on the CPU backend (float32) and, for the
compiled layers, on CUDA; a fused matmul on CUDA may round differently in bf16 (tested up
to proven near-ties: tests/unit/test_fastpath.py, the GPU bench's equality check).
"""

from __future__ import annotations

import copy as _copy
import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from tqserve.engine.model import auto_on_gpu


def wanted(setting: str, distributed: bool = False) -> bool:
    """Whether --fast-decode `setting` (auto | on | off) applies: auto on a GPU only, and
    never on a tensor-parallel rank (its projections are shards)."""
    return not distributed and auto_on_gpu(setting)


class _FusedLinear(nn.Module):
    """One matmul for several Linear layers that read the same input."""

    def __init__(self, parts: list[nn.Linear]) -> None:
        super().__init__()
        self.weight = mx.concatenate([p.weight for p in parts], axis=0)
        if all("bias" in p for p in parts):
            self.bias = mx.concatenate([p.bias for p in parts], axis=0)
        bounds, start = [], 0
        for p in parts:
            bounds.append((start, start + p.weight.shape[0]))
            start += p.weight.shape[0]
        # plain attributes (object.__setattr__): not parameters of the module
        object.__setattr__(self, "_bounds", tuple(bounds))
        object.__setattr__(self, "_last", None)

    def part(self, index: int, x: mx.array) -> mx.array:
        last = self._last
        if last is None or last[0] is not x:
            out = x @ self.weight.T
            if "bias" in self:
                out = out + self.bias
            last = (x, out)
            object.__setattr__(self, "_last", last)
        lo, hi = self._bounds[index]
        if index == len(self._bounds) - 1:  # the last part read it: hold no arrays
            object.__setattr__(self, "_last", None)
        return last[1][..., lo:hi]


class _Part:
    """Stands where one of the fused Linear layers was (`module.q_proj(x)` still works)."""

    def __init__(self, fused: _FusedLinear, index: int) -> None:
        self._fused = fused
        self._index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self._fused.part(self._index, x)

    @property
    def weight(self) -> mx.array:
        """This part's rows of the fused weight (what code reading `k_proj.weight.shape`
        for head dims sees: the original layer's shape)."""
        lo, hi = self._fused._bounds[self._index]
        return self._fused.weight[lo:hi]


def _fuse(module: nn.Module, names: tuple[str, ...], fused_name: str) -> bool:
    parts = [module.get(n) for n in names]
    if not all(type(p) is nn.Linear for p in parts):
        return False
    fused = _FusedLinear(parts)  # type: ignore[arg-type]
    mx.eval(fused.parameters())
    module[fused_name] = fused
    for i, name in enumerate(names):
        del module[name]
        object.__setattr__(module, name, _Part(fused, i))
    return True


def _layers_owner(model: Any) -> Any:
    """The module whose `layers` entry holds the decoder layers (mlx-lm: `model.model`)."""
    inner = model.get("model") if isinstance(model, dict) else None
    if isinstance(inner, nn.Module) and isinstance(inner.get("layers"), list):
        return inner
    if isinstance(model.get("layers"), list):
        return model
    return None


def fuse_projections(model: Any, *, copy: bool = False) -> tuple[Any, int]:
    """Fuse q/k/v and gate/up projections of every layer that has plain Linear ones.

    Returns (the model, how many modules were fused). With `copy` the given model is left
    as it was: the returned one is a new module tree sharing all unfused parameters."""
    owner = _layers_owner(model)
    if owner is None:
        return model, 0
    if copy:
        model = _copy.copy(model)
        if owner is not model:
            owner = _copy.copy(owner)
            model["model"] = owner
        owner["layers"] = [_copy.copy(layer) for layer in owner["layers"]]
    count = 0
    for layer in owner["layers"]:
        for name, parts, fused in (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                   ("mlp", ("gate_proj", "up_proj"), "gate_up_proj")):
            module = layer.get(name)
            if not isinstance(module, nn.Module):
                continue
            if copy:
                module = _copy.copy(module)
                layer[name] = module
            count += _fuse(module, parts, fused)
    return model, count


class DecodeForward:
    """A decode forward (one position per row) with compiled per-layer pieces."""

    def __init__(self, model: Any) -> None:
        if not self.supports(model):
            raise ValueError("compiled decode layers need Qwen3-style layers")
        self._model = model
        self._pre = [mx.compile(self._pre_fn(layer)) for layer in model.layers]
        self._post = [mx.compile(self._post_fn(layer)) for layer in model.layers]
        # each layer's module namespace: its attention function is looked up per call, so
        # a dispatch installed later (engine.attention.sdpa.install_attention) is seen
        self._namespaces = [vars(sys.modules[type(layer.self_attn).__module__])
                            for layer in model.layers]

    @staticmethod
    def supports(model: Any) -> bool:
        """Qwen3-style decoder layers (attention with q/k norms and a RoPE module)."""
        inner = getattr(model, "model", None)
        layers = getattr(model, "layers", None)
        if not layers or inner is None or not hasattr(inner, "embed_tokens"):
            return False
        return all(hasattr(getattr(layer, "self_attn", None), "q_norm")
                   and hasattr(layer.self_attn, "rope") and hasattr(layer, "mlp")
                   and hasattr(sys.modules[type(layer.self_attn).__module__],
                               "scaled_dot_product_attention")
                   for layer in layers)

    @staticmethod
    def _pre_fn(layer: Any) -> Any:
        attn = layer.self_attn

        def pre(x: mx.array, offset: mx.array) -> tuple[mx.array, mx.array, mx.array]:
            b, n, _ = x.shape
            h = layer.input_layernorm(x)
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            q = attn.q_norm(q.reshape(b, n, attn.n_heads, -1)).transpose(0, 2, 1, 3)
            k = attn.k_norm(k.reshape(b, n, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            v = v.reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v

        return pre

    @staticmethod
    def _post_fn(layer: Any) -> Any:
        attn = layer.self_attn

        def post(x: mx.array, o: mx.array) -> mx.array:
            b, n, _ = x.shape
            h = x + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))
            return h + layer.mlp(layer.post_attention_layernorm(h))

        return post

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        """Logits (B, 1, V) of `inputs` (B, 1), writing each row's new position."""
        model = self._model
        x = model.model.embed_tokens(inputs)
        offset = cache[0].offset
        if not isinstance(offset, mx.array):  # a Python int would be traced as a constant
            offset = mx.array(offset)
        mask = create_attention_mask(x, cache[0])
        for layer, pre, post, names, c in zip(model.layers, self._pre, self._post,
                                              self._namespaces, cache):
            q, k, v = pre(x, offset)
            k, v = c.update_and_fetch(k, v)
            attend = names["scaled_dot_product_attention"]
            x = post(x, attend(q, k, v, cache=c, scale=layer.self_attn.scale, mask=mask))
        x = model.model.norm(x)
        if getattr(model, "args", None) is not None and model.args.tie_word_embeddings:
            return model.model.embed_tokens.as_linear(x)
        return model.lm_head(x)
