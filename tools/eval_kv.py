"""Quality of quantized KV caches: perplexity and KL of next-token distributions.

    python -m tqserve.tools.eval_kv [--model ../shared/models/pycoder-29m] [--dtype float32]
        [--contexts 512,2048] [--score-tokens 256] [--windows 4] [--out FILE] [--plot FILE]

Reference: the plain mlx-lm KVCache in the model dtype of the run (float32 by default; the
issue's "bf16 cache" where the model runs in bf16). Schemes: TurboQuant (the engine.kv
factory, as serving builds it, attention port installed) and affine (mlx-lm's
QuantizedKVCache, group size 64, whose attention mlx-lm dispatches itself).

Method. Held-out text: mlx-lm's installed source (HELD_OUT), each file tokenized and ended
with EOS as in training. --windows windows of max(contexts) + score_tokens + 1 tokens,
spread evenly over it. Each window is fed through the model once per scheme in chunks of
--chunk tokens (also cut at every context C and C + score_tokens): each chunk attends over
the cache's stored (quantized) history and its own encoded K/V, as a quantized prefill
does. At positions [C, C + score_tokens) of each context C the float32 log-softmax is kept;
per position KL(plain || scheme) = sum p (log p - log q) and the NLL of the true next
token. Per scheme and context: mean and max KL over all scored positions, ppl =
exp(mean NLL) and ppl_change = ppl / plain ppl - 1.
Storage, bytes per token per layer (K and V, all KV heads): plain d * itemsize per vector;
TurboQuant d * bits / 8 + 2 (fp16 norm); affine d * bits / 8 + 2 * (d / 64) * itemsize
(scale and bias in the model dtype, as mlx-lm stores them). stored_bits_per_value is that
over the values held; bits_per_value is the nominal width.
Codec table: MSE of TurboQuantCodec on random unit vectors (d = 128) at 1..4 bits beside
the exact Lloyd-Max value, the paper's Theorem 1 figures and the lower bound 4^-b.
Plot: mean KL (log scale) vs stored bits per value, one line per family and context
(TurboQuant blue, affine orange, lighter for shallower contexts), drawn by the built-in
PNG writer below (numpy raster, zlib + struct, 3x5 bitmap font): no matplotlib needed.
On the CPU backend, run with an optimized BLAS (LD_PRELOAD=/usr/lib/x86_64-linux-gnu/
openblas-pthread/libblas.so.3): MLX's reference BLAS is ~30x slower. The JSON records it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import struct
import sys
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from tqserve.engine.codec.turboquant import TurboQuantCodec
from tqserve.engine.attention import install_attention
from tqserve.engine.kv import make_turboquant_cache_factory, parse_turboquant
from tqserve.engine.model import load_model

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "../shared/models/pycoder-29m"
HELD_OUT = ("generate.py", "models/cache.py", "utils.py")
AFFINE_GROUP = 64
PAPER_MSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}
RGB = tuple[int, int, int]


@dataclass(frozen=True)
class Scheme:
    """One KV cache under test: family "plain", "turboquant" or "affine", and its bits."""

    name: str
    family: str
    k_bits: int = 0
    v_bits: int = 0

    def make(self, model: Any, seed: int) -> list[Any]:
        """A fresh per-layer cache list for `model`."""
        if self.family == "turboquant":
            return make_turboquant_cache_factory(self.k_bits, self.v_bits, seed=seed)(model)
        plain = make_prompt_cache(model)
        if self.family == "affine":
            return [QuantizedKVCache(AFFINE_GROUP, self.k_bits) for _ in plain]
        return plain

    def bytes_per_token(self, kv_heads: int, head_dim: int, itemsize: int) -> int:
        """Stored bytes of one token's K and V in one layer (see the module doc)."""
        if self.family == "turboquant":
            return kv_heads * ((self.k_bits + self.v_bits) * head_dim // 8 + 4)
        if self.family == "affine":
            scales = 2 * (head_dim // AFFINE_GROUP) * itemsize
            return 2 * kv_heads * (head_dim * self.k_bits // 8 + scales)
        return 2 * kv_heads * head_dim * itemsize


def make_schemes(turboquant: Sequence[str], affine: Sequence[int]) -> list[Scheme]:
    """The plain reference first, then TurboQuant specs ("k4v4") and affine bit widths."""
    tq = [Scheme(s, "turboquant", *parse_turboquant(s)) for s in turboquant]
    return [Scheme("plain", "plain"), *tq, *(Scheme(f"affine{b}", "affine", b, b) for b in affine)]


def held_out_tokens(tokenizer: Any) -> list[int]:
    """Token ids of mlx-lm's installed HELD_OUT source files, each followed by EOS."""
    root = Path(mlx_lm.__file__).parent
    return [t for name in HELD_OUT
            for t in (*tokenizer.encode((root / name).read_text()), tokenizer.eos_token_id)]


def score_pass(model: Any, cache: list[Any], tokens: Sequence[int], contexts: Sequence[int],
               score_tokens: int, chunk: int) -> dict[int, mx.array]:
    """Float32 log-probs (score_tokens, vocab) at positions [C, C + score_tokens) per C."""
    end = max(contexts) + score_tokens
    cuts = sorted({*range(0, end, chunk), *contexts, *(c + score_tokens for c in contexts), end})
    kept: dict[int, list[mx.array]] = {c: [] for c in contexts}
    for a, b in zip(cuts, cuts[1:]):
        logits = model(mx.array([tokens[a:b]]), cache=cache)[0].astype(mx.float32)
        for c in contexts:
            lo, hi = max(a, c), min(b, c + score_tokens)
            if lo < hi:
                part = logits[lo - a:hi - a]
                kept[c].append(part - mx.logsumexp(part, axis=-1, keepdims=True))
        mx.eval(logits, kept)
    return {c: mx.concatenate(parts) for c, parts in kept.items()}


def evaluate(model: Any, tokens: Sequence[int], schemes: Sequence[Scheme],
             contexts: Sequence[int], score_tokens: int, windows: int, chunk: int,
             seed: int) -> dict[str, Any]:
    """Per scheme: seconds and, per context, ppl, ppl_change, mean/max KL vs plain."""
    span, stride = max(contexts) + score_tokens + 1, len(tokens) // windows
    if stride < span:
        raise ValueError(f"{len(tokens)} held-out tokens cannot hold {windows} windows of {span}")
    kls: dict[tuple[str, int], list[np.ndarray]] = defaultdict(list)
    nlls: dict[tuple[str, int], list[np.ndarray]] = defaultdict(list)
    seconds = {s.name: 0.0 for s in schemes}
    for w in range(windows):
        window = list(tokens[w * stride:w * stride + span])
        reference: dict[int, mx.array] = {}
        for scheme in schemes:  # plain first: it is the reference
            start = time.perf_counter()
            out = score_pass(model, scheme.make(model, seed), window, contexts, score_tokens,
                             chunk)
            seconds[scheme.name] += time.perf_counter() - start
            reference = reference or out
            for c in contexts:
                ref, test = reference[c], out[c]
                targets = mx.array(window[c + 1:c + score_tokens + 1])[:, None]
                kls[scheme.name, c].append(np.array(mx.sum(mx.exp(ref) * (ref - test), -1)))
                nlls[scheme.name, c].append(-np.array(mx.take_along_axis(test, targets, -1)))
        print(f"window {w + 1}/{windows} done, {sum(seconds.values()):.0f} s", file=sys.stderr)

    def summary(name: str, c: int) -> dict[str, float]:
        kl = np.concatenate(kls[name, c])
        ppl, plain = (math.exp(float(np.concatenate(nlls[n, c]).mean())) for n in (name, "plain"))
        return {"ppl": ppl, "ppl_change": ppl / plain - 1, "mean_kl": float(kl.mean()),
                "max_kl": float(kl.max()), "positions": int(kl.size)}

    return {s.name: {"seconds": seconds[s.name],
                     "contexts": {str(c): summary(s.name, c) for c in contexts}}
            for s in schemes}


def codec_table(num_vectors: int, seed: int, head_dim: int = 128) -> list[dict[str, float]]:
    """TurboQuant MSE on random unit vectors at 1..4 bits vs Lloyd-Max, paper and 4^-b."""
    x = np.random.default_rng(seed).standard_normal((num_vectors, head_dim))
    units = mx.array(x / np.linalg.norm(x, axis=-1, keepdims=True), dtype=mx.float32)
    rows = []
    for bits in range(1, 5):
        codec = TurboQuantCodec(head_dim, bits, seed=seed)
        error = mx.mean(mx.sum(mx.square(units - codec.decode(codec.encode(units))), axis=-1))
        rows.append({"bits": bits, "measured_mse": float(np.array(error)),
                     "lloyd_max_mse": codec.codebook.distortion, "paper_mse": PAPER_MSE[bits],
                     "lower_bound": 4.0 ** -bits})
    return rows


_FONT = {e[0]: int(e[2:], 2) for e in (  # 3x5 glyphs, rows top to bottom
    "0:111101101101111 1:010110010010111 2:111001111100111 3:111001111001111 4:101101111001001 "
    "5:111100111001111 6:111100111101111 7:111001001001001 8:111101111101111 9:111101111001111 "
    "-:000000111000000 .:000000000000010 A:010101111101101 B:110101110101110 C:011100100100011 "
    "D:110101101101110 E:111100110100111 F:111100110100100 G:011100101101011 H:101101111101101 "
    "I:111010010010111 K:101101110101101 L:100100100100111 M:101111111101101 N:110101101101101 "
    "O:010101101101010 P:110101110100100 Q:010101101110011 R:110101110101101 S:011100010001110 "
    "T:111010010010010 U:101101101101111 V:101101101101010 X:101101010101101 Y:101101010010010"
).split()}


class Canvas:
    """A white RGB raster with rectangles, lines and 3x5-font text, saved as PNG."""

    def __init__(self, width: int, height: int) -> None:
        self.pixels = np.full((height, width, 3), 255, dtype=np.uint8)

    def rect(self, x: float, y: float, w: int, h: int, rgb: RGB) -> None:
        """Fill the w x h rectangle whose top-left corner is (x, y), clipped."""
        x0, y0 = int(round(x)), int(round(y))
        self.pixels[max(y0, 0):max(y0 + h, 0), max(x0, 0):max(x0 + w, 0)] = rgb

    def line(self, p: tuple[float, float], q: tuple[float, float], rgb: RGB,
             width: int = 1) -> None:
        """A straight line from p to q."""
        steps = int(max(abs(q[0] - p[0]), abs(q[1] - p[1]))) + 1
        for t in np.linspace(0.0, 1.0, steps + 1):
            self.rect(p[0] + t * (q[0] - p[0]), p[1] + t * (q[1] - p[1]), width, width, rgb)

    def text(self, x: float, y: float, s: str, scale: int = 2) -> None:
        """Black text, uppercased; characters outside the font are blank."""
        for i, ch in enumerate(s.upper()):
            for bit in range(15):
                if _FONT.get(ch, 0) >> (14 - bit) & 1:
                    self.rect(x + (4 * i + bit % 3) * scale, y + bit // 3 * scale, scale, scale,
                              (0, 0, 0))

    def save(self, path: Path) -> None:
        """Write an 8-bit RGB PNG (one IDAT, filter 0 on every row)."""
        height, width, _ = self.pixels.shape
        rows = np.concatenate([np.zeros((height, 1), np.uint8),
                               self.pixels.reshape(height, -1)], axis=1)
        chunks = [(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)),
                  (b"IDAT", zlib.compress(rows.tobytes(), 9)), (b"IEND", b"")]
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"".join(
            struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
            for t, d in chunks))


def plot_kl(report: dict[str, Any], path: Path) -> None:
    """PNG of mean KL (log) vs stored bits per value, per family and context."""
    contexts = sorted(report["settings"]["contexts"], reverse=True)
    series: list[tuple[str, RGB, list[tuple[float, float]]]] = []
    for family, base in (("turboquant", (31, 119, 180)), ("affine", (230, 110, 0))):
        for i, c in enumerate(contexts):
            fade = 0.55 * i / max(len(contexts) - 1, 1)
            r, g, b = (int(v + (255 - v) * fade) for v in base)
            pts = sorted((s["stored_bits_per_value"], max(s["contexts"][str(c)]["mean_kl"], 1e-12))
                         for s in report["schemes"].values() if s["family"] == family)
            series += [(f"{family} ctx {c}", (r, g, b), pts)] if pts else []
    logs = [math.log10(y) for *_, pts in series for _, y in pts]
    xs = [x for *_, pts in series for x, _ in pts]
    x_lo, x_hi = math.floor(min(xs)) - 1, math.ceil(max(xs)) + 1
    y_lo, y_hi = math.floor(min(logs)), max(math.ceil(max(logs)), math.floor(min(logs)) + 1)
    canvas, left, top, right, bottom = Canvas(780, 460), 80, 40, 540, 400

    def at(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x_lo) / (x_hi - x_lo) * (right - left),
                bottom - (math.log10(y) - y_lo) / (y_hi - y_lo) * (bottom - top))

    for e in range(y_lo, y_hi + 1):
        y = at(x_lo, 10.0 ** e)[1]
        canvas.line((left, y), (right, y), (220, 220, 220))
        canvas.text(left - 8 * len(f"1E{e}") - 8, y - 5, f"1E{e}")
    for x in range(x_lo, x_hi + 1):
        canvas.line((at(x, 1)[0], bottom), (at(x, 1)[0], bottom + 5), (0, 0, 0))
        canvas.text(at(x, 1)[0] - 3, bottom + 10, str(x))
    canvas.line((left, top), (left, bottom), (0, 0, 0))
    canvas.line((left, bottom), (right, bottom), (0, 0, 0))
    m = report["model"]
    canvas.text(left, 12, f"{m['name']} {m['dtype']}  mean KL vs plain cache  log scale")
    canvas.text((left + right) / 2 - 84, bottom + 32, "stored bits per value")
    for i, (label, rgb, pts) in enumerate(series):
        pixels = [at(x, y) for x, y in pts]
        for p, q in zip(pixels, pixels[1:]):
            canvas.line(p, q, rgb, width=2)
        for px, py in pixels:
            canvas.rect(px - 4, py - 4, 9, 9, rgb)
        canvas.rect(right + 20, top + 20 * i, 12, 12, rgb)
        canvas.text(right + 38, top + 20 * i + 1, label)
    canvas.save(path)


