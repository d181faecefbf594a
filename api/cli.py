"""`tqserve` command line: serve | generate | route | ray-serve | replay | bench NAME | eval-kv.

serve and generate map their flags 1:1 onto engine.config.Config, serve's server flags onto
api.config.ServerConfig (which holds the Config); the other commands hand their arguments
to the module api.commands names (`bench kv` to tools.bench_kv, ...).

Bad arguments print one line and exit with code 2; a model that cannot be loaded
too. Nothing here prints a traceback for the user's mistakes. SIGINT and SIGTERM, from
the start (api.signals): serve shuts down cleanly and exits 0 (api.server), generate
stops with one line and exits 130 / 143 (api.generate).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

from tqserve import blas
from tqserve.api.commands import (BENCHES, COMMANDS, OLD_BENCHES, REMOVED, TOOL_HELP as _TOOL_HELP,
                                  TOOLS, bench_help)
from tqserve.api.flags import add_config_flags, warn_deprecated
from tqserve.api.signals import SIGNALS, SignalLatch

if TYPE_CHECKING:
    from tqserve.api.config import ServerConfig
    from tqserve.engine.config import Config
    from tqserve.engine.sampling import SamplingParams

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default, except where the help text already says it and for
    switches and unset options (a default of None or a bool says nothing useful)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if (action.help and "default" in action.help) or action.default is None \
                or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tqserve", description="Serve LLMs on MLX.",
                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser,
                                metavar="{" + ",".join(COMMANDS) + "}")
    serve = sub.add_parser("serve", help="run the WebSocket server",
                           formatter_class=HelpFormatter)
    add_config_flags(serve, server=True)
    serve.add_argument("--record", default=None, metavar="FILE",
                       help="record every admitted request and its output (tqserve replay)")
    gen = sub.add_parser("generate", help="generate from one prompt, printing as it streams",
                         formatter_class=HelpFormatter)
    add_config_flags(gen, server=False)
    for name, text in _TOOL_HELP:
        sub.add_parser(name, help=text, add_help=False)
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-tokens", type=int, default=128,
                     help="tokens to generate (at most --max-tokens-cap)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: off)")
    return parser


def _check_cache_dir(path: str) -> None:
    """Refuse an unusable or shared --cache-dir before the model loads (storage.cachedir)."""
    from pathlib import Path

    from tqserve.storage.cachedir import prepare_directory

    try:
        prepare_directory(Path(path))
    except OSError as exc:
        raise ValueError(f"--cache-dir {path!r} cannot be used: {exc.strerror or exc}") from None


def _config(args: argparse.Namespace) -> Config:
    """The engine's Config of parsed flags (serve's, generate's); ValueError naming a flag."""
    import attrs

    from tqserve.api import kvflag, specflag
    from tqserve.engine.config import Config

    fields = {f.name for f in attrs.fields(Config)} - set(kvflag.OLD_FLAGS) - set(
        specflag.OLD_FLAGS) - {"speculative"}
    return Config(**{k: v for k, v in vars(args).items() if k in fields},
                  **kvflag.kv_fields(args), **specflag.spec_fields(args))


def _server_config(args: argparse.Namespace) -> ServerConfig:
    """serve's ServerConfig of parsed flags, the engine's Config in it; ValueError naming
    a flag."""
    import attrs

    from tqserve.api.config import ServerConfig

    fields = {f.name for f in attrs.fields(ServerConfig)} - {"engine"}
    return ServerConfig(engine=_config(args),
                        **{k: v for k, v in vars(args).items() if k in fields})


_GENERATE_FLAGS = ("max_tokens", "temperature", "seed")  # SamplingParams fields with a flag


