"""Start-up recovery of the SSD tier: seconds and bytes read for N snapshot files.

    python -m tqserve.tools.bench_recovery [--files 1000] [--file-kb 850] [--repeats 3] [--out FILE]
    python -m tqserve.tools.bench_recovery --engine [--files 1000] [--tokens 900] [--repeats 3]

Writes N snapshot files of about --file-kb KiB each (random, incompressible planes: KV
bytes compress little) with SsdTier.put into a fresh private directory, then times
`SsdTier(directory).recover()` on a new tier R times (median): the work a restart does
before the server can answer. Reports the tier's own count of bytes read
(`num_bytes_read`, when the storage code has it) against the bytes on disk. Files are
read through the page cache (just written: warm), so the figure is CPU and syscall cost,
not the disk's. Only storage/ is imported: point PYTHONPATH at another checkout's tree
and run this file as a script to time that checkout's recovery.

`--engine` times what a user waits for instead: a whole engine start (`open_engine` with
the bundled model already loaded, float32) over N real snapshot files of --tokens tokens
each. One real snapshot is made by serving a prompt, then copied under N distinct random
token sequences (nothing shared: the prefix index's worst case). The figure is the seconds
from `open_engine` being entered to the engine accepting requests, with the tier's header
checks, the plane-layout checks against the model and the prefix index's publishes; a
request for one of the files then checks the hit is served from the SSD tier.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from tqserve.storage import SsdTier, snapshot_key

PLANE_NAMES = ("0.keys", "0.values", "1.keys", "1.values")


def write_files(directory: Path, num_files: int, file_kb: int) -> int:
    """N snapshot files through SsdTier.put; returns the bytes on disk."""
    tier = SsdTier(directory, max_bytes=1 << 50)
    tier.recover()
    plane_bytes = max(1, file_kb * 1024 // len(PLANE_NAMES))
    total = 0
    for n in range(num_files):
        tokens = (1, 2, 3, n)
        fields = {"cache_kind": "kv", "k_bits": None, "v_bits": None, "head_dim": 128,
                  "rotation_id": None, "model_fingerprint": "bench", "namespace": "bench",
                  "token_ids": tokens, "offset": len(tokens), "minimum_reusable_offset": 0,
                  "created_ns": n, "extra": {}}
        planes = [(name, os.urandom(plane_bytes), (plane_bytes,), "uint8")
                  for name in PLANE_NAMES]
        total += tier.put(snapshot_key("bench", tokens), fields, planes).num_bytes
    return total


def time_recovery(directory: Path, repeats: int) -> dict[str, Any]:
    """Median seconds of a fresh tier's recover(), and its bytes read."""
    seconds, bytes_read, loaded = [], None, 0
    for _ in range(repeats):
        tier = SsdTier(directory, max_bytes=1 << 50)
        start = time.perf_counter()
        report = tier.recover()
        seconds.append(time.perf_counter() - start)
        loaded = report.num_loaded
        bytes_read = getattr(tier.statistics(), "num_bytes_read", None)
    return {"seconds": statistics.median(seconds), "all_seconds": seconds,
            "num_loaded": loaded, "bytes_read": bytes_read}


def engine_start(num_files: int, num_tokens: int, repeats: int) -> dict[str, Any]:
    """Median seconds for a whole engine to start over N real snapshot files (see --engine)."""
    import random

    import trio

    from tqserve.actors.engine import open_engine
    from tqserve.engine.config import Config
    from tqserve.engine.model import load_model
    from tqserve.engine.request import GenerateRequest
    from tqserve.engine.sampling import SamplingParams
    from tqserve.storage import read_snapshot
    from tqserve.storage.snapshot import encode_snapshot

    loaded = load_model(dtype="float32")
    rng = random.Random(0)
    vocab = loaded.vocab_size
    prompt = [rng.randrange(2, vocab) for _ in range(num_tokens)]

    async def serve(directory: Path, tokens: list[int]) -> Any:
        config = Config(cache_dir=str(directory), ssd_flush="sync", dtype="float32")
        async with open_engine(config, loaded=loaded) as engine:
            async for _ in engine.generate(GenerateRequest(
                    prompt_tokens=tokens, params=SamplingParams(max_tokens=1))):
                pass
            return engine.statistics().prefix_cache

    async def start(directory: Path) -> tuple[float, int]:
        config = Config(cache_dir=str(directory), dtype="float32")
        began = time.perf_counter()
        async with open_engine(config, loaded=loaded) as engine:
            seconds = time.perf_counter() - began
            return seconds, engine.statistics().prefix_cache.ssd_entries

    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch) / "cache"
        trio.run(serve, directory, prompt)
        (source,) = sorted(directory.glob("*.tqsnap"), key=lambda p: p.stat().st_size)[-1:]
        header, planes = read_snapshot(source)
        raw = [(name, p.data, p.shape, p.dtype) for name, p in planes.items()]
        disk = 0
        for n in range(num_files):
            tokens = tuple(rng.randrange(2, vocab) for _ in range(len(header.token_ids)))
            data = encode_snapshot(
                cache_kind=header.cache_kind, k_bits=header.k_bits, v_bits=header.v_bits,
                head_dim=header.head_dim, rotation_id=header.rotation_id,
                model_fingerprint=header.model_fingerprint, namespace=header.namespace,
                token_ids=tokens, offset=header.offset,
                minimum_reusable_offset=header.minimum_reusable_offset, created_ns=n,
                extra=header.extra, planes=raw)
            (directory / f"{snapshot_key(header.namespace, tokens)}.tqsnap").write_bytes(data)
            disk += len(data)
        runs = [trio.run(start, directory) for _ in range(repeats)]
        hit = trio.run(serve, directory, list(tokens) + [2])
    return {"mode": "engine", "files": num_files, "tokens_per_file": len(header.token_ids),
            "bytes_on_disk": disk, "seconds": statistics.median(r[0] for r in runs),
            "all_seconds": [r[0] for r in runs], "ssd_entries": runs[-1][1],
            "hit_after_start": {"hits_ssd": hit.hits_ssd, "quarantined": hit.quarantined}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_recovery", description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--file-kb", type=int, default=850)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--label", default="", help="a name for the code measured")
    parser.add_argument("--engine", action="store_true",
                        help="time a whole engine start over real snapshots of the bundled model")
    parser.add_argument("--tokens", type=int, default=900,
                        help="with --engine: tokens per snapshot file")
    args = parser.parse_args(argv)
    if args.files < 1 or args.file_kb < 1 or args.repeats < 1 or args.tokens < 2:
        parser.exit(2, "bench_recovery: --files, --file-kb and --repeats must be >= 1, "
                       "--tokens >= 2\n")
    if args.engine:
        result = {**engine_start(args.files, args.tokens, args.repeats), "label": args.label,
                  "python": platform.python_version(), "machine": platform.machine(),
                  "cpus": os.cpu_count()}
        text = json.dumps(result, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch) / "cache"
        disk = write_files(directory, args.files, args.file_kb)
        result = {"files": args.files, "bytes_on_disk": disk, **time_recovery(
            directory, args.repeats), "label": args.label,
            "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
