"""What prompt lookup costs per proposing row and step: the speculation actor's index,
the runner's numpy pass and a plain Python scan of the same definition, on one context
each.

    python -m tqserve.tools.bench_lookup [--contexts 512,4096,16384] [--vocabs 32000,50]
                                         [--k 4] [--repeats 20] [--out FILE]

For each context length and vocabulary: random tokens (a 32,000-token vocabulary rarely
matches the tail, the scan's worst case; a 50-token one matches early, like code), the
median seconds of one `lookup_tokens(context, k)` call (engine.speculative.lookup: what
the runner computes where the actor made no proposal) and of `scan_lookup`, their ratio;
the index's (`LookupIndex`): building it from the context (once per row, when it opens)
and one step (one token appended, one proposal); and a check that all three propose the
same tokens. A row's per-step figure times the batch is host time between two steps.
CPU only, no MLX; prints JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from typing import Any, Callable, Sequence

from tqserve.engine.speculative.lookup import LookupIndex, LookupSettings, lookup_tokens


def scan_lookup(context: Sequence[int], k: int, s: LookupSettings) -> tuple[int, ...]:
    """The definition, scanned in plain Python: the longest n-gram tail first, then its
    most recent earlier start (what lookup_tokens computed before it used numpy)."""
    for n in range(min(s.max_ngram, len(context) - 1), s.min_ngram - 1, -1):
        tail = list(context[len(context) - n:])
        for start in range(len(context) - n - 1, -1, -1):
            if list(context[start:start + n]) == tail:
                return tuple(int(t) for t in context[start + n:start + n + k])
    return ()


def _median_seconds(call: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        call()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def measure(length: int, vocab: int, k: int, repeats: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    context = [rng.randrange(vocab) for _ in range(length)]
    settings = LookupSettings()
    numpy_s = _median_seconds(lambda: lookup_tokens(context, k, settings), repeats)
    scan_s = _median_seconds(lambda: scan_lookup(context, k, settings), repeats)
    build_s = _median_seconds(lambda: LookupIndex(context, settings), repeats)
    index = LookupIndex(context, settings)
    same = lookup_tokens(context, k, settings) == scan_lookup(context, k, settings) == (
        index.propose(k))

    def step() -> None:  # one token appended, one proposal
        index.extend((rng.randrange(vocab),))
        index.propose(k)

    step_s = _median_seconds(step, repeats)
    return {"context": length, "vocab": vocab, "numpy_ms": numpy_s * 1e3,
            "python_scan_ms": scan_s * 1e3, "scan_over_numpy": scan_s / numpy_s,
            "index_build_ms": build_s * 1e3, "index_step_ms": step_s * 1e3,
            "numpy_over_index_step": numpy_s / step_s, "same_proposal": same}


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tqserve.tools.bench_lookup",
                                description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=_ints, default=[512, 4096, 16384])
    p.add_argument("--vocabs", type=_ints, default=[32000, 50])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.k < 1 or args.repeats < 1:
        p.error("--k and --repeats must be >= 1")
    report = {"machine": platform.machine(), "processor": platform.processor(),
              "k": args.k, "repeats": args.repeats,
              "rows": [measure(n, v, args.k, args.repeats)
                       for n in args.contexts for v in args.vocabs]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
