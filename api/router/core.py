"""The router's sans-io core: which backend serves a request, and the books behind it.

No I/O, no clock, no trio: the app calls `choose()` with a request's prefix keys, then
`started()` / `finished()` / `failed()` as the request runs, and `set_health()` with each
health check's outcome; every decision comes back as data (`Route`).

Prefix keys (`prefix_keys`): the prompt is cut into fixed-size blocks, and key i is a
chained hash of blocks 0..i, so one key names a whole prefix. Token prompts
(`prompt_tokens`) are cut every `block_tokens` ids; text prompts (`prompt`, chat
`messages`) every `block_chars` characters of the text, without tokenizing: the router
loads no model and serves any backend model, and two prompts that share a text prefix
share its token prefix too, up to the BPE merge at the cut, which costs at most one block.
Only whole blocks count (a tail shorter than a block names no reusable prefix).

Policy `prefix`: a backend that holds the deepest known key of the prompt gets it: one
its KV events say it holds (`observe`; the Ray Serve router reads them, engine.kvevents),
or the one the longest prefix was routed to before (a bounded LRU of key -> backend);
of several, the least loaded. It gets it if
* what it holds beyond what the least loaded backend holds too covers at least
  `min_match_fraction` of the prompt's blocks (a prompt that shares only a short system
  prompt with earlier ones is spread by load instead, as SGLang's cache-aware router does:
  every replica soon holds that short prefix, and then it decides nothing), and
* the owner is not overloaded: its in-flight count is less than the least loaded
  routable backend's plus `spill_threshold`; otherwise it spills to the least loaded.
Without a match the least loaded routable backend gets it (ties rotate). The chosen
backend becomes the owner of all the prompt's keys. Policy `round-robin` ignores keys.

Backend states (one transition table): UNKNOWN until the first health check, HEALTHY,
UNHEALTHY (a failed check or a lost connection; its keys are forgotten, since a replica
that comes back has lost its RAM tier), DRAINING (an operator's choice, sticky until
UNDRAIN: no new requests, in-flight ones finish). Only HEALTHY backends are routable.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
from collections import OrderedDict
from typing import Any, Sequence

import attrs

from tqserve.engine.kvevents import block_hashes

POLICIES = ("prefix", "round-robin")
_KEY_BYTES = 8
Key = bytes | int  # a text key (bytes) or a token block hash (int, as in KV events)


class BackendState(enum.Enum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"


class HealthEvent(enum.Enum):
    UP = "up"
    DOWN = "down"
    DRAIN = "drain"
    UNDRAIN = "undrain"


_S, _E = BackendState, HealthEvent
TRANSITIONS: dict[tuple[BackendState, HealthEvent], BackendState] = {
    **{(s, _E.UP): _S.HEALTHY for s in (_S.UNKNOWN, _S.HEALTHY, _S.UNHEALTHY)},
    **{(s, _E.DOWN): _S.UNHEALTHY for s in (_S.UNKNOWN, _S.HEALTHY, _S.UNHEALTHY)},
    **{(s, _E.DRAIN): _S.DRAINING for s in _S},
    (_S.DRAINING, _E.UP): _S.DRAINING,
    (_S.DRAINING, _E.DOWN): _S.DRAINING,
    **{(s, _E.UNDRAIN): s for s in (_S.UNKNOWN, _S.HEALTHY, _S.UNHEALTHY)},
    (_S.DRAINING, _E.UNDRAIN): _S.UNKNOWN,  # the next health check decides
}


class NoHealthyBackend(Exception):
    """No backend can take the request (all unhealthy, draining, or already tried)."""


def _chain(seed: bytes, blocks: Sequence[bytes]) -> tuple[bytes, ...]:
    keys = []
    prev = seed
    for block in blocks:
        prev = hashlib.blake2b(prev + block, digest_size=_KEY_BYTES).digest()
        keys.append(prev)
    return tuple(keys)


def token_keys(tokens: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """Chained keys of the whole `block_tokens`-id blocks of a token prompt: the block
    hashes of the engine's KV events (engine.kvevents), so a router that reads a replica's
    events finds its prompts' blocks there."""
    return block_hashes(tokens, block_tokens)


