"""Memory the KV cache may use: the KV budget's default, the probe of a row's KV size, and
the bound on MLX's buffer cache.

`--kv-budget-bytes 0` (the default) means: KV_SHARE_HOST of the host memory available at
start on the CPU backend (MemAvailable; the model is loaded by then), KV_SHARE_DEVICE of
the device memory free at start on a GPU (CUDA's free memory; on Metal the recommended
working set less what MLX holds). MLX keeps freed buffers for reuse; every growth of the
slot store frees planes of a size never asked for again, so without a bound those buffers
piled up beside the KV (the measured 8.0 GB RSS for 3.2 GB of KV). `bound_buffer_cache`
caps that cache at BUFFER_CACHE_SHARE of the budget (at least BUFFER_CACHE_MIN).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from tqserve.engine.kv_budget import SLOT_STEP, KvBudget

KV_SHARE_HOST = 0.5     # the rest: prefix RAM tier, activations, the OS, other processes
KV_SHARE_DEVICE = 0.8   # after weights and warm-up; activations of a step take the rest
BUFFER_CACHE_SHARE = 0.125
BUFFER_CACHE_MIN = 256 << 20
log = logging.getLogger(__name__)


def available_memory() -> int:
    """Bytes free for new allocations now: device memory on a GPU, host memory else."""
    if mx.default_device() == mx.gpu:
        info: dict[str, Any] = dict(mx.device_info())
        if "free_memory" in info:  # CUDA
            return int(info["free_memory"])
        if "max_recommended_working_set_size" in info:  # Metal
            return max(0, int(info["max_recommended_working_set_size"])
                       - int(mx.get_active_memory()))
    return _host_available()


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def auto_kv_budget() -> int:
    """The default KV budget (module doc)."""
    share = KV_SHARE_DEVICE if mx.default_device() == mx.gpu else KV_SHARE_HOST
    return max(1, int(available_memory() * share))


def bound_buffer_cache(budget: int) -> int:
    """Cap MLX's buffer cache (module doc); returns the cap set."""
    cap = max(BUFFER_CACHE_MIN, int(budget * BUFFER_CACHE_SHARE))
    mx.set_cache_limit(cap)
    return cap


def kv_bytes_per_position(model: Any, make_cache: Callable[[Any], list[Any]] | None) -> int:
    """KV bytes one row holds per position, every layer: a fresh row's caches after one
    slot step of positions (one forward at start). Rows that stay plain before a
    --quantized-kv-start are charged at this, their plain, size."""
    cache = (make_cache or make_prompt_cache)(model)
    model(mx.zeros((1, SLOT_STEP), dtype=mx.uint32), cache=cache)
    mx.eval([c.state for c in cache])
    return max(1, -(-sum(c.nbytes for c in cache) // SLOT_STEP))


def kv_budget(loaded: Any, make_cache: Callable[[Any], list[Any]] | None, draft: Any, *,
              budget_bytes: int, mtp: bool, margin: int,
              per_position: int | None = None, preempt: bool = False) -> KvBudget:
    """The engine's KV budget (on the runner thread): what a row costs per position (the
    target's caches, or `per_position` as probed already; a draft model's; an MTP head's
    one layer) and the bytes allowed (`budget_bytes`, 0: `auto_kv_budget`); MLX's buffer
    cache is bounded to match."""
    if per_position is None:
        per_position = kv_bytes_per_position(loaded.model, make_cache)
    if draft is not None:
        per_position += kv_bytes_per_position(draft.model, make_prompt_cache)
    if mtp:
        per_position += -(-per_position // loaded.num_layers)
    budget = budget_bytes or auto_kv_budget()
    bound_buffer_cache(budget)
    log.info("KV budget %.1f MiB (%d bytes per position)", budget / 2**20, per_position)
    return KvBudget(budget_bytes=budget, bytes_per_position=per_position,
                    context=loaded.context_length, margin=margin, preempt=preempt)
