"""Speculative decoding inside the batch (DESIGN.md 3.4): proposers, verification in one
target forward, per-row rollback, and the sans-io policies (per-row back-off in policy.py,
per batch-size time policy in throughput.py) that the speculation actor
(actors/speculation.py) keeps. See docs/speculative.md."""