def text_keys(text: str, block_chars: int) -> tuple[bytes, ...]:
    """Chained keys of the whole `block_chars`-character blocks of a text prompt."""
    n = len(text) // block_chars
    blocks = [text[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass")
              for i in range(n)]
    return _chain(b"text", blocks)


def prefix_keys(fields: dict[str, Any], *, block_tokens: int, block_chars: int
                ) -> tuple[Key, ...]:
    """The prefix keys of a request body (WebSocket generate, OpenAI or Anthropic JSON).

    Reads `prompt_tokens` (ids), `prompt` (text, or OpenAI's list of ids / one-string
    list) or `messages` (+ Anthropic's `system`); anything malformed gives no keys (the
    backend will refuse the request and name the field)."""
    prompt = fields.get("prompt_tokens", fields.get("prompt"))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(type(t) is int and abs(t) < 2**63 for t in prompt):
        return token_keys(prompt, block_tokens)
    if isinstance(prompt, str):
        return text_keys(prompt, block_chars)
    messages = fields.get("messages")
    if isinstance(messages, list):
        parts = [f"system\x00{fields['system']}\x00"] if "system" in fields else []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"{m.get('role')}\x00{m.get('content')}\x00")
        return text_keys("".join(parts), block_chars)
    return ()


@attrs.frozen(kw_only=True)
class Route:
    """Where one request goes and why (`affinity`, `spill`, `least_loaded`, `round_robin`)."""

    backend: str
    reason: str
    matched_blocks: int = 0


@attrs.frozen(kw_only=True)
class BackendStatistics:
    state: str
    num_in_flight: int
    num_routed: dict[str, int]  # reason -> requests
    num_failures: int           # lost connections and failed requests
    num_owned_keys: int


@attrs.frozen(kw_only=True)
class RouterStatistics:
    policy: str
    num_keys: int
    num_retries: int
    num_no_backend: int
    backends: dict[str, BackendStatistics]


@attrs.define
class _Backend:
    state: BackendState = BackendState.UNKNOWN
    failed_checks: int = 0  # consecutive failed health checks
    in_flight: int = 0
    routed: dict[str, int] = attrs.Factory(dict)
    failures: int = 0
    owned: int = 0


@attrs.frozen(kw_only=True)
class RoutingConfig:
    """The routing knobs (the CLI maps its flags onto them 1:1)."""

    policy: str = attrs.field(default="prefix", validator=attrs.validators.in_(POLICIES))
    block_tokens: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    block_chars: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    max_keys: int = attrs.field(default=1 << 18, validator=attrs.validators.ge(1))
    spill_threshold: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    health_failures: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    min_match_fraction: float = attrs.field(default=0.5, validator=[
        attrs.validators.ge(0.0), attrs.validators.le(1.0)])


