"""Compare TurboQuant rotations ("qr" vs "hadamard") on a real model's K and V vectors.

Runs text the model was not trained on (mlx-lm's own generate.py) through the model with a
plain KV cache, takes every layer's keys and values, and reports per rotation and bit width
the relative MSE of encode/decode (mean ||x - x^||^2 / ||x||^2, the paper's D_mse) beside
the codebook's expected value, and encode+decode throughput on the default device.

    python -m tqserve.tools.codec_rotation --out rotation.json [--model PATH] [--tokens 512]

The CPU backend's speed depends on the BLAS MLX finds (the "qr" rotation is a matmul); the
JSON records LD_PRELOAD so figures with and without an optimized BLAS are not confused.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import time
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from tqserve.engine.codec.turboquant import DEFAULT_ROTATION, ROTATIONS, TurboQuantCodec

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "../shared/models/pycoder-29m"


def collect_kv(model_path: Path, num_tokens: int) -> tuple[mx.array, mx.array, int]:
    """Keys and values of every layer and head as (N, head_dim) float32, and tokens used."""
    loaded = mlx_lm.load(str(model_path))
    model, tokenizer = loaded[0], loaded[1]
    model.set_dtype(mx.float32)
    spec = importlib.util.find_spec("mlx_lm.generate")
    if spec is None or spec.origin is None:
        raise RuntimeError("mlx_lm.generate source not found")
    text = Path(spec.origin).read_text()
    tokens = tokenizer.encode(text)[:num_tokens]
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=cache))
    keys = [c.keys[..., : c.offset, :] for c in cache]
    values = [c.values[..., : c.offset, :] for c in cache]
    head_dim = keys[0].shape[-1]
    flat_keys = mx.concatenate([k.reshape(-1, head_dim) for k in keys])
    flat_values = mx.concatenate([v.reshape(-1, head_dim) for v in values])
    return flat_keys, flat_values, len(tokens)


def relative_mse(codec: TurboQuantCodec, x: mx.array) -> float:
    """Mean over vectors of ||x - decode(encode(x))||^2 / ||x||^2."""
    error = mx.sum(mx.square(x - codec.decode(codec.encode(x))), axis=-1)
    return cast(float, mx.mean(error / mx.sum(mx.square(x), axis=-1)).item())


def throughput(codec: TurboQuantCodec, x: mx.array, repeats: int) -> float:
    """Vectors per second through encode then decode (after one warm-up pass)."""
    mx.eval(codec.decode(codec.encode(x)))
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(codec.decode(codec.encode(x)))
    return x.shape[0] * repeats / (time.perf_counter() - start)


def main() -> None:
    """Measure both rotations and write the figures as JSON to --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON output path")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model path, relative to repo root")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of text to run")
    parser.add_argument("--bits", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="timed encode+decode passes")
    args = parser.parse_args()

    keys, values, num_tokens = collect_kv(REPO_ROOT / args.model, args.tokens)
    head_dim = keys.shape[-1]
    vectors_per_token = (keys.shape[0] + values.shape[0]) // num_tokens
    both = mx.concatenate([keys, values])
    results = []
    for rotation in ROTATIONS:
        for bits in args.bits:
            codec = TurboQuantCodec(head_dim, bits, seed=args.seed, rotation=rotation)
            vectors_per_s = throughput(codec, both, args.repeats)
            results.append(
                {
                    "rotation": rotation,
                    "bits": bits,
                    "key_relative_mse": relative_mse(codec, keys),
                    "value_relative_mse": relative_mse(codec, values),
                    "expected_mse": codec.codebook.distortion,
                    "encode_decode_vectors_per_s": vectors_per_s,
                    "encode_decode_tokens_per_s": vectors_per_s / vectors_per_token,
                }
            )
            print(json.dumps(results[-1]))
    report = {
        "model": args.model,
        "num_tokens": num_tokens,
        "head_dim": head_dim,
        "vectors_per_token": vectors_per_token,
        "num_vectors": both.shape[0],
        "dtype": "float32",
        "device": str(mx.default_device()),
        "mlx_version": importlib.metadata.version("mlx"),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "default_rotation": DEFAULT_ROTATION,
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
