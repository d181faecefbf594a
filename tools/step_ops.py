"""Ops one decode step builds: tqserve's slot cache against mlx-lm's caches.

    python -m tqserve.tools.step_ops [--model PATH] [--dtype float32] [--batch 8] [--out FILE]

Every op of a step's lazy graph is host work (building it) and, on a GPU, a kernel launch
or a view. For one decode step of the model this counts the primitives in the graph of
the logits and the updated KV (`mx.export_to_dot`), for a single row (tqserve's
RowSlotsKVCache vs mlx-lm's KVCache) and for --batch rows of equal and of uneven prompt
lengths (vs mlx-lm's BatchKVCache, the external reference: the engine keeps every batch in
slots). Exact and load-independent; the counts depend on the backend (on the CPU,
RMSNorm, RoPE and attention are decomposed into several ops each).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from tqserve.tools.bench import REPO_ROOT

PROMPT_TOKENS = 24  # the longest row's prompt; uneven rows are shorter by 0..batch-1


def num_ops(arrays: Sequence[Any]) -> int:
    """Primitives in the lazy graph of `arrays`."""
    import mlx.core as mx

    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return len(re.findall(r"shape=rectangle", dot.getvalue()))


def _rows(model: Any, lengths: Sequence[int]) -> list[list[Any]]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    rows = []
    for i, n in enumerate(lengths):
        cache = make_prompt_cache(model)
        model(mx.array([[(7 * i + j) % 500 + 2 for j in range(n)]]), cache=cache)
        mx.eval([c.state for c in cache])
        rows.append(cache)
    return rows


def decode_ops(model: Any, cache: list[Any], num_rows: int) -> int:
    """Ops of one decode step of `num_rows` rows on `cache` (evaluated beforehand)."""
    import mlx.core as mx

    mx.eval([a for c in cache for a in (c.keys, c.values)])
    logits = model(mx.array([[5]] * num_rows), cache=cache)[:, -1]
    return num_ops([logits, *[a for c in cache for a in (c.keys, c.values)]])


def measure(model: Any, batch: int) -> dict[str, dict[str, int]]:
    """{case: {"tqserve": ops, "mlx_lm": ops}} for B1, equal and uneven batches."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from tqserve.engine.kv.slots import slot_batch_of

    mx.eval(model.parameters())
    out = {}
    cases = {"single": [PROMPT_TOKENS], f"B{batch} equal": [PROMPT_TOKENS] * batch,
             f"B{batch} uneven": [PROMPT_TOKENS - i for i in range(batch)]}
    for name, lengths in cases.items():
        rows = _rows(model, lengths)
        layers = range(len(rows[0]))
        ours = [slot_batch_of([r[i] for r in rows]) for i in layers]  # RowSlotsKVCache
        theirs = rows[0] if len(rows) == 1 else [BatchKVCache.merge([r[i] for r in rows])
                                                  for i in layers]
        out[name] = {"tqserve": decode_ops(model, ours, len(rows)),
                     "mlx_lm": decode_ops(model, theirs, len(rows))}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Count, write JSON, print one line per case."""
    p = argparse.ArgumentParser(prog="python -m tqserve.tools.step_ops",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="models/pycoder-draft-4m", help="model dir")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--batch", type=int, default=8, help="rows of the batch cases (>= 2)")
    p.add_argument("--out", type=Path, default=Path("bench-out/step_ops.json"))
    args = p.parse_args(argv)
    if not 2 <= args.batch <= PROMPT_TOKENS - 1:
        p.error(f"--batch must be in [2, {PROMPT_TOKENS - 1}]")
    import mlx.core as mx

    from tqserve.engine.model import load_model

    in_repo = REPO_ROOT / args.model
    loaded = load_model(in_repo if in_repo.exists() else args.model, args.dtype)
    report = {"model": loaded.path.name, "dtype": loaded.dtype,
              "device": str(mx.default_device()), "ops": measure(loaded.model, args.batch)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for case, ops in report["ops"].items():
        print(f"{report['model']} {case}: tqserve {ops['tqserve']} ops, "
              f"mlx-lm {ops['mlx_lm']} ops")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
