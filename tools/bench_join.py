"""Cost of a row joining and a row retiring in the decode batch's plain KV: mlx-lm's
BatchKVCache (merge + extend, filter: copies every row) vs tqserve's RowSlotsKVCache
(writes or moves only that row).

    python -m tqserve.tools.bench_join [--rows 8,32,64] [--context 1024] [--repeats 5] [--out FILE]

A batch of R rows (that had one more row, retired: the steady state) of --context positions (pycoder-29m's KV shape per layer: 2 KV heads of
128, float32, 8 layers) takes one joining row of --context positions, then retires one row
from the middle; each operation is evaluated (mx.eval) and timed alone; medians in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

LAYERS, HEADS, HEAD_DIM = 8, 2, 128


def _timed(fn: Callable[[], list[Any]]) -> float:
    import mlx.core as mx

    start = time.perf_counter()
    mx.eval(fn())
    return 1000 * (time.perf_counter() - start)


def _row(context: int) -> Any:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    k = mx.random.normal((1, HEADS, context, HEAD_DIM))
    cache.update_and_fetch(k, k)
    mx.eval(cache.keys, cache.values)
    return cache


def _one(kind: str, rows: int, context: int) -> tuple[float, float]:
    from mlx_lm.models.cache import BatchKVCache

    from tqserve.engine.kv.slots import RowSlotsKVCache, retire_order

    batch_cls: Any = BatchKVCache if kind == "batch_kv_cache" else RowSlotsKVCache
    # R + 1 rows, the last retired: a batch that has had a row leave (steady state: the
    # slots keep that row's capacity, as they do after any retirement)
    layers = [batch_cls.merge([_row(context) for _ in range(rows + 1)]) for _ in range(LAYERS)]
    for layer in layers:
        layer.filter(list(range(rows)))
    import mlx.core as mx
    mx.eval([a for layer in layers for a in (layer.keys, layer.values)])
    joiner = [_row(context) for _ in range(LAYERS)]

    def join() -> list[Any]:
        for layer, row in zip(layers, joiner):
            layer.extend(BatchKVCache.merge([row]) if kind == "batch_kv_cache" else row)
        return [a for layer in layers for a in (layer.keys, layer.values)]

    def retire() -> list[Any]:
        keep = (retire_order(rows + 1, [rows // 2]) if kind == "slots"
                else [i for i in range(rows + 1) if i != rows // 2])
        for layer in layers:
            layer.filter(keep)
        return [a for layer in layers for a in (layer.keys, layer.values)]

    return _timed(join), _timed(retire)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Medians per batch size and kind."""
    out: dict[str, Any] = {}
    for rows in [int(x) for x in args.rows.split(",")]:
        for kind in ("batch_kv_cache", "slots"):
            runs = [_one(kind, rows, args.context) for _ in range(args.repeats)]
            out[f"r{rows}_{kind}"] = {"join_ms": statistics.median(r[0] for r in runs),
                                      "retire_ms": statistics.median(r[1] for r in runs)}
    return {"settings": {"rows": args.rows, "context": args.context, "repeats": args.repeats,
                         "layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM},
            "figures": out}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tqserve.tools.bench_join",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="8,32,64", help="batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=1024, help="positions of every row")
    p.add_argument("--repeats", type=int, default=5, help="runs per figure (median)")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_join.json"),
                   help="JSON results file")
    args = p.parse_args(argv)
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for key, fig in report["figures"].items():
        print(f"{key}: join {fig['join_ms']:.2f} ms, retire {fig['retire_ms']:.2f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
