"""Prefix index: the books of reusable KV snapshots over token ids, across RAM and SSD.

Sans-io: no clock (callers pass a `tick`), no files, no MLX; entries are token ids plus
numbers, keyed by opaque strings the caller chooses. Every entry indexed or removed (any
tier, any removal path) feeds the KV event log `events` (engine.kvevents); one publish
or `spilled` is one netted batch (a RAM entry replaced by its SSD twin emits nothing).

Structure: a radix tree per namespace (a token trie with path compression: one node per
branch point or entry end, each holding the run of tokens from its parent). Every node
lists, per tier, the matchable entries whose tokens pass through it, most recently used
last; so walking a new prompt down the tree finds, at each node on the path, every donor
sharing at least that node's depth with it, and the best one is the first usable one in
recency order. Chosen over hashed blocks: reuse is exact to the token (a block hash
rounds every hit down to the block size: on short prompts most of the reuse).

Cost (asserted by tests through `statistics().entries_visited`, never by time):
  * lookup: O(prompt length) token comparisons, plus the entries it examines: the winner
    and the ones skipped on the way (a precision boundary above the shared length, or an
    untrimmable donor cut short);
  * publish: O(prompt length + nodes on the path) plus the entries ending on its path
    (its candidate ancestors); a new branch inside a run of tokens copies the lists of the
    one node it splits; the RAM budget walks the coldest entries only;
  * remove, pin, a hit's recency update: O(nodes on the path).
So 10,000 donors under one system prompt cost a lookup or a publish about as much as one.

Reusable length of a donor for a prompt P sharing d tokens with it:
    n = min(d, len(P) - 1, covered)   (the last prompt token must run to give logits)
    usable iff n >= minimum_reusable_offset (a converted TurboQuant row is never cut
    below its precision boundary) and (n == covered or the donor is trimmable).
The longest usable n wins; ties prefer RAM over SSD, then the most recently used.

Namespaces: `cache_namespace(fingerprint, kv_scheme, speculation)` hashes the model
fingerprint, KV scheme and speculation state of the snapshots ("none", or a proposer's
state identity: engine.namespaces); different namespaces' trees never match.

Supersession: adding E drops an entry A of its tier and namespace whose tokens are a
prefix of E's only when E serves every length A could (E's minimum_reusable_offset <= A's,
and E is trimmable or covers exactly A's tokens): a plain donor outlives a converted one.

RAM budget: `ram_budget` bytes; `publish` returns the coldest unpinned RAM entries over
the budget, marked SPILLING until the caller reports `spilled(key, ssd_entry)`,
`pending(key)` or `forget(key)`. Tiers out of the budget stay matchable: SPILLING (the
caller still holds the snapshot; a hit may take it back with `unspill`) and PENDING (the
RAM copy is gone, its bytes wait for the disk: the caller serves them until its write
ends); a lookup prefers, at equal length, RAM, then SPILLING, PENDING and SSD.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterator, Sequence

import attrs

from tqserve.engine.kvevents import KvEventLog


class Tier(enum.Enum):
    RAM = "ram"
    SSD = "ssd"
    SPILLING = "spilling"  # over the RAM budget; the caller's spill or drop is on its way
    PENDING = "pending"    # its RAM copy is gone; its file is being written


_MATCH_ORDER = (Tier.RAM, Tier.SPILLING, Tier.PENDING, Tier.SSD)  # the preference at a tie


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
    entries_visited: int  # entries examined by lookups and publishes (the cost model above)


@attrs.define(eq=False)
class _Node:
    edge: tuple[int, ...]  # the tokens from the parent to this node
    depth: int             # tokens from the root to the end of `edge`
    children: dict[int, _Node] = attrs.Factory(dict)  # first token of the child's edge
    # per tier, the entries through here, least recently used first
    members: dict[Tier, dict[str, None]] = attrs.Factory(lambda: {t: {} for t in Tier})
    ends: set[str] = attrs.Factory(set)         # entries (any tier) ending exactly here


def _common(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of `edge` equal tokens[start:]."""
    if tuple(tokens[start:start + len(edge)]) == edge:
        return len(edge)
    n = 0
    for a, b in zip(edge, tokens[start:]):
        if a != b:
            break
        n += 1
    return n


