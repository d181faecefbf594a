"""Autoscaling the replicas on their engines' queue depth (`--autoscale-metric queue`).

Ray Serve's default policy scales on ongoing requests: the calls running or queued in each
replica, as Ray counts them. This one scales on what the engines hold: each replica reports
`rows_active + rows_queued` of its engine statistics as the custom metric QUEUE_METRIC
(`TqserveReplica.record_autoscaling_stats`), Ray averages it per replica over
`look_back_period_s`, and `queue_depth_policy` asks for as many replicas as keep each at
the target depth (`--target-ongoing-requests`, default `--max-batch`). Requests the fronts
hold because every replica is full count too: no engine has them yet. Ray then applies its
bounds (`--replicas`, `--max-replicas`), delays and scaling factors, as for its own policy.

Ray imports this module by value into its controller (AutoscalingPolicy pickles it), so it
imports nothing of tqserve.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

QUEUE_METRIC = "tqserve_queue_depth"  # rows running + queued in one replica's engine
POLICY = "tqserve.api.rayserve.autoscale:queue_depth_policy"


def desired_replicas(depths: Mapping[Any, float], num_queued_at_fronts: float,
                     target_depth: float, current: int) -> int:
    """Replicas that keep each engine at `target_depth` rows: the depths the replicas
    reported, plus the requests waiting in the fronts, over the target; `current` while
    no replica has reported yet."""
    if target_depth <= 0:
        raise ValueError(f"target_depth must be > 0, got {target_depth}")
    if not depths:
        return current
    return math.ceil((sum(depths.values()) + max(0.0, num_queued_at_fronts)) / target_depth)


def queue_depth_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Ray Serve's custom policy (an AutoscalingContext in, the replicas and the policy's
    state out): `desired_replicas` of the replicas' reported QUEUE_METRIC."""
    depths = (ctx.aggregated_metrics or {}).get(QUEUE_METRIC, {})  # running replicas'
    wanted = desired_replicas(depths, ctx.total_queued_requests or 0.0,
                              ctx.config.get_target_ongoing_requests(),
                              ctx.target_num_replicas)
    return wanted, {}