def targets(schemes: dict[str, Any], contexts: Sequence[int]) -> dict[str, Any]:
    """The issue's targets that this run's schemes can decide, per context."""
    out: dict[str, Any] = {}
    if "k8v8" in schemes:
        out["k8v8_ppl_within_0.5pct"] = {
            str(c): abs(schemes["k8v8"]["contexts"][str(c)]["ppl_change"]) <= 0.005
            for c in contexts}
    for b in (4, 3):
        tq, aff = schemes.get(f"k{b}v{b}"), schemes.get(f"affine{b}")
        if tq and aff:
            out[f"k{b}v{b}_kl_below_affine{b}"] = {
                str(c): tq["contexts"][str(c)]["mean_kl"] < aff["contexts"][str(c)]["mean_kl"]
                for c in contexts}
    return out


def format_table(report: dict[str, Any]) -> str:
    """Schemes by context, the codec table and the targets as fixed-width text."""
    m, st = report["model"], report["settings"]
    lines = [f"{m['name']} {m['dtype']}; reference: {st['reference']}; {st['windows']} windows x "
             f"{st['score_tokens']} scored tokens per context",
             f"{'ctx':>5} {'scheme':<9}{'bits':>5}{'stored':>7}{'B/tok/layer':>12}{'ppl':>9}"
             f"{'dppl %':>9}{'mean KL':>11}{'max KL':>10}"]
    for c in st["contexts"]:
        for name, s in report["schemes"].items():
            r = s["contexts"][str(c)]
            lines.append(f"{c:>5} {name:<9}{s['bits_per_value']:>5.1f}"
                         f"{s['stored_bits_per_value']:>7.2f}{s['bytes_per_token_per_layer']:>12}"
                         f"{r['ppl']:>9.4f}{100 * r['ppl_change']:>+9.3f}{r['mean_kl']:>11.2e}"
                         f"{r['max_kl']:>10.2e}")
    lines.append(f"codec MSE, d=128 unit vectors\n{'bits':>4}{'measured':>10}{'lloyd-max':>11}"
                 f"{'paper':>8}{'4^-b':>9}")
    lines += [f"{r['bits']:>4}{r['measured_mse']:>10.4f}{r['lloyd_max_mse']:>11.4f}"
              f"{r['paper_mse']:>8.3f}{r['lower_bound']:>9.4f}" for r in report["codec"]]
    return "\n".join(lines + [f"target {k}: {v}" for k, v in report["targets"].items()])


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the evaluation, write the --out JSON and --plot PNG, print the table."""
    p = argparse.ArgumentParser(prog="tqserve eval-kv", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model dir, relative to the repo root")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="model dtype")
    p.add_argument("--contexts", type=_ints, default=[512, 2048], help="scoring depths")
    p.add_argument("--score-tokens", type=int, default=256, help="scored positions per depth")
    p.add_argument("--windows", type=int, default=4, help="text windows scored")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward pass")
    p.add_argument("--turboquant", default="k8v8,k8v3,k4v4,k3v3", help="TurboQuant specs")
    p.add_argument("--affine", type=_ints, default=[8, 4, 3], help="affine bit widths")
    p.add_argument("--codec-vectors", type=int, default=16384, help="unit vectors, codec table")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the TurboQuant rotations and codec-table vectors")
    p.add_argument("--out", type=Path, default=Path("bench-out/eval_kv.json"),
                   help="JSON results file")
    p.add_argument("--plot", type=Path, default=Path("bench-out/eval_kv_kl.png"),
                   help="PNG plot of KL by bits")
    args = p.parse_args(argv)

    loaded = load_model(REPO_ROOT / args.model, args.dtype)
    install_attention()
    schemes = make_schemes([s for s in args.turboquant.split(",") if s], args.affine)
    tokens = held_out_tokens(loaded.tokenizer)
    results = evaluate(loaded.model, tokens, schemes, args.contexts, args.score_tokens,
                       args.windows, args.chunk, args.seed)
    kv_heads, head_dim = int(loaded.model.layers[0].self_attn.n_kv_heads), loaded.head_dims[0]
    itemsize = getattr(mx, loaded.dtype).size
    for s in schemes:
        size = s.bytes_per_token(kv_heads, head_dim, itemsize)
        results[s.name] = {"family": s.family, "k_bits": s.k_bits, "v_bits": s.v_bits,
                           "bits_per_value": (s.k_bits + s.v_bits) / 2 or 8.0 * itemsize,
                           "stored_bits_per_value": size * 8 / (2 * kv_heads * head_dim),
                           "bytes_per_token_per_layer": size, **results[s.name]}
    report = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "mlx": importlib.metadata.version("mlx"),
                    "mlx_lm": importlib.metadata.version("mlx-lm"),
                    "device": str(mx.default_device()), "ld_preload": os.environ.get(
                        "LD_PRELOAD", "")},
        "model": {"name": loaded.path.name, "path": str(loaded.path), "dtype": loaded.dtype,
                  "fingerprint": loaded.fingerprint, "num_layers": loaded.num_layers,
                  "kv_heads": kv_heads, "head_dim": head_dim},
        "settings": {"contexts": args.contexts, "score_tokens": args.score_tokens,
                     "windows": args.windows, "chunk": args.chunk, "seed": args.seed,
                     "held_out": [f"mlx_lm/{n}" for n in HELD_OUT],
                     "held_out_tokens": len(tokens), "affine_group_size": AFFINE_GROUP,
                     "reference": f"plain mlx-lm KVCache in {loaded.dtype}",
                     "codec_vectors": args.codec_vectors, "plot": str(args.plot)},
        "schemes": results,
        "codec": codec_table(args.codec_vectors, args.seed),
        "targets": targets(results, args.contexts),
    }
    for path in (args.out, args.plot):
        path.parent.mkdir(parents=True, exist_ok=True)
    plot_kl(report, args.plot)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