class RouteTable:
    """Backends, their load and health, and the LRU of prefix key -> owning backend."""

    def __init__(self, backends: Sequence[str], config: RoutingConfig) -> None:
        if not backends:
            raise ValueError("backends: at least one backend is needed")
        if len(set(backends)) != len(backends):
            raise ValueError("backends: the same backend is listed twice")
        self.config = config
        self._backends = {name: _Backend() for name in backends}
        self._owner: OrderedDict[Key, str] = OrderedDict()  # routed here last (LRU)
        self._holders: dict[Key, set[str]] = {}  # backends whose KV events say they hold it
        self._turn = itertools.count()
        self._retries = 0
        self._no_backend = 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._backends)

    def state(self, backend: str) -> BackendState:
        return self._backends[backend].state

    def num_in_flight(self, backend: str | None = None) -> int:
        """In-flight requests of one backend, or of all."""
        if backend is not None:
            return self._backends[backend].in_flight
        return sum(b.in_flight for b in self._backends.values())

    def routable(self) -> list[str]:
        return [n for n, b in self._backends.items() if b.state is BackendState.HEALTHY]

    def set_health(self, backend: str, event: HealthEvent) -> BackendState:
        """Apply a health event; a backend that goes down forgets the keys it owned."""
        b = self._backends[backend]
        new = TRANSITIONS[(b.state, event)]
        if new is BackendState.UNHEALTHY and b.state is not BackendState.UNHEALTHY:
            self._forget(backend)
        b.state = new
        return new

    def checked(self, backend: str, ok: bool) -> BackendState:
        """A health check's outcome: one pass brings a backend up; `health_failures`
        consecutive failures take it down (one slow answer on a busy machine does not, and
        an UNKNOWN backend goes down at its first failure)."""
        b = self._backends[backend]
        b.failed_checks = 0 if ok else b.failed_checks + 1
        if ok:
            return self.set_health(backend, HealthEvent.UP)
        if b.failed_checks >= self.config.health_failures or b.state is BackendState.UNKNOWN:
            return self.set_health(backend, HealthEvent.DOWN)
        return b.state

    def _forget(self, backend: str) -> None:
        for key in [k for k, owner in self._owner.items() if owner == backend]:
            del self._owner[key]
        self._backends[backend].owned = 0
        self.observe(backend, (), self.held_by(backend))

    def set_backends(self, names: Sequence[str]) -> None:
        """The backend set changed (a cluster's replicas): new ones are HEALTHY (whoever
        lists them has checked them), gone ones are forgotten with their keys."""
        for name in [n for n in self._backends if n not in names]:
            self._forget(name)
            del self._backends[name]
        for name in names:
            backend = self._backends.setdefault(name, _Backend())
            if backend.state is BackendState.UNKNOWN:
                backend.state = BackendState.HEALTHY

    def set_load(self, backend: str, in_flight: int) -> None:
        """Set a backend's load from outside (Ray's queue length) instead of counting."""
        self._backends[backend].in_flight = max(0, in_flight)

    def held_by(self, backend: str) -> list[Key]:
        """The keys `backend`'s KV events say it holds."""
        return [k for k, held in self._holders.items() if backend in held]

    def observe(self, backend: str, stored: Sequence[Key], removed: Sequence[Key]) -> None:
        """What `backend`'s KV events say it now holds (`stored`) or dropped (`removed`);
        a key it dropped is no longer routed to it for affinity."""
        for key in stored:
            self._holders.setdefault(key, set()).add(backend)
        for key in removed:
            held = self._holders.get(key)
            if held is not None:
                held.discard(backend)
                if not held:
                    del self._holders[key]
            if self._owner.get(key) == backend:
                del self._owner[key]
                self._backends[backend].owned -= 1

    def _has(self, backend: str, key: Key) -> bool:
        """Whether `backend` holds `key` (its KV events) or had it routed there last."""
        return backend in self._holders.get(key, ()) or self._owner.get(key) == backend

    def _owner_of(self, key: Key, candidates: Sequence[str]) -> str | None:
        """The least loaded candidate that has `key`."""
        return min((n for n in candidates if self._has(n, key)),
                   key=lambda n: self._backends[n].in_flight, default=None)

    def choose(self, keys: Sequence[Key], exclude: Sequence[str] = ()) -> Route:
        """The backend for a request with these prefix keys (not one of `exclude`).
        Raises NoHealthyBackend when none is routable."""
        candidates = [n for n in self.routable() if n not in exclude]
        if not candidates:
            self._no_backend += 1
            raise NoHealthyBackend("no healthy backend" if not exclude else
                                   f"no healthy backend left after {len(exclude)} tried")
        if self.config.policy == "round-robin":
            return Route(backend=candidates[next(self._turn) % len(candidates)],
                         reason="round_robin")
        least = min(self._backends[n].in_flight for n in candidates)
        idle = [n for n in candidates if self._backends[n].in_flight == least]
        fallback = idle[next(self._turn) % len(idle)]
        for depth in range(len(keys), 0, -1):
            owner = self._owner_of(keys[depth - 1], candidates)
            if owner is None:
                continue
            base = self.depth_held(fallback, keys, depth)  # what the least loaded has too
            if depth - base < self.config.min_match_fraction * len(keys):
                return Route(backend=fallback, reason="least_loaded", matched_blocks=base)
            if self._backends[owner].in_flight - least >= self.config.spill_threshold:
                return Route(backend=fallback, reason="spill", matched_blocks=depth)
            return Route(backend=owner, reason="affinity", matched_blocks=depth)
        return Route(backend=fallback, reason="least_loaded")

    def depth_held(self, backend: str, keys: Sequence[Key], below: int | None = None) -> int:
        """The deepest of keys[:below] (all by default) that `backend` has (0: none)."""
        below = len(keys) if below is None else below
        return next((d for d in range(below, 0, -1) if self._has(backend, keys[d - 1])), 0)

    def started(self, route: Route, keys: Sequence[Key], *, retry: bool = False,
                owns: bool = True) -> None:
        """The request went to `route.backend`: count it, and (`owns`) make it own `keys`
        now; a caller that knows when the prompt is computed calls `own()` then."""
        b = self._backends[route.backend]
        b.in_flight += 1
        b.routed[route.reason] = b.routed.get(route.reason, 0) + 1
        self._retries += retry
        if owns:
            self.own(route.backend, keys)

    def own(self, backend: str, keys: Sequence[Key]) -> None:
        """`backend` is where `keys` were routed last (policy prefix): the LRU's owner."""
        if self.config.policy != "prefix" or backend not in self._backends:
            return
        b = self._backends[backend]
        for key in keys:
            old = self._owner.pop(key, None)
            if old is not None:
                self._backends[old].owned -= 1
            self._owner[key] = backend
            b.owned += 1
        while len(self._owner) > self.config.max_keys:
            _, old = self._owner.popitem(last=False)
            self._backends[old].owned -= 1

    def hold(self, backend: str) -> None:
        """Count one more in flight on `backend` without routing anything (a response that
        keeps streaming after its attempt ended; `finished()` releases it)."""
        self._backends[backend].in_flight += 1

    def finished(self, backend: str) -> None:
        """A request on `backend` ended (in any way)."""
        b = self._backends[backend]
        if b.in_flight <= 0:
            raise ValueError(f"backend {backend!r} has no request in flight")
        b.in_flight -= 1

    def failed(self, backend: str) -> None:
        """The connection to `backend` broke under a request: it is down until a health
        check says otherwise."""
        self._backends[backend].failures += 1
        self.set_health(backend, HealthEvent.DOWN)

    def statistics(self) -> RouterStatistics:
        return RouterStatistics(
            policy=self.config.policy, num_keys=len(self._owner), num_retries=self._retries,
            num_no_backend=self._no_backend,
            backends={n: BackendStatistics(state=b.state.value, num_in_flight=b.in_flight,
                                           num_routed=dict(b.routed), num_failures=b.failures,
                                           num_owned_keys=b.owned)
                      for n, b in self._backends.items()})


class KvFeed:
    """Applies replicas' KV event windows to a RouteTable (the Ray Serve router's feed).

    A window is what a replica reports with its load: `kv_next` (its last batch's seq) and
    `kv_batches`, the last batches as (seq, stored keys, removed keys). Batches already
    applied are skipped; a window that starts after the last batch applied (the reader
    missed some) starts that replica's holdings afresh from the window."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.num_resyncs = 0

    def absorb(self, table: RouteTable, backend: str, window: dict[str, Any]) -> None:
        batches = window.get("kv_batches") or []
        last = self.seen.get(backend, 0)
        if not batches or int(window.get("kv_next", 0)) <= last:
            return
        if last > 0 and int(batches[0][0]) > last + 1:
            self.num_resyncs += 1
            table.observe(backend, (), table.held_by(backend))
        for seq, stored, removed in batches:
            if int(seq) > last:
                table.observe(backend, stored, removed)
        self.seen[backend] = int(window["kv_next"])

    def forget(self, backend: str) -> None:
        self.seen.pop(backend, None)
