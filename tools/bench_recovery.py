"""Start-up recovery of the SSD tier: seconds and bytes read for N snapshot files.

    python -m tqserve.tools.bench_recovery [--files 1000] [--file-kb 850] [--repeats 3] [--out FILE]

Writes N snapshot files of about --file-kb KiB each (random, incompressible planes: KV
bytes compress little) with SsdTier.put into a fresh private directory, then times
`SsdTier(directory).recover()` on a new tier R times (median): the work a restart does
before the server can answer. Reports the tier's own count of bytes read
(`num_bytes_read`, when the storage code has it) against the bytes on disk. Files are
read through the page cache (just written: warm), so the figure is CPU and syscall cost,
not the disk's. Only storage/ is imported: point PYTHONPATH at another checkout's tree
and run this file as a script to time that checkout's recovery.
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_recovery", description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--file-kb", type=int, default=850)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--label", default="", help="a name for the code measured")
    args = parser.parse_args(argv)
    if args.files < 1 or args.file_kb < 1 or args.repeats < 1:
        parser.exit(2, "bench_recovery: --files, --file-kb and --repeats must be >= 1\n")
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
