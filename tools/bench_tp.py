"""Tensor parallel vs one process: decode tokens/s of `tqserve serve` alone and of
`mlx.launch -n N --backend B ... serve --distributed`, side by side in one run.

    python -m tqserve.tools.bench_tp [--model PATH] [--ranks 2] [--new-tokens 64]
                                     [--concurrency 8] [--blas auto] [--backend ring]
                                     [--out FILE]

Each server is started as a real process on a loopback port, warmed up with one request,
then measured over its WebSocket API (tqserve.client): `single` is one greedy request,
(n - 1) / (t_last - t_first); `aggregate` is C concurrent greedy requests, the sum of their
tokens after the first over the span from the first request's first token to the last
token. Prompts are distinct windows of this file's source (no prefix reuse). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import trio

from tqserve.client import Client, TokenEvent

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "../shared/models/pycoder-29m"
START_TIMEOUT = 300  # seconds for a server (or a group) to load and listen


def _prompts(count: int) -> list[str]:
    lines = Path(__file__).read_text().splitlines()
    return ["\n".join(lines[i * 3:i * 3 + 6]) + "\n" for i in range(count)]


def _command(model: str, ranks: int, blas: str, backend: str) -> list[str]:
    serve = [sys.executable, "-m", "tqserve.api.cli", "serve", "--model", model, "--dtype",
             "float32", "--port", "0", "--blas", blas]
    if ranks == 1:
        return serve
    launch = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or "mlx.launch"
    return [launch, "-n", str(ranks), "--backend", backend, "--", *serve, "--distributed"]


async def _one(client: Client, prompt: str, new_tokens: int) -> list[float]:
    times = []
    async for event in client.generate(prompt=prompt, max_tokens=new_tokens, temperature=0.0):
        if isinstance(event, TokenEvent):
            times.append(time.perf_counter())
    return times


async def _measure(url: str, new_tokens: int, concurrency: int) -> dict[str, float]:
    prompts = _prompts(concurrency + 2)
    async with Client.connect(url) as client:
        await _one(client, prompts[-1], 8)  # warm-up
        single = await _one(client, prompts[-2], new_tokens)
        runs: list[list[float]] = []

        async def run(prompt: str) -> None:
            runs.append(await _one(client, prompt, new_tokens))

        async with trio.open_nursery() as nursery:
            for prompt in prompts[:concurrency]:
                nursery.start_soon(run, prompt)
    t0 = min(r[0] for r in runs)
    return {"single": (len(single) - 1) / (single[-1] - single[0]),
            "aggregate": sum(len(r) - 1 for r in runs) / (max(r[-1] for r in runs) - t0)}


async def _bench(args: argparse.Namespace, ranks: int) -> dict[str, float]:
    proc = subprocess.Popen(_command(args.model, ranks, args.blas, args.backend), cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        with trio.fail_after(START_TIMEOUT):
            line = await trio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
        if " on http://" not in line:
            raise SystemExit(f"bench_tp: the server did not start: {line!r}")
        url = line.split(" on ")[1].split()[0].replace("http://", "ws://") + "/v1/stream"
        return await _measure(url, args.new_tokens, args.concurrency)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tqserve bench tp", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model directory (float32)")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the tensor-parallel group")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per request")
    p.add_argument("--concurrency", type=int, default=8, help="requests of the aggregate run")
    p.add_argument("--blas", default="auto", help="auto | none | PATH, as serve's --blas")
    p.add_argument("--backend", default="ring", help="mlx.launch --backend (nccl on GPUs)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.ranks < 2 or args.new_tokens < 2 or args.concurrency < 1:
        p.error("--ranks must be >= 2, --new-tokens >= 2, --concurrency >= 1")
    result: dict[str, Any] = {"model": args.model, "ranks": args.ranks, "backend": args.backend,
                              "new_tokens": args.new_tokens, "concurrency": args.concurrency}
    result["one_process"] = trio.run(_bench, args, 1)
    result["tensor_parallel"] = trio.run(_bench, args, args.ranks)
    result["ratio"] = {k: result["tensor_parallel"][k] / result["one_process"][k]
                       for k in ("single", "aggregate")}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
