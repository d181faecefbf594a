"""The router's /metrics: Prometheus text built from the route table at scrape time.

Every backend series carries the label `backend` (its URL):
    tqserve_router_backend_up             1 while the backend is routable
    tqserve_router_backend_state          1 for the backend's current state (label state)
    tqserve_router_in_flight              requests running on the backend now
    tqserve_router_requests_total         requests routed to it, by reason (label route:
                                          affinity, spill, least_loaded, round_robin)
    tqserve_router_backend_failures_total connections lost under a request
    tqserve_router_owned_prefix_keys      prefix keys it owns in the LRU
    tqserve_router_prompt_tokens_total    prompt tokens of its finished WebSocket requests
    tqserve_router_cached_tokens_total    of which served from its prefix cache
and, router-wide, tqserve_router_retries_total (attempts after a lost backend) and
tqserve_router_rejections_total{code} (requests the router itself refused).
"""

from __future__ import annotations

from tqserve.api.router.core import BackendState
from tqserve.api.router.service import Router


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def exposition(router: Router) -> str:
    """The Prometheus text exposition of the router's figures now."""
    stats = router.table.statistics()
    lines: list[str] = []

    def family(name: str, kind: str, doc: str, rows: list[tuple[dict[str, str], float]]) -> None:
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in rows:
            text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{text}}} {value:g}" if text else f"{name} {value:g}")

    backends = stats.backends
    family("tqserve_router_backend_up", "gauge", "1 while the backend takes new requests",
           [({"backend": n}, float(b.state == BackendState.HEALTHY.value))
            for n, b in backends.items()])
    family("tqserve_router_backend_state", "gauge", "the backend's state (1 for the current)",
           [({"backend": n, "state": s.value}, float(b.state == s.value))
            for n, b in backends.items() for s in BackendState])
    family("tqserve_router_in_flight", "gauge", "requests running on the backend",
           [({"backend": n}, b.num_in_flight) for n, b in backends.items()])
    family("tqserve_router_requests_total", "counter", "requests routed to the backend",
           [({"backend": n, "route": r}, c) for n, b in backends.items()
            for r, c in sorted(b.num_routed.items())])
    family("tqserve_router_backend_failures_total", "counter",
           "connections to the backend lost under a request",
           [({"backend": n}, b.num_failures) for n, b in backends.items()])
    family("tqserve_router_owned_prefix_keys", "gauge", "prefix keys the backend owns",
           [({"backend": n}, b.num_owned_keys) for n, b in backends.items()])
    family("tqserve_router_prompt_tokens_total", "counter",
           "prompt tokens of the backend's finished WebSocket requests",
           [({"backend": n}, u.prompt_tokens) for n, u in router.usage.items()])
    family("tqserve_router_cached_tokens_total", "counter",
           "prompt tokens the backend served from its prefix cache",
           [({"backend": n}, u.cached_tokens) for n, u in router.usage.items()])
    family("tqserve_router_retries_total", "counter",
           "attempts on another backend after a lost one", [({}, stats.num_retries)])
    family("tqserve_router_rejections_total", "counter", "requests the router refused",
           [({"code": c}, v) for c, v in sorted(router.rejections.items())])
    return "\n".join(lines) + "\n"
