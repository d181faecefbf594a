"""Snapshot storage: the file format, the crash-safe writer and the SSD tier. Never imports mlx."""

from tqserve.storage.snapshot import (FORMAT_VERSION, Plane, PlaneSpec, SnapshotError, SnapshotHeader,
                              decode_header, decode_snapshot, encode_snapshot, read_snapshot)
from tqserve.storage.tier import RecoveryReport, SsdTier, TierEntry, TierStatistics
from tqserve.storage.writer import snapshot_key, validate_key, write_snapshot_file

__all__ = [
    "FORMAT_VERSION", "Plane", "PlaneSpec", "RecoveryReport", "SnapshotError", "SnapshotHeader",
    "SsdTier", "TierEntry", "TierStatistics", "decode_header", "decode_snapshot",
    "encode_snapshot", "read_snapshot", "snapshot_key", "validate_key", "write_snapshot_file",
]
