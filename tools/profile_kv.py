"""Where one decode layer's time goes: each piece of attention with plain, TurboQuant and
affine KV, timed in isolation on the current device.

    python -m tqserve.tools.profile_kv --contexts 8192,32768 --out bench-out/profile_kv.json

Each piece is called `--layers` times on distinct caches inside ONE evaluated graph, and
that is repeated; the median per-call time (host graph building, launches and device time
together) is reported in microseconds. Attention calls are chained as a model's layers
are (each call's query depends on the previous call's output, `q + 0 * out`; the chain's
own cost, measured alone, is subtracted): independent calls in one graph may run
concurrently on MLX-CUDA, which overlaps them (too fast a figure) and, for the TurboQuant
kernel, shares its split counters between concurrent launches (cuda_decode docstring). Shapes are one Qwen3-8B
layer: 32 query heads, 8 KV heads, head dim 128, bf16 queries, one row (--rows more).
Needs only MLX and engine/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence


def _time(fn: Callable[[int], Any], layers: int, repeats: int) -> float:
    import mlx.core as mx

    mx.eval([fn(i) for i in range(layers)])  # warm (JIT compiles)
    runs = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval([fn(i) for i in range(layers)])
        runs.append((time.perf_counter() - tic) / layers * 1e6)
    return statistics.median(runs)


def _time_chained(attend: Callable[[int, Any], Any], q: Any, layers: int,
                  repeats: int) -> float:
    """Per-call microseconds of `attend(i, query)` chained through the query as a model's
    layers are, less the cost of the chaining op itself."""
    import mlx.core as mx

    def chain(step: Callable[[int, Any], Any]) -> Any:
        x = q
        for i in range(layers):
            x = q + 0 * step(i, x)
        return x

    def timed(step: Callable[[int, Any], Any]) -> float:
        mx.eval(chain(step))  # warm (JIT compiles)
        runs = []
        for _ in range(repeats):
            tic = time.perf_counter()
            mx.eval(chain(step))
            runs.append((time.perf_counter() - tic) / layers * 1e6)
        return statistics.median(runs)

    return max(timed(attend) - timed(lambda i, x: x), 0.0)


def profile(context: int, rows: int, layers: int, repeats: int) -> dict[str, float]:
    """Microseconds per call of each piece at `context` positions."""
    import mlx.core as mx

    from tqserve.engine.attention import cuda_decode
    from tqserve.engine.attention import sdpa as attention
    from tqserve.engine.kv.affine import AffineKVCache
    from tqserve.engine.kv.turboquant import TurboQuantKVCache

    heads, kv_heads, d, dt = 32, 8, 128, mx.bfloat16
    scale = d ** -0.5
    ks = [mx.random.normal((rows, kv_heads, context, d), key=mx.random.key(i)).astype(dt)
          for i in range(layers)]
    mx.eval(ks)
    q = mx.random.normal((rows, heads, 1, d), key=mx.random.key(1)).astype(dt)
    new = mx.random.normal((rows, kv_heads, 1, d), key=mx.random.key(2)).astype(dt)
    out: dict[str, float] = {}
    out["plain sdpa"] = _time_chained(lambda i, x: mx.fast.scaled_dot_product_attention(
        x, ks[i], ks[i], scale=scale), q, layers, repeats)
    caches, fetched = [], []
    for k in ks:
        cache = TurboQuantKVCache(4, 4, d, decode="auto")
        cache.update_and_fetch(k, k)
        caches.append(cache)
        fetched.append(cache.update_and_fetch(new, new)[0])
        mx.eval(fetched[-1].key_codes, fetched[-1].key_norms, fetched[-1].value_codes,
                fetched[-1].value_norms)
    ks.clear()  # free the plain K/V before the quantized caches are timed
    codec, vcodec = fetched[0].key_codec, fetched[0].value_codec
    out["tq encode, codec graph (K+V)"] = _time(
        lambda i: (codec.encode(new), vcodec.encode(new)), layers, repeats)
    out["tq rotate q + unrotate out (mx ops)"] = _time(
        lambda i: vcodec.unrotate(codec.rotate(q.astype(mx.float32))).astype(dt),
        layers, repeats)
    out["tq attention, compiled ops"] = _with_env(
        cuda_decode.KERNEL_ENV, "0", lambda: _time_chained(
            lambda i, x: attention._fused_attention(x, fetched[i], scale), q, layers, repeats))
    if cuda_decode.available(d, heads // kv_heads):
        out["tq encode kernel (K+V)"] = _time(
            lambda i: cuda_decode.encode(new, new, codec, vcodec), layers, repeats)
        out["tq attention kernel"] = _time_chained(
            lambda i, x: cuda_decode.decode_attention(x, fetched[i], scale), q, layers, repeats)
        out["tq layer: encode + append + attention"] = _time_chained(
            lambda i, x: attention._fused_attention(
                x, caches[i].update_and_fetch(new, new)[0], scale), q, layers, repeats)
    caches.clear()
    fetched.clear()
    affine = AffineKVCache(8, 64)
    filler = mx.random.normal((rows, kv_heads, context, d), key=mx.random.key(3)).astype(dt)
    affine.update_and_fetch(filler, filler)
    ak, av = affine.update_and_fetch(new, new)
    mx.eval(ak, av)
    out["affine8 dequantize + sdpa"] = _time_chained(
        lambda i, x: attention.affine_sdpa(x, ak, av, scale, None, 64, 8), q, layers, repeats)
    return out


def _with_env(name: str, value: str, fn: Callable[[], Any]) -> Any:
    import os

    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="profile_kv", description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                   default=[8192, 32768])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench-out/profile_kv.json"))
    args = p.parse_args(argv)
    if min(args.contexts) < 1 or args.rows < 1 or args.layers < 1 or args.repeats < 1:
        p.error("--contexts, --rows, --layers and --repeats must be positive")
    import mlx.core as mx

    report = {"device": str(mx.default_device()), "rows": args.rows, "layers": args.layers,
              "us_per_call": {str(c): profile(c, args.rows, args.layers, args.repeats)
                              for c in args.contexts}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for c, pieces in report["us_per_call"].items():
        for name, us in pieces.items():
            print(f"{c:>7} {name:<42} {us:9.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
