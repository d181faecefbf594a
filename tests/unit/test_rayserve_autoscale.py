"""`--autoscale-metric queue` (api.rayserve.autoscale): the replicas Ray Serve is asked for,
from the engines' reported rows, decided synchronously. Ray's own objects (its context,
its policy config and the wrapper its controller applies) carry the decision, as in the
controller."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'tqserve[ray]'")

from ray.serve._private.common import DeploymentID, ReplicaID  # noqa: E402
from ray.serve.autoscaling_policy import _apply_autoscaling_config  # noqa: E402
from ray.serve.config import (AutoscalingConfig, AutoscalingContext,  # noqa: E402
                              AutoscalingPolicy)

from tqserve.api.rayserve.autoscale import (POLICY, QUEUE_METRIC,  # noqa: E402
                                            desired_replicas, queue_depth_policy)

DEPLOYMENT = DeploymentID(name="TqserveReplica", app_name="tqserve")
R1, R2 = (ReplicaID(unique_id=u, deployment_id=DEPLOYMENT) for u in ("r1", "r2"))


def test_replicas_keep_each_engine_at_the_target_depth():
    assert desired_replicas({R1: 6.0, R2: 2.0}, 0, 4, current=2) == 2
    assert desired_replicas({R1: 8.0, R2: 8.0}, 0, 4, current=2) == 4
    assert desired_replicas({R1: 8.0, R2: 8.0}, 3, 4, current=2) == 5  # + the fronts' queue
    assert desired_replicas({R1: 0.5, R2: 0.0}, 0, 4, current=2) == 1
    assert desired_replicas({R1: 0.0, R2: 0.0}, 0, 4, current=2) == 0  # Ray's bounds apply
    assert desired_replicas({}, 5, 4, current=2) == 2  # nothing reported yet: no change
    with pytest.raises(ValueError, match="target_depth"):
        desired_replicas({R1: 1.0}, 0, 0, current=1)


def _context(depths: dict, *, ongoing: float, queued: float, target: int = 4,
             current: int = 2) -> AutoscalingContext:
    config = AutoscalingConfig(min_replicas=1, max_replicas=6, target_ongoing_requests=target,
                               upscale_delay_s=0, downscale_delay_s=0,
                               policy=AutoscalingPolicy(policy_function=POLICY))
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name="tqserve",
        current_num_replicas=current, target_num_replicas=current,
        running_replicas=[R1, R2][:current], total_num_requests=ongoing,
        total_queued_requests=queued, aggregated_metrics={QUEUE_METRIC: depths},
        raw_metrics=None, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=6,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=0.0, config=config)


def test_the_policy_scales_on_engine_rows_not_on_ray_requests():
    """Two replicas whose engines hold 7.5 and 4.5 rows on average while Ray counts 4
    ongoing requests (one OpenAI request with `n` choices or a list of prompts is one Ray
    request and several rows), target 4 per replica: 3 replicas, where Ray's own policy
    asks for 1. The policy as Ray's controller deserializes it decides the same, and Ray's
    wrapper (bounds, delays, factors) passes it on."""
    ctx = _context({R1: 7.5, R2: 4.5}, ongoing=4, queued=0)
    assert queue_depth_policy(ctx) == (3, {})
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
    assert replica_queue_length_autoscaling_policy(ctx)[0] == 1  # 4 ongoing / 4 a replica
    controllers = AutoscalingPolicy(policy_function=POLICY).get_policy()
    assert controllers(ctx) == (3, {})
    decided, _ = _apply_autoscaling_config(controllers)(ctx)
    assert decided == 3
    # requests waiting in the fronts count; an idle pair scales down to Ray's minimum
    assert queue_depth_policy(_context({R1: 4.0, R2: 4.0}, ongoing=8, queued=5))[0] == 4
    assert _apply_autoscaling_config(controllers)(
        _context({R1: 0.0, R2: 0.0}, ongoing=0, queued=0))[0] == 1
    # no report yet (a replica just started): the target stays
    assert queue_depth_policy(_context({}, ongoing=9, queued=0))[0] == 2