def _sampling(config: Config, args: argparse.Namespace) -> SamplingParams:
    """generate's sampling flags, checked before the model loads; errors name the flag."""
    from tqserve.engine.sampling import SamplingParams

    if args.max_tokens > config.max_tokens_cap:
        raise ValueError(f"--max-tokens ({args.max_tokens}) exceeds --max-tokens-cap "
                         f"({config.max_tokens_cap})")
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              seed=args.seed)
    except ValueError as exc:
        message = str(exc)
        for field in _GENERATE_FLAGS:
            if message.startswith(field):
                message = "--" + field.replace("_", "-") + message[len(field):]
        raise ValueError(message) from None


def _report(line: str | None) -> None:
    """The BLAS line, printed once the model has loaded (errors before stay one line)."""
    blas.say_once(line)


async def _serve(config: ServerConfig, latch: SignalLatch, blas_line: str | None = None,
                 record: str | None = None) -> int:
    """Serve until SIGTERM or SIGINT, then shut down cleanly (api.server) and exit 0.

    Both signals go to a trio signal receiver for the whole run, so Ctrl-C never lands
    as a KeyboardInterrupt inside a request handler; a repeated signal changes nothing.
    A signal that came before (api.signals) ends the run here, before the model loads."""
    import trio

    from tqserve.api.server import listen, serve

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("tqserve.prefix").setLevel(logging.INFO)
    logging.getLogger("tqserve.access").setLevel(logging.INFO)
    logging.getLogger("tqserve.warmup").setLevel(logging.INFO)
    listening = listen(config)  # a taken port fails here, before the model loads
    trigger = trio.Event()
    with trio.open_signal_receiver(*SIGNALS) as signals:
        if latch.signum is not None:
            print(f"tqserve: shut down on {latch.name} before serving", file=sys.stderr,
                  flush=True)
            return 0

        async def watch() -> None:
            async for signum in signals:
                latch.note(signum)
                trigger.set()

        async def run(task_status: trio.TaskStatus[str]) -> None:
            reports.append(await serve(config, listening=listening, shutdown_trigger=trigger,
                                       record=record, task_status=task_status))
            nursery.cancel_scope.cancel()

        reports = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            url = await nursery.start(run)
            _report(blas_line)
            print(f"tqserve: serving {config.engine.model} on {url} (WebSocket /v1/stream; HTTP "
                  "/v1/completions, /v1/chat/completions, /v1/messages, /metrics)", flush=True)
            if config.api_key is None and config.host not in _LOOPBACK:
                print(f"tqserve: warning: listening on {config.host} without --api-key: anyone "
                      "who can reach this port can generate", file=sys.stderr, flush=True)
    report = reports[0]
    print(f"tqserve: shut down on {latch.name}: "
          f"{report.num_in_flight} requests in flight, {report.num_ended} ended at the "
          f"--shutdown-timeout ({config.shutdown_timeout:g} s)", file=sys.stderr, flush=True)
    return 0


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _tool(argv: list[str]) -> tuple[str, list[str]] | None:
    """The tool module a command hands its remaining arguments to, or None (serve,
    generate, or a mistake the parser reports). An old `bench-NAME` prints one deprecation
    line first; `attack` and `route-sim` left the CLI (api.commands)."""
    if not argv:
        return None
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if rest and rest[0] in BENCHES:
            return BENCHES[rest[0]], rest[1:]
        return BENCHES["mlx-lm"], rest
    if command in OLD_BENCHES:
        warn_deprecated([command], f"tqserve bench {OLD_BENCHES[command]}")
        return BENCHES[OLD_BENCHES[command]], rest
    if command in TOOLS:
        return TOOLS[command], rest
    return None


def _blas_line(choice: str) -> str | None:
    """Before anything imports tqserve.engine (build_parser does): check --blas and hand it
    to tqserve.blas (TQSERVE_BLAS), which loads it now, before MLX. Returns the line to
    report (the library loaded, or a hint); serve and generate print it once the model has
    loaded, so that a bad flag or model stays a one-line error. In a process that already
    runs MLX (main() called from Python) `auto` does nothing."""
    if "mlx.core" in sys.modules:
        if choice not in ("auto", "none"):
            raise ValueError("--blas PATH needs a process that has not imported MLX yet")
        return None
    blas.resolve(choice)  # a bad path: ValueError naming --blas, before anything loads
    os.environ[blas.ENV] = choice
    blas.preload()
    return blas.report()


