"""The prefix cache's namespaces: which snapshots a request may reuse and publish.

Sans-io (no MLX, no I/O): names only. Every namespace hashes the model fingerprint and the
KV scheme (engine.prefix.cache_namespace); speculation adds the state a snapshot pairs with
the target's KV (engine.speculative.state):

* the state-free namespace (speculation "none": the same as before paired snapshots, so
  older files stay valid): rows that do not speculate, rows that speculate with `lookup`
  (n-gram lookup keeps no state), and rows of a proposer whose state cannot be paired;
* one namespace per stateful proposer, named by its state identity: `draft:<draft model
  fingerprint>` and `mtp:<MTP head fingerprint>`. Rows of that method publish and reuse
  only there, and every snapshot there holds the target's KV and the proposer's state for
  the same tokens.

The rule: a request reuses and publishes only in the namespace of its own (resolved)
speculation method. So a non-speculating (or lookup) request never reuses the target part
of a paired snapshot, and a draft or MTP row never starts from a snapshot without its
proposer's state: paired and state-free state never mix, and no row is half-restored. The
price: a prompt shared by requests of different methods is prefilled once per method.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from tqserve.engine.prefix import cache_namespace
from tqserve.engine.speculative.policy import SpecChoice, resolve_choice


@attrs.frozen(kw_only=True)
class CacheNamespaces:
    """The state-free namespace and, per stateful method, (state identity, namespace)."""

    base: str
    paired: Mapping[str, tuple[str, str]] = attrs.field(factory=dict)
    default: SpecChoice | None = None  # the server's choice for requests that name none

    @classmethod
    def build(cls, fingerprint: str, kv_scheme: str, identities: Mapping[str, str],
              default: SpecChoice | None = None) -> CacheNamespaces:
        """From the model and KV scheme, and per stateful method its state identity."""
        return cls(base=cache_namespace(fingerprint, kv_scheme), default=default,
                   paired={method: (identity, cache_namespace(fingerprint, kv_scheme, identity))
                           for method, identity in identities.items()})

    def of_request(self, choice: object) -> str:
        """The namespace of a request with speculation choice `choice` (SpecChoice, bool,
        or None: the server's default)."""
        resolved = resolve_choice(choice, self.default)
        if resolved is None or resolved.method not in self.paired:
            return self.base
        return self.paired[resolved.method][1]

    def of_state(self, identity: str) -> str:
        """The namespace of snapshots paired with state `identity` ("": state-free).
        KeyError for an identity no method here has."""
        if not identity:
            return self.base
        for ident, namespace in self.paired.values():
            if ident == identity:
                return namespace
        raise KeyError(identity)

    def state_of(self, namespace: str) -> str | None:
        """The state identity of one of these namespaces ("" for the state-free one), None
        for a namespace that is not this engine's."""
        if namespace == self.base:
            return ""
        return next((ident for ident, ns in self.paired.values() if ns == namespace), None)

    def all(self) -> frozenset[str]:
        return frozenset({self.base, *(ns for _, ns in self.paired.values())})
