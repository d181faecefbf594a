"""The MTP proposer: pycoder-29m's multi-token-prediction head (../shared/models README).

For position t, with h_t the target's last-layer output BEFORE its final norm and x_{t+1}
the token at t+1:  u_t = eh_proj([hnorm(h_t); enorm(embed(x_{t+1}))]),  m_t = block(u_t)
(one decoder layer with its own KV cache, RoPE position t), and the target's final norm
and tied head on m_t predict x_{t+2}. Depth d > 1 feeds m_t back as h with the token just
predicted (recursive MTP2..MTP4).

The hidden state without forking mlx-lm's model: `forward_with_hidden` runs the target's
own modules (`model.model.embed_tokens`, each of `model.model.layers` with the cache and
the mask mlx-lm would make, then `model.model.norm` and the tied head), i.e. the body of
mlx-lm's Qwen3Model.__call__, returning the pre-norm hidden state next to the logits. It
needs that module layout (embed_tokens / layers / norm), which `load_mtp_head` checks.

Per row the proposer keeps the head's KV cache over the true pairs (h_j, x_{j+1}) seen so
far, plus the hidden states the target produced since (`record_hidden`: every prefill
chunk and the kept positions of every verify step). `propose` first drops the speculative
(depth > 1) entries of the last proposal, feeds the pending true pairs in one block, then
runs the recursion. A row started from a paired prefix-cache snapshot gets the head's KV
and the pending hidden states of the reused positions back (`state_at` / `restore`,
engine.speculative.state), so it proposes exactly as the row that published it would; its
identity is "mtp:<head fingerprint>" (the head file and the dtype).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Sequence, cast

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import ModelArgs, TransformerBlock

from tqserve.engine.arrays import item_int
from tqserve.engine.speculative.state import ProposerState, StateLayout

MTP_FILE = "mtp.safetensors"
MAX_PENDING = 512   # hidden-state records a row holds before it folds them (record_hidden)
KEEP_PENDING = 256  # positions it keeps then


def forward_with_hidden(model: Any, inputs: mx.array, cache: list[Any]) -> tuple[mx.array,
                                                                                 mx.array]:
    """(logits, pre-norm last hidden state) of the target for `inputs` (B, L); the same
    computation as `model(inputs, cache=cache)` (see the module doc)."""
    inner = model.model
    h = inner.embed_tokens(inputs)
    mask = create_attention_mask(h, cache[0])
    for layer, c in zip(inner.layers, cache):
        h = layer(h, mask, c)
    return _head(model, inner.norm(h)), h


def _head(model: Any, normed: mx.array) -> mx.array:
    if getattr(model.args, "tie_word_embeddings", True):
        return model.model.embed_tokens.as_linear(normed)
    return model.lm_head(normed)


class MtpHead(nn.Module):
    """hnorm, enorm, eh_proj and one decoder block (the file's `mtp.*` weights)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.hnorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.enorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.block = TransformerBlock(args)

    def __call__(self, hidden: mx.array, embedded: mx.array, cache: KVCache) -> mx.array:
        u = self.eh_proj(mx.concatenate([self.hnorm(hidden), self.enorm(embedded)], axis=-1))
        return self.block(u, create_attention_mask(u, cache), cache)


def load_mtp_head(path: Path | str, model: Any) -> MtpHead:
    """The MTP head stored next to the target (`mtp.safetensors`), in the target's dtype.
    ValueError naming the file or the missing piece."""
    file = Path(path) / MTP_FILE
    if not file.is_file():
        raise ValueError(f"--speculative mtp: the model has no MTP head ({file.name} not found "
                         "in its directory)")
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, n) for n in ("embed_tokens", "layers", "norm")):
        raise ValueError("--speculative mtp needs a model with model.embed_tokens, "
                         "model.layers and model.norm (qwen3 layout)")
    args = ModelArgs.from_dict(model.args.__dict__) if not isinstance(
        model.args, ModelArgs) else model.args
    head = MtpHead(args)
    dtype = inner.embed_tokens.weight.dtype
    # a .safetensors file loads as a dict of arrays (mx.load's union covers .npy and gguf)
    loaded = cast(dict[str, mx.array], mx.load(str(file)))
    weights = {k.removeprefix("mtp."): v.astype(dtype) for k, v in loaded.items()
               if k != "mtp.norm.weight"}
    head.load_weights(list(weights.items()))
    mx.eval(head.parameters())
    return head


def head_fingerprint(path: Path | str, dtype: str) -> str:
    """What an MTP row's state depends on besides the target: the head file and dtype."""
    digest = hashlib.sha256((Path(path) / MTP_FILE).read_bytes())
    digest.update(dtype.encode())
    return digest.hexdigest()[:32]


@attrs.define
class _MtpRow:
    cache: KVCache
    num_speculative: int = 0                 # depth > 1 entries of the last proposal
    pending: list[mx.array] = attrs.Factory(list)  # (1, P, D) hidden states not yet fed
    restarted: bool = False  # folded (record_hidden): the cache no longer starts at 0

    @property
    def num_pending(self) -> int:
        return sum(h.shape[1] for h in self.pending)


