"""KV events: what the prefix cache holds, as the fixed-size token blocks its entries cover.

Prefix-aware routers (Ray Serve's, llm-d, Dynamo) route a prompt to the replica whose
cache holds its longest prefix, and learn what each replica holds from its KV events.
The vocabulary is vLLM's (vllm/distributed/kv_events.py): BlockStored, BlockRemoved and
AllBlocksCleared, grouped in batches. tqserve's index (engine.prefix) holds whole-prompt
snapshots, not blocks; the events describe the WHOLE `block_tokens`-token blocks of every
indexed entry, in every tier and every namespace (a router cannot tell namespaces apart,
and a hit in any tier saves the prompt's prefill), so `medium` is always None.

Block hashes are chained: hash_0 = blake2b(b"tokens" + block_0), hash_i =
blake2b(hash_{i-1} + block_i), digest_size 8, each block packed as little-endian int64
(struct "<{n}q"), read as a big-endian unsigned int. A block's hash therefore names its
whole prefix, and a router computing `block_hashes(prompt)` gets the same numbers.

Books: a refcount per block hash over the entries that hold it; a block's first holder
stores it, its last leaving removes it. Changes inside one `batch()` (nested batches
commit at the outermost end) are netted: a block present before and after emits nothing
(a RAM entry replaced by its SSD twin), so every block appears in at most one event of a
batch. A batch with events gets the next `seq` (from 1) and a timestamp from the injected
`clock` (the log's only clock reading: the prefix cache passes time.time, tests a
counter); the last `capacity` batches stay readable through `since(seq)`, fewer when
their BlockStored events carry more than `max_tokens` token ids together (each event
keeps its run's ids: long prompts would otherwise hold many MB in the ring).

Sans-io: no files, no MLX, no I/O.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import attrs

BLOCK_TOKENS = 16      # tokens per block (vLLM's default block_size)
RING_BATCHES = 4096    # batches kept for readers; an older cursor learns it missed some
RING_TOKENS = 1 << 20  # token ids the kept batches' BlockStored events carry, at most
_SEED = b"tokens"      # the chain's seed (api.router.core's token keys use the same)
_DIGEST_BYTES = 8


def block_digests(tokens: Sequence[int], block_tokens: int = BLOCK_TOKENS
                  ) -> tuple[bytes, ...]:
    """The chained 8-byte digests of the whole `block_tokens`-id blocks of `tokens`."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    digests, prev = [], _SEED
    for i in range(len(tokens) // block_tokens):
        block = struct.pack(f"<{block_tokens}q", *tokens[i * block_tokens:(i + 1) * block_tokens])
        prev = hashlib.blake2b(prev + block, digest_size=_DIGEST_BYTES).digest()
        digests.append(prev)
    return tuple(digests)


def block_hashes(tokens: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """The chained hashes (unsigned 64-bit ints) of the whole blocks of `tokens`."""
    return tuple(int.from_bytes(d, "big") for d in block_digests(tokens, block_tokens))


@attrs.frozen(kw_only=True)
class BlockStored:
    """A run of blocks of one entry, in chain order, that no entry held before."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None  # the block before the run (None: the run starts it)
    token_ids: tuple[int, ...]     # the run's tokens, block_size per block
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@attrs.frozen(kw_only=True)
class BlockRemoved:
    """Blocks that no entry holds any more."""

    block_hashes: tuple[int, ...]
    medium: str | None = None


@attrs.frozen
class AllBlocksCleared:
    """Every block is gone (the log was cleared)."""


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def event_json(event: KvEvent) -> dict[str, Any]:
    """One event as JSON, tagged with its `type` (vLLM's class name)."""
    fields = {f.name: getattr(event, f.name) for f in attrs.fields(type(event))}
    return {"type": type(event).__name__,
            **{k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}}


@attrs.frozen(kw_only=True)
class KvEventBatch:
    seq: int
    ts: float
    events: tuple[KvEvent, ...]

    def as_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "ts": self.ts, "events": [event_json(e) for e in self.events]}


@attrs.frozen(kw_only=True)
class KvEventPage:
    """What `since(seq)` returns: the batches after `seq`, oldest first."""

    batches: tuple[KvEventBatch, ...]
    next: int        # the last batch's seq: the cursor of the next read
    complete: bool   # False: batches after `seq` were dropped (or `seq` is from another log)
    num_blocks: int  # distinct blocks held now
    block_size: int

    def as_json(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "next": self.next, "complete": self.complete,
                "num_blocks": self.num_blocks, "batches": [b.as_json() for b in self.batches]}


@attrs.frozen(kw_only=True)
class _Added:
    tokens: tuple[int, ...]
    hashes: tuple[int, ...]


class KvEventLog:
    """Refcounts per block over the indexed entries; their changes as batches of events."""

    def __init__(self, *, block_tokens: int = BLOCK_TOKENS, capacity: int = RING_BATCHES,
                 max_tokens: int = RING_TOKENS,
                 clock: Callable[[], float] = lambda: 0.0) -> None:
        if block_tokens < 1 or capacity < 1 or max_tokens < 1:
            raise ValueError("block_tokens, capacity and max_tokens must be >= 1")
        self._max_tokens = max_tokens
        self._ring_tokens = 0  # token ids the ring's BlockStored events hold
        self.block_tokens = block_tokens
        self._clock = clock
        self._held: dict[str, tuple[int, ...]] = {}  # entry key -> its block hashes
        self._refs: dict[int, int] = {}               # block hash -> entries holding it
        self._ring: collections.deque[KvEventBatch] = collections.deque(maxlen=capacity)
        self._seq = 0
        self._depth = 0
        self._was: dict[int, bool] = {}   # blocks touched in this batch -> held at its start
        self._added: list[_Added] = []    # entries added in this batch, in order

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held now."""
        return len(self._refs)

    @property
    def seq(self) -> int:
        """The last batch's seq (0: none yet)."""
        return self._seq

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Net every change inside into one batch, committed at the outermost exit."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._commit()

    def add(self, key: str, tokens: Sequence[int]) -> None:
        """Entry `key` now holds the whole blocks of `tokens`. ValueError if known."""
        if key in self._held:
            raise ValueError(f"entry {key} is already in the event log")
        hashes = block_hashes(tokens, self.block_tokens)
        self._held[key] = hashes
        for h in hashes:
            self._was.setdefault(h, h in self._refs)
            self._refs[h] = self._refs.get(h, 0) + 1
        if hashes:
            self._added.append(_Added(tokens=tuple(tokens[:len(hashes) * self.block_tokens]),
                                      hashes=hashes))
        if self._depth == 0:
            self._commit()

    def drop(self, key: str) -> None:
        """Entry `key` left the index (unknown keys are ignored)."""
        for h in self._held.pop(key, ()):
            self._was.setdefault(h, True)
            count = self._refs[h] - 1
            if count:
                self._refs[h] = count
            else:
                del self._refs[h]
        if self._depth == 0:
            self._commit()

    def clear(self) -> None:
        """Forget every entry: one batch of AllBlocksCleared (the index was reset)."""
        self._held.clear()
        self._refs.clear()
        self._was.clear()
        self._added.clear()
        self._record((AllBlocksCleared(),))

    def since(self, seq: int) -> KvEventPage:
        """The batches after `seq` still in the ring; `complete` False if some were
        dropped, or if `seq` is past the last batch (a cursor from an earlier log: the
        reader starts again from 0)."""
        if seq < 0:
            raise ValueError(f"since must be >= 0, got {seq}")
        first = self._ring[0].seq if self._ring else self._seq + 1
        batches = tuple(b for b in self._ring if b.seq > seq) if seq < self._seq else ()
        return KvEventPage(batches=batches, next=self._seq,
                           complete=first <= seq + 1 and seq <= self._seq,
                           num_blocks=self.num_blocks, block_size=self.block_tokens)

    def _commit(self) -> None:
        """Net the batch's changes into events and record them (none: no batch)."""
        was, added = self._was, self._added
        self._was, self._added = {}, []
        removed = tuple(h for h, held in was.items() if held and h not in self._refs)
        events: list[KvEvent] = [BlockRemoved(block_hashes=removed)] if removed else []
        stored: set[int] = set()
        for entry in added:  # its new blocks: one run (held blocks are prefix-closed)
            new = [i for i, h in enumerate(entry.hashes)
                   if not was.get(h, True) and h in self._refs and h not in stored]
            while new:
                end = next((j for j in range(1, len(new)) if new[j] != new[0] + j), len(new))
                events.append(self._stored(entry, new[0], new[0] + end))
                stored.update(entry.hashes[new[0]:new[0] + end])
                new = new[end:]
        if events:
            self._record(tuple(events))

    def _stored(self, entry: _Added, start: int, end: int) -> BlockStored:
        """BlockStored of `entry`'s blocks [start, end)."""
        n = self.block_tokens
        return BlockStored(block_hashes=entry.hashes[start:end],
                           parent_block_hash=entry.hashes[start - 1] if start else None,
                           token_ids=entry.tokens[start * n:end * n], block_size=n)

    def _record(self, events: tuple[KvEvent, ...]) -> None:
        self._seq += 1
        if len(self._ring) == self._ring.maxlen:
            self._ring_tokens -= _num_token_ids(self._ring[0])
        self._ring.append(KvEventBatch(seq=self._seq, ts=float(self._clock()), events=events))
        self._ring_tokens += _num_token_ids(self._ring[-1])
        while self._ring_tokens > self._max_tokens and len(self._ring) > 1:
            self._ring_tokens -= _num_token_ids(self._ring.popleft())


def _num_token_ids(batch: KvEventBatch) -> int:
    return sum(len(e.token_ids) for e in batch.events if isinstance(e, BlockStored))
