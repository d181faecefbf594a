"""tqserve replay: record, import and replay traces; vLLM-named metrics; verify and A/B.

Modules: traces (Mooncake, Azure, recordings -> TraceRequest), recording (the file
format), recorder (`tqserve serve --record`), targets (URL, spawned server, embedded
engine), run (the open/closed-loop driver and its books), load (the start checks'
arithmetic: context, reuse, bursts, estimated rejections), session (one run: checks,
replay, interruption, summary), metrics (sans-io arithmetic), report (tables, JSON,
plots, divergences), cli (`tqserve replay`). User docs: docs/replay.md.
"""
