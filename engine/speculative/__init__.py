"""Speculative decoding inside the batch (DESIGN.md 3.4): proposers, the per-row policy,
verification in one target forward, per-row rollback. See README "Speculative decoding"."""
