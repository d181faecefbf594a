"""Quantized weights kept packed vs dequantized at load: decode and prefill speed, memory.

    python -m tqserve.tools.bench_quant --model FILE.gguf|DIR [--model ...] [--dtype float32]
        [--steps 32] [--rounds 3] [--prompt-tokens 64] [--blas PATH] [--out FILE]

Each --model is loaded through engine.model.load_model once per --quantized-weights choice
that applies (keep and dequantize for a quantized model, one load for a float one): the
figures are the load seconds, the bytes of the model's parameters, prefill tok/s on a
prompt of --prompt-tokens ids and decode tok/s (one token per forward, a plain mlx-lm KV
cache, greedy). The variants run in turns, --rounds times, so that a busy machine slows
them alike; medians, and the best round's decode speed (the least disturbed by other
processes). Ratios (of medians) are against the first variant listed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import time
from typing import Any, Sequence

from tqserve.tools.bench import add_blas_flag, load_blas


def _variants(models: Sequence[str], dtype: str) -> list[dict[str, Any]]:
    from mlx.utils import tree_flatten

    from tqserve.engine.model import load_model

    out = []
    for path in models:
        for choice in ("keep", "dequantize"):
            start = time.perf_counter()
            loaded = load_model(path, dtype, choice)
            seconds = time.perf_counter() - start
            if loaded.quantized_weights == "none" and choice == "dequantize":
                break  # a float model: one variant
            nbytes = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
            out.append({"model": path, "weights": loaded.quantized_weights, "dtype": loaded.dtype,
                        "load_s": round(seconds, 2), "param_bytes": int(nbytes),
                        "loaded": loaded, "decode": [], "prefill": []})
    return out


def _round(v: dict[str, Any], prompt: list[int], steps: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    net = v["loaded"].model
    cache = make_prompt_cache(net)
    start = time.perf_counter()
    logits = net(mx.array(prompt)[None], cache=cache)
    token = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(token)
    v["prefill"].append(len(prompt) / (time.perf_counter() - start))
    start = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(net(token, cache=cache)[:, -1:], axis=-1)
        mx.eval(token)
    v["decode"].append(steps / (time.perf_counter() - start))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_quant", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", action="append", required=True,
                   help="model directory or GGUF file (repeat to compare several)")
    p.add_argument("--dtype", default="float32", help="dtype of every load")
    p.add_argument("--steps", type=int, default=32, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="turns of every variant")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prefill prompt length")
    p.add_argument("--out", default=None, help="write the JSON here too (default: stdout only)")
    add_blas_flag(p)
    args = p.parse_args(argv)
    blas_used = load_blas(args.blas)
    variants = _variants(args.model, args.dtype)
    text = "The capital of France is Paris. The capital of Germany is Berlin. " * 16
    for v in variants:
        ids = v["loaded"].tokenizer.encode(text)[:args.prompt_tokens]
        _round(v, ids, 2)  # warm-up
        v["decode"].clear()
        v["prefill"].clear()
        v["ids"] = ids
    for _ in range(args.rounds):
        for v in variants:
            _round(v, v["ids"], args.steps)
    rows = []
    for v in variants:
        decode, prefill = statistics.median(v["decode"]), statistics.median(v["prefill"])
        rows.append({k: v[k] for k in ("model", "weights", "dtype", "load_s", "param_bytes")}
                    | {"decode_tok_s": round(decode, 2), "decode_best_tok_s": round(max(v["decode"]), 2),
                       "prefill_tok_s": round(prefill, 1)})
    for row in rows:
        row["decode_ratio"] = round(row["decode_tok_s"] / rows[0]["decode_tok_s"], 3)
    machine = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
               "mlx": importlib.metadata.version("mlx"), "blas": blas_used}
    report = {"machine": machine, "steps": args.steps, "rounds": args.rounds, "rows": rows}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