def _load_blas(choice: str) -> None:
    """Load the optimized BLAS (or not) and print the report line at once."""
    line = _blas_line(choice)
    if line is not None:
        print(line, file=sys.stderr)


def _follow(config: Config, group: Any) -> int:
    """A rank other than 0 of `serve --distributed` (engine.follower), with its shard of the
    SSD tier when there is one (actors.shard_group)."""
    from tqserve.actors.shard_group import follower_disk
    from tqserve.engine.follower import run_follower
    from tqserve.storage.shard import ShardId

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    open_disk = None
    if config.cache_dir is not None and config.prefix_cache:
        open_disk = follower_disk(config, ShardId(group.size(), group.rank()))
    return run_follower(config, group, open_disk)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in REMOVED:
        print(f"tqserve: error: {argv[0]} is not a tqserve command; run it as "
              f"python -m {REMOVED[argv[0]]}", file=sys.stderr)
        return 2
    if argv[:1] == ["bench"] and argv[1:2] in (["-h"], ["--help"]):
        print(bench_help(), flush=True)  # then mlx-lm's flags: the NAME-less bench's
    tool = _tool(argv)
    if tool is not None:  # the tools parse their own flags
        return int(importlib.import_module(tool[0]).main(tool[1]))
    with SignalLatch() as latch:  # before MLX's import, the first SIGINT/SIGTERM counts
        return _command(argv, latch)


def _command(argv: list[str], latch: SignalLatch) -> int:
    """serve or generate; `latch` holds a signal that came before trio ran (trio, like
    MLX, is imported only now: the shorter the time before the latch, the better)."""
    import trio

    from tqserve.api.generate import run_generate

    blas_line = None
    if argv and argv[0] in ("serve", "generate"):
        try:
            blas_line = _blas_line(blas.choice_in(argv))
        except ValueError as exc:
            print(f"tqserve: error: {exc}", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        server = _server_config(args) if args.command == "serve" else None
        config = server.engine if server is not None else _config(args)
        if config.cache_dir is not None and config.prefix_cache:
            _check_cache_dir(config.cache_dir)
        if server is None:  # generate
            return trio.run(run_generate, config, _sampling(config, args), args.prompt,
                            latch, blas_line)
        if config.distributed:
            from tqserve.engine.distributed import init_group

            group = init_group()
            if group.rank() != 0:
                latch.hand_over()  # a follower ends on signals as any process does
                return _follow(config, group)
        return trio.run(_serve, server, latch, blas_line, args.record)
    except ValueError as exc:  # ModelLoadError is a ValueError
        print(f"tqserve: error: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:  # raised inside a nursery (e.g. at engine start)
        leaves = _leaves(group)
        from tqserve.engine.distributed import GroupFailure

        failed = [e for e in leaves if isinstance(e, GroupFailure)]
        if failed:  # engine.distributed: a rank died or a step failed; the group ends
            print(f"tqserve: error: tensor-parallel group failed: {failed[0]}", file=sys.stderr)
            return 1
        if not all(isinstance(e, ValueError) for e in leaves):
            raise
        print(f"tqserve: error: {leaves[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run() -> NoReturn:
    """The `tqserve` console script: main(), then exit without tearing MLX down.

    Everything that must happen at the end already has (the engine closed, its writes
    drained and fsynced, the shutdown line written); what remains is the interpreter's own
    teardown, during which MLX's native threads can abort the process ("terminate called
    without an active exception", exit -6: seen in the SIGINT shutdown test on CPU and at
    exit on CUDA). So flush and leave with the exit code, as `os._exit` does."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
