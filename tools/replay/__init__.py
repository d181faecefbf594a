"""tqserve replay: record, import and replay traces; vLLM-named metrics; verify and A/B.

Modules: traces (Mooncake, Azure, recordings -> TraceRequest), recording (the file
format), recorder (`tqserve serve --record`), targets (URL, spawned server, embedded
engine), run (the open/closed-loop driver), metrics (sans-io arithmetic), report (tables,
JSON, plots, divergences), cli (`tqserve replay`).
"""
