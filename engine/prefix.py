"""Prefix index: the books of reusable KV snapshots over token ids, across RAM and SSD.

Sans-io: no clock (callers pass a `tick`), no files, no MLX; entries are token ids plus
numbers, keyed by opaque strings the caller chooses.

Structure: a token trie (an uncompressed radix tree: one node per token). Each node lists
the entries whose token ids pass through it, so walking a new prompt down the trie finds,
at each depth d, every donor sharing at least d tokens with it; the deepest depth with a
usable donor wins. Chosen over hashed blocks because reuse is exact to the token (a block
hash rounds every hit down to the block size, which on short prompts and multi-turn
continuations loses most of the reuse), and a lookup costs O(prompt length), no hashing.
Memory is one dict per distinct (namespace, token prefix), shared by all donors of it.

Reusable length of a donor for a prompt P sharing d tokens with it:
    n = min(d, len(P) - 1, covered)   (the last prompt token must run to give logits)
    usable iff n >= minimum_reusable_offset (a converted TurboQuant row is never cut
    below its precision boundary) and (n == covered or the donor is trimmable).
Ties prefer RAM over SSD, then the most recently used.

Namespaces: `cache_namespace(fingerprint, kv_scheme, speculation)` hashes the model
fingerprint, the KV scheme and the speculation method; entries of different namespaces
live in different tries and never match.

Supersession: adding entry E drops an entry A of the same tier and namespace whose tokens
are a prefix of E's, only when E can serve every length A could: E's
minimum_reusable_offset <= A's, and E is trimmable (or covers exactly A's tokens). So an
earlier plain donor survives a converted descendant, whose boundary is higher.

RAM budget: `ram_budget` bytes; `publish` returns the coldest unpinned RAM entries to
spill so that the RAM tier fits. A spilled entry is "in flight" (matches nothing) until
the caller reports `spilled(key, ssd_key)` or `forget(key)`.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Sequence

import attrs


class Tier(enum.Enum):
    RAM = "ram"
    SSD = "ssd"
    SPILLING = "spilling"


def cache_namespace(fingerprint: str, kv_scheme: str, speculation: str = "none") -> str:
    """The namespace of every snapshot made under this model, KV scheme and speculation."""
    digest = hashlib.blake2b(digest_size=16, person=b"tq-namespace")
    for part in (fingerprint, kv_scheme, speculation):
        digest.update(len(part).to_bytes(4, "little") + part.encode("utf-8"))
    return digest.hexdigest()


@attrs.frozen(kw_only=True)
class PrefixEntry:
    """One reusable snapshot: the tokens its KV covers and how far it may be trimmed."""

    key: str
    namespace: str
    tokens: tuple[int, ...]
    minimum_reusable_offset: int
    trimmable: bool
    num_bytes: int

    @property
    def covered(self) -> int:
        """Tokens the snapshot's KV holds."""
        return len(self.tokens)


@attrs.frozen(kw_only=True)
class PrefixMatch:
    """The donor chosen for a prompt: reuse its first `length` tokens."""

    key: str
    tier: Tier
    length: int
    entry: PrefixEntry


@attrs.frozen(kw_only=True)
class PrefixStatistics:
    ram_entries: int
    ram_bytes: int
    ssd_entries: int
    ssd_bytes: int
    hits_ram: int
    hits_ssd: int
    misses: int
    superseded: int


@attrs.define
class _Node:
    children: dict[int, _Node] = attrs.Factory(dict)
    keys: set[str] = attrs.Factory(set)


