"""The runner's speculation: proposers by method, each row's method, the verify step.

Lives on the runner thread, called by engine.runner when the engine was built with
speculation. How many tokens each row proposes in a step is not decided here: the plan
carries it (`StepPlan.propose`, from the speculation actor's books: actors.speculation);
a step where some row proposes runs as one verify step (rows that do not propose are fed
their one token), without the plain path's pipelining (a proposal depends on the tokens
just accepted). A row's choice: its request's `SpecChoice`, `False` (never), or `None`
(the server's default). A lookup row's proposal usually comes made, from the speculation
actor's index (`StepPlan.drafts`, taken when it answers the row's context as it is now);
its proposer runs here only where none fits (`num_proposals_made` counts those).

Paired snapshots (engine.speculative.state): a row whose proposer keeps state (draft, MTP)
has that proposer's `identity` as its state identity ("" for lookup and plain rows); the
runner asks for the row's state at a snapshot's boundary (`state_at`) and gives a row
built from a snapshot the snapshot's state (`restore_state`), refusing any mismatch.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import mlx.core as mx
import numpy as np

from tqserve.engine.sampling import RowSampler
from tqserve.engine.speculative.mtp import forward_with_hidden
from tqserve.engine.speculative.lookup import Draft
from tqserve.engine.speculative.policy import RequestChoice, SpecChoice, resolve_choice
from tqserve.engine.speculative.proposers import Proposer
from tqserve.engine.speculative.state import ProposerState, StateLayout
from tqserve.engine.speculative.verify import Verified, VerifyRow, verify_step

Plane = tuple[bytes, Sequence[int], str]  # an SSD plane's bytes, shape, dtype


@attrs.frozen(kw_only=True)
class SpecRow:
    """A batch row as the verify step sees it."""

    request_id: str
    context: Sequence[int]   # prompt + output so far; its last token is fed next
    sampler: RowSampler
    grammar: Any = None      # a RowGrammar: proposals are cut to what it accepts


class Speculator:
    """Proposers by method, each row's choice, one verify step per engine step."""

    def __init__(self, proposers: Mapping[str, Proposer],
                 default: SpecChoice | None = None) -> None:
        if default is not None and default.method not in proposers:
            raise ValueError(f"--speculative {default.method} has no proposer")
        self.proposers = dict(proposers)
        self.default = default
        self._choices: dict[str, SpecChoice | None] = {}
        self.num_drafts_taken = 0  # proposals made by the speculation actor, taken
        self.num_proposals_made = 0     # proposals made on this thread

    def resolve(self, choice: RequestChoice) -> SpecChoice | None:
        """A request's effective choice. ValueError naming the field if its method is not
        served here."""
        resolved = resolve_choice(choice, self.default)
        if resolved is not None and resolved.method not in self.proposers:
            raise ValueError(f"speculative.method {resolved.method!r} is not served here "
                             f"(available: {', '.join(sorted(self.proposers)) or 'none'})")
        return resolved

    def open_row(self, request_id: str, choice: RequestChoice) -> None:
        resolved = self.resolve(choice)
        self._choices[request_id] = resolved
        if resolved is not None:
            self.proposers[resolved.method].open_row(request_id)

    def close_row(self, request_id: str) -> None:
        choice = self._choices.pop(request_id, None)
        if choice is not None:
            self.proposers[choice.method].close_row(request_id)

    def choice(self, request_id: str) -> SpecChoice | None:
        """The row's effective choice (None: it never speculates, or it is unknown)."""
        return self._choices.get(request_id)

    def wants_hidden(self, request_id: str) -> bool:
        """Whether the row's proposer needs the target's hidden states (MTP)."""
        choice = self.choice(request_id)
        return choice is not None and getattr(self.proposers[choice.method], "wants_hidden",
                                              False)

    def state_identity(self, request_id: str) -> str:
        """What the row's proposer state depends on ("" when it keeps none to pair)."""
        choice = self.choice(request_id)
        return "" if choice is None else getattr(self.proposers[choice.method], "identity", "")

    def state_layouts(self) -> dict[str, StateLayout]:
        """Per method whose rows publish paired snapshots: its planes (probed once)."""
        layouts = {}
        for method, proposer in self.proposers.items():
            paired = getattr(proposer, "identity", "")
            probe = getattr(proposer, "state_layout", None) if paired else None
            layout = probe() if probe is not None else None
            if layout is not None:
                layouts[method] = layout
        return layouts

    def state_at(self, request_id: str, tokens: Sequence[int]) -> ProposerState | None:
        """The row's proposer state for exactly `tokens`, or None if it has none that is."""
        choice = self.choice(request_id)
        if choice is None or not self.state_identity(request_id):
            return None
        return self.proposers[choice.method].state_at(request_id, tokens)  # type: ignore

    def restore_state(self, request_id: str, state: ProposerState | None,
                      tokens: Sequence[int]) -> None:
        """A row built from a snapshot reusing `tokens`: its proposer starts from the
        snapshot's state (None: a state-free snapshot, for a row that keeps none).
        RuntimeError if the snapshot's state is not the row's proposer's (a namespace bug:
        a row is never half-restored)."""
        identity = self.state_identity(request_id)
        if (state.identity if state is not None else "") != identity:
            raise RuntimeError(f"{request_id}: a snapshot with state "
                               f"{state.identity if state else 'none'!r} for a row of "
                               f"{identity or 'none'!r}")
        choice = self.choice(request_id)
        if state is not None and choice is not None:
            self.proposers[choice.method].restore(  # type: ignore
                request_id, state.cut(len(tokens)), tokens)

    def paired_planes(self, identity: str, offset: int, planes: Mapping[str, Plane]
                      ) -> tuple[StateLayout, dict[str, Plane], dict[str, Plane]]:
        """A paired file's planes split: the layout of its proposer state, the state's
        planes (checked against that layout, nothing decoded) and the rest (the target's).
        ValueError if no proposer here has state `identity` or the planes do not fit it."""
        layout = next((lay for lay in self.state_layouts().values()
                       if lay.identity == identity), None)
        if layout is None:
            raise ValueError(f"no proposer here holds state {identity!r:.80}")
        own, rest = layout.split(list(planes))
        layout.check(offset=offset, planes={name: planes[name][1:] for name in own})
        return (layout, {name: planes[name] for name in own},
                {name: planes[name] for name in rest})

    def prefill(self, model: Any, request_id: str, tokens: mx.array,
                cache: list[Any]) -> mx.array:
        """A prefill chunk of the row's own cache; hands the hidden states to its MTP head.
        Returns the chunk's logits (lazy)."""
        if not self.wants_hidden(request_id):
            return model(tokens, cache=cache)
        logits, hidden = forward_with_hidden(model, tokens, cache)
        self.record_hidden(request_id, hidden)
        return logits

    def record_hidden(self, request_id: str, hidden: mx.array) -> None:
        choice = self.choice(request_id)
        if choice is not None:
            self.proposers[choice.method].record_hidden(request_id, hidden)  # type: ignore

    def any_active(self, request_ids: Sequence[str]) -> bool:
        """Whether any of these rows speculates at all (else the plain path runs)."""
        return any(self.choice(rid) is not None for rid in request_ids)

    def close_all(self, request_ids: Sequence[str]) -> None:
        for rid in list(request_ids):
            self.close_row(rid)

    def proposals(self, rows: Sequence[SpecRow], ks: Sequence[int],
                  drafts: Sequence[Draft] = ()
                  ) -> list[tuple[int, ...]]:
        """Every row's proposal this step, at most its k tokens (empty for k = 0): a draft
        made for the row's context as it is now, else its proposer's."""
        made = {rid: (at, tokens) for rid, at, tokens in drafts}
        asks: dict[str, list[tuple[int, str, Sequence[int], int]]] = {}
        out: list[tuple[int, ...]] = [()] * len(rows)
        for i, (row, k) in enumerate(zip(rows, ks)):
            choice = self.choice(row.request_id)
            draft = made.get(row.request_id)
            if k > 0 and draft is not None and draft[0] == len(row.context):
                out[i] = tuple(draft[1][:k])
                self.num_drafts_taken += 1
            elif k > 0 and choice is not None:
                asks.setdefault(choice.method, []).append((i, row.request_id, row.context, k))
                self.num_proposals_made += 1
        for method, items in asks.items():
            got = self.proposers[method].propose([(rid, ctx, k) for _, rid, ctx, k in items])
            for (i, _, _, k), tokens in zip(items, got):
                out[i] = tuple(tokens[:k])
        return out

    def step(self, model: Any, cache: list[Any], rows: Sequence[SpecRow],
             last_tokens: Sequence[int], masks: np.ndarray | None,
             ks: Sequence[int], drafts: Sequence[Draft] = ()
             ) -> list[Verified]:
        """Propose (row i at most ks[i] tokens; `drafts`: made elsewhere), verify in one
        forward, roll back; each result says how many of its row's proposals the target
        kept."""
        proposals = self.proposals(rows, ks, drafts)
        position_masks: list[list[np.ndarray]] = [[] for _ in rows]
        for i, row in enumerate(rows):
            if row.grammar is not None and proposals[i]:
                num, position_masks[i] = row.grammar.check_proposal(proposals[i])
                proposals[i] = proposals[i][:num]
        verify_rows = [VerifyRow(last_token=t, proposal=p, sampler=r.sampler,
                                 masks=tuple(m))
                       for r, t, p, m in zip(rows, last_tokens, proposals, position_masks)]
        hidden_rows = [self.wants_hidden(r.request_id) for r in rows]
        forward = None
        if any(hidden_rows):
            def forward(inputs: mx.array, c: list[Any]) -> tuple[mx.array, mx.array]:
                return forward_with_hidden(model, inputs, c)
        results, hidden = verify_step(model, cache, verify_rows, masks, forward)
        for i, (row, res) in enumerate(zip(rows, results)):
            if hidden_rows[i] and hidden is not None:
                self.record_hidden(row.request_id, hidden[i:i + 1, :len(res.tokens)])
        return results