class PrefixIndex:
    """Entries across tiers, their radix tree per namespace, the RAM budget and use order."""

    def __init__(self, ram_budget: int, events: KvEventLog | None = None) -> None:
        if ram_budget < 0:
            raise ValueError(f"ram_budget must be >= 0, got {ram_budget}")
        self.ram_budget = ram_budget
        self.events = events if events is not None else KvEventLog()
        self._entries: dict[str, PrefixEntry] = {}
        self._tier: dict[str, Tier] = {}
        self._used: dict[str, int] = {}
        self._pins: dict[str, int] = {}
        self._roots: dict[str, _Node] = {}
        self._ram_order: dict[str, None] = {}  # RAM entries, coldest first (eviction order)
        self._totals = {tier: [0, 0] for tier in Tier}  # entries, bytes
        self._counts = {"hits_ram": 0, "hits_ssd": 0, "misses": 0, "superseded": 0,
                        "entries_visited": 0}

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def tier(self, key: str) -> Tier | None:
        """Where the entry lives now; None if unknown."""
        return self._tier.get(key)

    def entry(self, key: str) -> PrefixEntry:
        return self._entries[key]

    def has_tokens(self, namespace: str, tokens: Sequence[int],
                   tier: Tier | None = None) -> bool:
        """Whether an entry (of `tier`, if given) covers exactly `tokens`."""
        node = self._exact(namespace, tokens)
        return node is not None and any(tier is None or self._tier[k] is tier
                                        for k in node.ends)

    def lookup(self, namespace: str, prompt: Sequence[int], tick: int) -> PrefixMatch | None:
        """The longest usable donor for `prompt` (see the module doc); counts hit or miss."""
        for node, depth in self._candidates(namespace, prompt[:len(prompt) - 1]):
            for tier in _MATCH_ORDER:
                for key in reversed(node.members[tier]):
                    self._counts["entries_visited"] += 1
                    entry = self._entries[key]
                    if depth < entry.minimum_reusable_offset:
                        continue
                    if depth < entry.covered and not entry.trimmable:
                        continue
                    self._touch(key, tick)
                    in_ram = tier in (Tier.RAM, Tier.SPILLING)
                    self._counts["hits_ram" if in_ram else "hits_ssd"] += 1
                    return PrefixMatch(key=key, tier=tier, length=depth, entry=entry)
        self._counts["misses"] += 1
        return None

    def publish(self, entry: PrefixEntry, tier: Tier, tick: int) -> tuple[list[str], list[str]]:
        """Index `entry` in `tier`. Returns (superseded keys, gone from the index; RAM keys
        over the budget, marked SPILLING)."""
        if entry.key in self._entries:
            raise ValueError(f"entry {entry.key} is already indexed")
        if entry.minimum_reusable_offset > entry.covered:
            raise ValueError("minimum_reusable_offset exceeds the covered length")
        if not entry.tokens:
            raise ValueError("an entry covers at least one token")
        if tier not in (Tier.RAM, Tier.SSD):
            raise ValueError(f"an entry is published in RAM or SSD, not {tier.name}")
        path = self._insert_path(entry.namespace, entry.tokens)
        superseded = [key for node in path for key in node.ends
                      if self._tier[key] is tier and self._pins.get(key, 0) == 0
                      and self._supersedes(entry, self._entries[key])]
        self._counts["entries_visited"] += sum(len(node.ends) for node in path)
        with self.events.batch():
            for key in superseded:
                self._remove(key)
            self.events.add(entry.key, entry.tokens)
        self._counts["superseded"] += len(superseded)
        self._entries[entry.key] = entry
        self._tier[entry.key] = tier
        self._used[entry.key] = tick
        path[-1].ends.add(entry.key)
        self._place(entry.key, tier, path)
        return superseded, self._over_budget()

    @staticmethod
    def _supersedes(new: PrefixEntry, old: PrefixEntry) -> bool:
        if new.minimum_reusable_offset > old.minimum_reusable_offset:
            return False
        return new.trimmable or new.covered == old.covered

    def _candidates(self, namespace: str, tokens: Sequence[int]) -> Iterator[tuple[_Node, int]]:
        """(node, shared depth) along `tokens`' path, deepest first; depth 0 excluded."""
        node = self._roots.get(namespace)
        found: list[tuple[_Node, int]] = []
        depth = 0
        while node is not None and depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            n = _common(child.edge, tokens, depth)
            depth += n
            found.append((child, depth))
            if n < len(child.edge):
                break
            node = child
        return reversed(found)

    def _insert_path(self, namespace: str, tokens: tuple[int, ...]) -> list[_Node]:
        """The nodes from the root to `tokens`' end, splitting or adding as needed."""
        node = self._roots.setdefault(namespace, _Node(edge=(), depth=0))
        path, depth = [], 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                child = _Node(edge=tokens[depth:], depth=len(tokens))
                node.children[tokens[depth]] = child
            else:
                n = _common(child.edge, tokens, depth)
                if n < len(child.edge):
                    child = self._split(node, child, n)
            path.append(child)
            depth = child.depth
            node = child
        return path

    @staticmethod
    def _split(parent: _Node, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after `n` tokens; the new middle node keeps its members."""
        middle = _Node(edge=child.edge[:n], depth=child.depth - len(child.edge) + n,
                       members={tier: dict(keys) for tier, keys in child.members.items()})
        child.edge = child.edge[n:]
        middle.children[child.edge[0]] = child
        parent.children[middle.edge[0]] = middle
        return middle

    def _path(self, entry: PrefixEntry) -> list[_Node]:
        """The nodes an indexed entry passes through (it ends on a node boundary)."""
        node, path, depth = self._roots[entry.namespace], [], 0
        while depth < entry.covered:
            node = node.children[entry.tokens[depth]]
            path.append(node)
            depth = node.depth
        return path

    def _exact(self, namespace: str, tokens: Sequence[int]) -> _Node | None:
        node, depth = self._roots.get(namespace), 0
        while node is not None and depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None or _common(child.edge, tokens, depth) < len(child.edge):
                return None
            node, depth = child, child.depth
        return node if node is not None and depth == len(tokens) else None

    def _place(self, key: str, tier: Tier, path: list[_Node]) -> None:
        """Record `key` as in `tier` (members, totals, eviction order)."""
        self._tier[key] = tier
        for node in path:
            node.members[tier][key] = None
        totals = self._totals[tier]
        totals[0] += 1
        totals[1] += self._entries[key].num_bytes
        if tier is Tier.RAM:
            self._ram_order[key] = None

    def _unplace(self, key: str, path: list[_Node]) -> None:
        tier = self._tier[key]
        for node in path:
            node.members[tier].pop(key, None)
        totals = self._totals[tier]
        totals[0] -= 1
        totals[1] -= self._entries[key].num_bytes
        self._ram_order.pop(key, None)

    def _retier(self, key: str, tier: Tier) -> None:
        path = self._path(self._entries[key])
        self._unplace(key, path)
        self._place(key, tier, path)

    def _touch(self, key: str, tick: int) -> None:
        """Mark `key` most recently used (last in every list it is in)."""
        self._used[key] = tick
        tier = self._tier[key]
        for node in self._path(self._entries[key]):
            members = node.members[tier]
            members.pop(key, None)
            members[key] = None
        if tier is Tier.RAM:
            self._ram_order.pop(key, None)
            self._ram_order[key] = None

    def _over_budget(self) -> list[str]:
        total = self._totals[Tier.RAM][1]
        spill = []
        for key in self._ram_order:
            if total <= self.ram_budget:
                break
            if self._pins.get(key, 0):
                continue
            total -= self._entries[key].num_bytes
            spill.append(key)
        for key in spill:
            self._retier(key, Tier.SPILLING)
        return spill

    def spilled(self, key: str, ssd_entry: PrefixEntry | None) -> None:
        """A spill finished: re-index under `ssd_entry` (SSD), or drop it (None: failed)."""
        with self.events.batch():
            if key in self._entries:
                self._remove(key)
            if ssd_entry is not None and ssd_entry.key not in self._entries:
                self.publish(ssd_entry, Tier.SSD, self._used.get(key, 0))

    def unspill(self, key: str) -> None:
        """A SPILLING entry whose spill never ran (a failed step, a hit) is back in RAM."""
        if self._tier.get(key) is Tier.SPILLING:
            self._retier(key, Tier.RAM)

    def pending(self, key: str) -> None:
        """A SPILLING entry left RAM while its file is written: PENDING (matchable) until
        the caller reports `spilled` or `forget`. ValueError unless SPILLING."""
        if self._tier.get(key) is not Tier.SPILLING:
            raise ValueError(f"entry {key} is not SPILLING")
        self._retier(key, Tier.PENDING)

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

    def _remove(self, key: str) -> None:
        entry = self._entries[key]
        path = self._path(entry)
        self._unplace(key, path)
        del self._entries[key], self._tier[key]
        self._used.pop(key, None)
        path[-1].ends.discard(key)
        self.events.drop(key)
        parents = [self._roots[entry.namespace], *path[:-1]]
        for parent, node in reversed(list(zip(parents, path))):
            if node.ends or node.children:
                break
            del parent.children[node.edge[0]]

    def keys(self, tier: Tier) -> list[str]:
        """Keys of the entries in `tier`."""
        return [k for k, t in self._tier.items() if t is tier]

    def statistics(self) -> PrefixStatistics:
        (ram_n, ram_b), (ssd_n, ssd_b) = self._totals[Tier.RAM], self._totals[Tier.SSD]
        return PrefixStatistics(ram_entries=ram_n, ram_bytes=ram_b, ssd_entries=ssd_n,
                                ssd_bytes=ssd_b, **self._counts)