class PrefixIndex:
    """Entries across tiers, their trie per namespace, the RAM budget and use order."""

    def __init__(self, ram_budget: int) -> None:
        if ram_budget < 0:
            raise ValueError(f"ram_budget must be >= 0, got {ram_budget}")
        self.ram_budget = ram_budget
        self._entries: dict[str, PrefixEntry] = {}
        self._tier: dict[str, Tier] = {}
        self._used: dict[str, int] = {}
        self._pins: dict[str, int] = {}
        self._roots: dict[str, _Node] = {}
        self._counts = {"hits_ram": 0, "hits_ssd": 0, "misses": 0, "superseded": 0}

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def tier(self, key: str) -> Tier | None:
        """Where the entry lives now; None if unknown."""
        return self._tier.get(key)

    def entry(self, key: str) -> PrefixEntry:
        return self._entries[key]

    def has_tokens(self, namespace: str, tokens: Sequence[int]) -> bool:
        """Whether a matchable entry covers exactly `tokens` in `namespace`."""
        node = self._walk(namespace, tokens)
        return node is not None and any(
            self._entries[k].covered == len(tokens) and self._tier[k] is not Tier.SPILLING
            for k in node.keys)

    def lookup(self, namespace: str, prompt: Sequence[int], tick: int) -> PrefixMatch | None:
        """The longest usable donor for `prompt` (see the module doc); counts hit or miss."""
        limit = len(prompt) - 1
        node = self._roots.get(namespace)
        path: list[_Node] = []
        for token in prompt[:limit]:
            node = node.children.get(token) if node is not None else None
            if node is None:
                break
            path.append(node)
        for depth in range(len(path), 0, -1):
            best = None
            for key in path[depth - 1].keys:
                entry, tier = self._entries[key], self._tier[key]
                if tier is Tier.SPILLING or depth < entry.minimum_reusable_offset:
                    continue
                if depth < entry.covered and not entry.trimmable:
                    continue
                rank = (tier is Tier.RAM, self._used.get(key, 0))
                if best is None or rank > best[0]:
                    best = (rank, key)
            if best is not None:
                key = best[1]
                self._used[key] = tick
                tier = self._tier[key]
                self._counts["hits_ram" if tier is Tier.RAM else "hits_ssd"] += 1
                return PrefixMatch(key=key, tier=tier, length=depth, entry=self._entries[key])
        self._counts["misses"] += 1
        return None

    def publish(self, entry: PrefixEntry, tier: Tier, tick: int) -> tuple[list[str], list[str]]:
        """Index `entry` in `tier`. Returns (superseded keys, RAM keys to spill now).

        Superseded keys are gone from the index; keys to spill are marked SPILLING.
        """
        if entry.key in self._entries:
            raise ValueError(f"entry {entry.key} is already indexed")
        if entry.minimum_reusable_offset > entry.covered:
            raise ValueError("minimum_reusable_offset exceeds the covered length")
        superseded = [key for key in self._ancestors(entry)
                      if self._tier[key] is tier and self._pins.get(key, 0) == 0
                      and self._supersedes(entry, self._entries[key])]
        for key in superseded:
            self._remove(key)
        self._counts["superseded"] += len(superseded)
        self._entries[entry.key] = entry
        self._tier[entry.key] = tier
        self._used[entry.key] = tick
        node = self._roots.setdefault(entry.namespace, _Node())
        for token in entry.tokens:
            node = node.children.setdefault(token, _Node())
            node.keys.add(entry.key)
        return superseded, self._over_budget()

    @staticmethod
    def _supersedes(new: PrefixEntry, old: PrefixEntry) -> bool:
        if new.minimum_reusable_offset > old.minimum_reusable_offset:
            return False
        return new.trimmable or new.covered == old.covered

    def _ancestors(self, entry: PrefixEntry) -> Iterable[str]:
        node = self._roots.get(entry.namespace)
        found = []
        for token in entry.tokens:
            node = node.children.get(token) if node is not None else None
            if node is None:
                break
            found += [k for k in node.keys if self._entries[k].covered <= entry.covered
                      and self._entries[k].tokens == entry.tokens[:self._entries[k].covered]]
        return set(found)

    def _over_budget(self) -> list[str]:
        ram = sorted((self._used[k], k) for k, t in self._tier.items() if t is Tier.RAM)
        total = sum(self._entries[k].num_bytes for _, k in ram)
        spill = []
        for _, key in ram:
            if total <= self.ram_budget:
                break
            if self._pins.get(key, 0):
                continue
            total -= self._entries[key].num_bytes
            self._tier[key] = Tier.SPILLING
            spill.append(key)
        return spill

    def spilled(self, key: str, ssd_entry: PrefixEntry | None) -> None:
        """A spill finished: re-index under `ssd_entry` (SSD), or drop it (None: failed)."""
        if key in self._entries:
            self._remove(key)
        if ssd_entry is not None and ssd_entry.key not in self._entries:
            self.publish(ssd_entry, Tier.SSD, self._used.get(key, 0))

    def pin(self, key: str) -> None:
        """Keep the entry from eviction until `unpin` (a row is being built from it)."""
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: str) -> list[str]:
        """Release a pin; returns RAM keys to spill if the budget is now exceeded."""
        count = self._pins.get(key, 0) - 1
        if count <= 0:
            self._pins.pop(key, None)
        else:
            self._pins[key] = count
        return self._over_budget()

    def forget(self, key: str) -> None:
        """Drop an entry (its file was quarantined, evicted, or its spill was dropped)."""
        if key in self._entries:
            self._remove(key)

    def _walk(self, namespace: str, tokens: Sequence[int]) -> _Node | None:
        node = self._roots.get(namespace)
        for token in tokens:
            if node is None:
                return None
            node = node.children.get(token)
        return node

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key)
        del self._tier[key]
        self._used.pop(key, None)
        root = self._roots[entry.namespace]
        node, trail = root, []
        for token in entry.tokens:
            child = node.children[token]
            child.keys.discard(key)
            trail.append((node, token, child))
            node = child
        for parent, token, child in reversed(trail):
            if child.keys or child.children:
                break
            del parent.children[token]

    def keys(self, tier: Tier) -> list[str]:
        """Keys of the entries in `tier`."""
        return [k for k, t in self._tier.items() if t is tier]

    def statistics(self) -> PrefixStatistics:
        def total(tier: Tier) -> tuple[int, int]:
            keys = self.keys(tier)
            return len(keys), sum(self._entries[k].num_bytes for k in keys)
        (ram_n, ram_b), (ssd_n, ssd_b) = total(Tier.RAM), total(Tier.SSD)
        return PrefixStatistics(ram_entries=ram_n, ram_bytes=ram_b, ssd_entries=ssd_n,
                                ssd_bytes=ssd_b, **self._counts)
