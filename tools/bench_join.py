"""Cost of a row joining and a row retiring in the decode batch's KV, per cache kind:
tqserve's per-row slots (engine/kv/slots.py, turboquant.py, affine.py: write or move only that row),
and for plain KV also mlx-lm's right-aligned BatchKVCache (merge + extend, filter: copy
every row) as the reference. tqserve keeps no right-aligned batch of its own kinds any
more (one KV family), so TurboQuant and affine are measured on the slots side only.

    python -m tqserve.tools.bench_join [--kinds plain,tq-k4v4,affine-8] [--rows 8,32,64]
        [--context 1024] [--repeats 5] [--out FILE]

A batch of R rows (that had one more row, retired: the steady state) of --context
positions (pycoder-29m's KV shape per layer: 2 KV heads of 128, float32, 8 layers) takes
one joining row of --context positions, then retires one row from the middle; each
operation is evaluated (mx.eval) and timed alone; medians in ms.
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


KINDS = ("plain", "tq-k4v4", "affine-8")
SIDES = ("merge", "slots")  # mlx-lm's right-aligned batch caches, tqserve's slots


def sides_of(kind: str) -> tuple[str, ...]:
    """The sides measured for `kind`: mlx-lm has a right-aligned batch of plain KV only."""
    return SIDES if kind == "plain" else ("slots",)


def _row(kind: str, context: int) -> Any:
    """One single-row cache of `kind` holding `context` positions (evaluated)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from tqserve.engine.kv.affine import AffineKVCache
    from tqserve.engine.kv.turboquant import TurboQuantKVCache

    cache = {"plain": KVCache, "tq-k4v4": lambda: TurboQuantKVCache(4, 4, HEAD_DIM),
             "affine-8": lambda: AffineKVCache(8, 64)}[kind]()
    k = mx.random.normal((1, HEADS, context, HEAD_DIM))
    cache.update_and_fetch(k, k)
    mx.eval(_arrays(cache.state))
    return cache


def _arrays(tree: Any) -> list[Any]:
    import mlx.core as mx

    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [a for item in tree for a in _arrays(item)]
    return []


def _one(kind: str, side: str, rows: int, context: int) -> tuple[float, float]:
    from tqserve.engine.kv.slots import retire_order, slot_batch_of

    def batch_of(caches: list[Any]) -> Any:
        # "merge": KVCache.merge is mlx-lm's BatchKVCache (plain KV only, see sides_of)
        return slot_batch_of(caches) if side == "slots" else type(caches[0]).merge(caches)

    # R + 1 rows, the last retired: a batch that has had a row leave (steady state: the
    # slots keep that row's capacity, as they do after any retirement)
    layers = [batch_of([_row(kind, context) for _ in range(rows + 1)]) for _ in range(LAYERS)]
    for layer in layers:
        layer.filter(list(range(rows)))
    import mlx.core as mx
    mx.eval([_arrays(layer.state) for layer in layers])
    joiner = [_row(kind, context) for _ in range(LAYERS)]

    def join() -> list[Any]:
        for layer, row in zip(layers, joiner):
            layer.extend(row if side == "slots" else type(row).merge([row]))
        return [_arrays(layer.state) for layer in layers]

    def retire() -> list[Any]:
        keep = (retire_order(rows + 1, [rows // 2]) if side == "slots"
                else [i for i in range(rows + 1) if i != rows // 2])
        for layer in layers:
            layer.filter(keep)
        return [_arrays(layer.state) for layer in layers]

    return _timed(join), _timed(retire)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Medians per batch size and kind."""
    out: dict[str, Any] = {}
    kinds = args.kinds.split(",")
    for kind in kinds:
        for rows in [int(x) for x in args.rows.split(",")]:
            for side in sides_of(kind):
                runs = [_one(kind, side, rows, args.context) for _ in range(args.repeats)]
                out[f"{kind}_r{rows}_{side}"] = {
                    "join_ms": statistics.median(r[0] for r in runs),
                    "retire_ms": statistics.median(r[1] for r in runs)}
    return {"settings": {"kinds": kinds, "rows": args.rows, "context": args.context,
                         "repeats": args.repeats, "layers": LAYERS, "kv_heads": HEADS,
                         "head_dim": HEAD_DIM},
            "figures": out}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tqserve.tools.bench_join",
                                description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"cache kinds, comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--rows", default="8,32,64", help="batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=1024, help="positions of every row")
    p.add_argument("--repeats", type=int, default=5, help="runs per figure (median)")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_join.json"),
                   help="JSON results file")
    args = p.parse_args(argv)
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        p.error(f"--kinds: unknown {', '.join(sorted(unknown))} (known: {', '.join(KINDS)})")
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for key, fig in report["figures"].items():
        print(f"{key}: join {fig['join_ms']:.2f} ms, retire {fig['retire_ms']:.2f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