class MtpProposer:
    """Proposals from the target's MTP head, depth = the row's k (recursive)."""

    wants_hidden = True

    def __init__(self, model: Any, head: MtpHead, identity: str = "") -> None:
        self.model = model
        self.head = head
        self.identity = identity
        self._rows: dict[str, _MtpRow] = {}
        self._layout: StateLayout | None = None

    def open_row(self, request_id: str) -> None:
        self._rows[request_id] = _MtpRow(cache=KVCache())

    def close_row(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def record_hidden(self, request_id: str, hidden: mx.array) -> None:
        """Pre-norm hidden states (1, P, D) of the row's next P positions.

        A row that has not proposed for MAX_PENDING records (the time policy kept its
        batch plain) keeps only the latest KEEP_PENDING positions, in one array, and its
        head cache starts over from them: memory stays bounded, proposals are then made
        from a shorter history (weaker, never wrong: verification is exact)."""
        row = self._rows.get(request_id)
        if row is None or not hidden.shape[1]:
            return
        row.pending.append(hidden)
        if len(row.pending) > MAX_PENDING:
            kept = mx.concatenate(row.pending, axis=1)[:, -KEEP_PENDING:]
            mx.eval(kept)
            row.pending = [kept]
            row.cache, row.num_speculative, row.restarted = KVCache(), 0, True

    def _embed(self, tokens: mx.array) -> mx.array:
        return self.model.model.embed_tokens(tokens)

    def _predict(self, m: mx.array) -> mx.array:
        return mx.argmax(_head(self.model, self.model.model.norm(m[:, -1:, :])), axis=-1)

    def propose(self, rows: Sequence[tuple[str, Sequence[int], int]]) -> list[tuple[int, ...]]:
        drafts: list[list[mx.array]] = []
        for rid, context, k in rows:
            row = self._rows[rid]
            if row.num_speculative:
                row.cache.trim(row.num_speculative)
                row.num_speculative = 0
            num = row.num_pending
            if k <= 0 or num == 0 or num >= len(context):
                drafts.append([])
                continue
            hidden = mx.concatenate(row.pending, axis=1) if len(row.pending) > 1 else row.pending[0]
            row.pending = []
            tokens = mx.array(list(context[len(context) - num:]))[None]
            m = self.head(hidden, self._embed(tokens), row.cache)
            toks = [self._predict(m)]
            for _ in range(k - 1):
                m = self.head(m[:, -1:, :], self._embed(toks[-1]), row.cache)
                row.num_speculative += 1
                toks.append(self._predict(m))
            drafts.append(toks)
        flat = [t for d in drafts for t in d]
        if flat:
            mx.eval(flat)
        return [tuple(item_int(t) for t in d) for d in drafts]

    def state_layout(self) -> StateLayout | None:
        """The planes of this head's state (probed once: one position through the head)."""
        if self._layout is None and self.identity:
            dtype = self.model.model.embed_tokens.weight.dtype
            probe = mx.zeros((1, 1, self.model.args.hidden_size), dtype=dtype)
            cache = KVCache()
            self.head(probe, probe, cache)
            self._layout = StateLayout.probe(self.identity, "mtp",
                                             [(cache.keys[..., :1, :], cache.values[..., :1, :])],
                                             probe)
        return self._layout

    def state_at(self, request_id: str, tokens: Sequence[int]) -> ProposerState | None:
        """The row's head KV over its true pairs and its pending hidden states, when they
        describe exactly `tokens` (the target's KV positions); None otherwise (a restarted
        head, or a pair whose token lies past the boundary)."""
        row = self._rows.get(request_id)
        layout = self.state_layout()
        if row is None or row.restarted or layout is None:
            return None
        fed = row.cache.offset - row.num_speculative
        if not row.num_pending or fed + row.num_pending != len(tokens):
            return None
        hidden = mx.concatenate(row.pending, axis=1) if len(row.pending) > 1 else row.pending[0]
        row.pending = [hidden]
        if fed:
            keys, values = row.cache.keys[..., :fed, :], row.cache.values[..., :fed, :]
        else:
            (pattern, dtype), = layout.layers
            keys = values = mx.zeros((*pattern[:2], 0, *pattern[2:]), dtype=getattr(mx, dtype))
        mx.eval(keys, values, hidden)
        return ProposerState(identity=self.identity, prefix="mtp", layers=((keys, values),),
                             hidden=hidden, offset=len(tokens))

    def restore(self, request_id: str, state: ProposerState, tokens: Sequence[int]) -> None:
        """Start an open row's head from `state` (cut to `tokens`' length already)."""
        row = self._rows[request_id]
        cache = KVCache()
        ((keys, values),) = state.layers
        if keys.shape[2]:
            cache.keys, cache.values, cache.offset = keys, values, int(keys.shape[2])
        row.cache, row.num_speculative, row.restarted = cache, 0, False
        row.pending = [state.hidden] if state.hidden is not None else []
