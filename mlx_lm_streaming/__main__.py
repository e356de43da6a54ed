"""The ``mlx_lm_streaming`` command: ``mlx_lm_streaming <subcommand> ...``.

Subcommands live in ``SUBCOMMANDS``: each is ``(name, add_arguments(parser), run(args) -> int)``.
Add one by writing those two functions and listing them there.

- ``info``: whether the startup hook is installed and active, and the registered plugins;
- ``plan MODEL``: what streaming would do with a model: experts per layer, bytes per expert, the
  minimum and default budgets and the slots per layer, without reading any expert bytes. With
  ``--routing-trace FILE`` it also replays a recorded routing through the cache's slot tables and
  eviction policy (``replay.py``), at this budget and over a range of budgets (``budget_table.py``):
  hit rates, the GB each decode token would read and the decode speed the disk allows.
- ``verify MODEL``: stock against streaming logits, bit for bit, on this machine (``parity.py``);
- ``pack MODEL``: write ``MODEL/experts.pack``, the routed experts repacked for one aligned read each
  (``--expert-store packed``); see ``pack.py``.
"""

import argparse
import os
import sys
from pathlib import Path

from .errors import CheckpointError, ConfigurationError, StreamingError, exit_with
from .runtime.options import check_budget_gb, missing_local_path
from .runtime.sizes import decimal_gb, gb_at_least


def _hook_files():
    import site

    dirs = site.getsitepackages() + [site.getusersitepackages()]
    found = []
    for d in dirs:
        for name in ("mlx_lm_streaming.pth", "mlx_lm_streaming.start"):
            path = os.path.join(d, name)
            if os.path.isfile(path):
                found.append(path)
    return found


def add_info_arguments(parser):
    pass


def run_info(args) -> int:
    from . import __version__, plugins
    from .option_table import HOOK_ENV, OFF_WORDS

    print(f"mlx-lm-streaming {__version__}")
    files = _hook_files()
    print(
        f"startup hook files: {', '.join(files) or 'none (not installed from a wheel?)'}"
    )
    active = any(getattr(f, "mlx_lm_streaming", None) is True for f in sys.meta_path)
    off = os.environ.get(HOOK_ENV, "1").strip().lower() in OFF_WORDS
    state = "active" if active else f"off ({HOOK_ENV}=0)" if off else "not active"
    print(f"post-import hook in this interpreter: {state}")
    try:
        import mlx.core as mx
        import mlx_lm

        from .integration.integration import install

        install()
        print(
            f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, device {mx.default_device()}"
        )
    except Exception as e:  # report, don't fail: this is a diagnostic
        print(f"mlx-lm: not usable here ({type(e).__name__}: {e})")
        return 1
    print(f"architectures: {', '.join(sorted(plugins.architectures()))}")
    print(f"stores: {', '.join(sorted(plugins.stores()))}")
    print(f"kernels: auto, {', '.join(sorted(plugins.kernels()))}")
    return 0


def _budget_gb(value: str) -> float:
    try:
        return check_budget_gb(value)
    except ConfigurationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_plan_arguments(parser):
    parser.add_argument("model", help="model directory or Hugging Face repo")
    parser.add_argument(
        "--expert-cache-gb",
        type=_budget_gb,
        help="budget to plan for (default: derived)",
    )
    parser.add_argument(
        "--routing-trace",
        metavar="FILE",
        help="replay this routing trace (docs/routing.md) through the cache: hit rates and GB "
        "read per decode token at this budget",
    )
    parser.add_argument(
        "--expert-cache-policy",
        "--cache-policy",
        dest="cache_policy",
        metavar="NAME",
        help="eviction policy to replay with, as the generate commands take it (default: the "
        "cache's, decay_next; or decay, lru); --cache-policy is the same",
    )
    parser.add_argument(
        "--disk-gbps",
        type=_positive_gbps,
        metavar="X",
        help="with --routing-trace: the disk's read bandwidth in GB/s for the disk-bound decode "
        "speed (default: measured by a short read of the model's files, page cache bypassed)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="with --routing-trace: draw hit rate and disk-bound tok/s against budget into FILE "
        "(.png, .svg or .pdf; no extension: .png); needs matplotlib (the [plot] extra: "
        "python -m pip install matplotlib)",
    )


def _positive_gbps(value: str) -> float:
    try:
        gbps = float(value)
    except ValueError:
        gbps = float("nan")
    if not (gbps > 0 and gbps != float("inf")):
        raise argparse.ArgumentTypeError(f"{value!r}: give a positive number of GB/s")
    return gbps


def run_plan(args) -> int:
    from .integration.integration import install, load_to_stream
    from .runtime import mlx_compat

    install()
    _check_plan_flags(args)
    path = Path(args.model)
    if missing_local_path(args.model):
        raise CheckpointError(f"{args.model}: no such model directory")
    if not path.is_dir():
        # a hub id: mlx-lm's own resolution (downloads or uses its cache)
        try:
            path = mlx_compat.download(args.model)
        except Exception as e:
            raise CheckpointError(
                f"{args.model}: not a local directory, and the Hugging Face hub could not "
                f"provide it ({type(e).__name__}: {e})"
            ) from e
        if path is None:
            raise CheckpointError(
                f"{args.model}: not a local directory, and this mlx-lm cannot fetch it from the hub"
            )
    trace = None
    if args.routing_trace is not None:
        from .files.routing_trace import read_trace

        trace = read_trace(args.routing_trace)  # a bad file fails before the model loads
    from .runtime.options import StreamingOptions

    # the plan's own flags only (a StreamingOptions is taken as given, without the environment)
    options = StreamingOptions(expert_cache_gb=args.expert_cache_gb)
    if args.cache_policy is not None:
        try:
            options = StreamingOptions(
                expert_cache_gb=args.expert_cache_gb, cache_policy=args.cache_policy
            )
        except ConfigurationError as e:
            raise ConfigurationError(f"argument --expert-cache-policy: {e}") from None
    model, _ = load_to_stream(path, options)
    state = model.expert_streaming
    try:
        _print_plan(args, state, trace)
    finally:
        state.close()
    return 0


def _check_plan_flags(args) -> None:
    """Flags that need each other or an optional package, before anything loads."""
    for flag, value in (("--plot", args.plot), ("--disk-gbps", args.disk_gbps)):
        if value is not None and args.routing_trace is None:
            raise ConfigurationError(f"{flag} needs --routing-trace FILE (a recorded routing)")
    if args.plot is not None:
        from .tools.budget_table import check_plotting, plot_path

        args.plot = plot_path(args.plot)
        check_plotting()


def _print_plan(args, state, trace) -> None:
    from .integration.loading import check_budget_fits, default_budget
    from .runtime.memory.report import budget_how, cache_bytes
    from .tools.budget_table import slots_text

    cache = state.cache
    banks = cache.banks
    if trace is not None:  # a trace that cannot give figures fails before anything is printed
        from .files.routing_trace import check_decode_tokens

        counts = {b.num_experts for b in banks}
        trace.check_model(len(banks), counts.pop() if len(counts) == 1 else sorted(counts))
        check_decode_tokens(trace)
    per_slot = sum(b.layer.expert_nbytes for b in banks)
    print(f"model: {state.model_path}")
    print(
        f"MoE layers: {len(banks)}, experts per layer: "
        f"{', '.join(sorted({str(b.num_experts) for b in banks}))}"
    )
    sizes = sorted({b.layer.expert_nbytes for b in banks})
    print(f"each miss reads one expert: {' or '.join(decimal_gb(n) for n in sizes)}")
    print(f"all routed experts: {decimal_gb(cache.total_expert_bytes)}")
    print(f"resident weights: {decimal_gb(state.resident_bytes)}")
    print(
        f"minimum budget, one expert per MoE layer: {decimal_gb(per_slot, up=True)} "
        f"(--expert-cache-gb {gb_at_least(per_slot)})"
    )
    default, free = default_budget(state)
    print(f"default budget: {decimal_gb(default)} ({budget_how(state, default, free=free)})")
    # a budget below the minimum, or one that cannot fit this machine, stops here, naming it
    check_budget_fits(state)
    if args.expert_cache_gb is not None:
        budget = cache_bytes(cache, cache.budget_bytes)
        # what bounded it, where something did (not "0.002 GB (given 0.002 GB)")
        capped = f" ({budget_how(state, cache.budget_bytes, given_gb=args.expert_cache_gb)})"
        print(
            f"expert cache budget (given): {decimal_gb(budget)}"
            f"{capped if budget < cache.budget_bytes else ''}"
        )
    else:
        print(f"expert cache budget (default): {decimal_gb(cache.budget_bytes)}")
    plan = cache.plan_slots()
    used = sum(n * b.layer.expert_nbytes for n, b in zip(plan, banks))
    print(f"slots per layer: {slots_text(plan)} ({decimal_gb(used)} used)")
    from .runtime.memory.moving_budget import plan_line

    print(plan_line(cache))
    from .runtime.memory.report import tiers_plan_line

    print(tiers_plan_line(cache, state.selector.backend, trace))
    if trace is None:
        from .tools.pack import command_word

        print(
            "hit rate and speed against budget: record the routing of your own prompt with "
            f"`{command_word('mlx_lm.generate')} --model {args.model} --streaming-experts "
            f"--record-routing routing.jsonl --prompt ...`, then run "
            f"`{command_word('mlx_lm_streaming')} plan {args.model} --routing-trace routing.jsonl`"
        )
        return
    print(_replay_line(trace, cache, plan))
    from .tools.budget_table import budget_rows, format_table, measure_disk, plot

    if args.disk_gbps is not None:
        gbps = args.disk_gbps
        print(f"disk: {gbps:g} GB/s (--disk-gbps)")
    else:
        gbps, line = measure_disk(banks)
        print(line)
    rows = budget_rows(state, trace, default, gbps, given=args.expert_cache_gb is not None)
    print(format_table(rows))
    if args.plot is not None:
        written = plot(rows, args.plot, f"{state.model_path.name}, trace {trace.path.name}")
        print(f"plot: {written}")


def _replay_line(trace, cache, plan) -> str:
    """The trace replayed through slot tables with ``plan``'s slots and the cache's policy."""
    from .tools.replay import replay

    banks = cache.banks
    counts = {b.num_experts for b in banks}
    trace.check_model(len(banks), counts.pop() if len(counts) == 1 else sorted(counts))
    result = replay(trace, plan, cache.policy)
    read = sum(m * b.layer.expert_nbytes for m, b in zip(result.decode_misses, banks))
    per_token = read / result.decode_tokens if result.decode_tokens else 0.0
    return (
        f"routing trace {trace.path.name} ({result.decode_tokens} decode, "
        f"{len(trace.rows) - result.decode_tokens} prefill tokens; policy {cache.policy}): "
        f"decode hit rate {_percent(result.hit_rate('decode'))}, prefill hit rate "
        f"{_percent(result.hit_rate('prefill'))}, {decimal_gb(per_token)} read per decode token"
    )


def _percent(rate: float) -> str:
    return "n/a" if rate != rate else f"{rate:.1%}"


def add_pack_arguments(parser):
    from .tools.pack import add_arguments

    add_arguments(parser)


def run_pack(args) -> int:
    from .tools.pack import run

    return run(args)


def add_verify_arguments(parser):
    from .tools.parity import add_arguments

    add_arguments(parser)


def run_verify(args) -> int:
    from .tools.parity import run_verify

    return run_verify(args)


SUBCOMMANDS = [
    (
        "info",
        "show the hook's state and the registered plugins",
        add_info_arguments,
        run_info,
    ),
    ("plan", "show what streaming would do with a model", add_plan_arguments, run_plan),
    ("pack", "repack the routed experts for one aligned read each", add_pack_arguments, run_pack),
    (
        "verify",
        "check that streaming gives the stock logits bit for bit on this machine",
        add_verify_arguments,
        run_verify,
    ),
]


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other error of this command."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _stdout_closed() -> int:
    # the reader went away (`mlx_lm_streaming info | head`): not an error worth a traceback; point
    # stdout at /dev/null so that the flush at exit does not raise again
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


def main(argv=None) -> int:
    parser = _Parser(
        prog="mlx_lm_streaming",
        description="Tools for mlx-lm-streaming. To run a model, use mlx-lm's own commands "
        "with --streaming-experts (see docs/usage.md).",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"mlx-lm-streaming {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    runners = {}
    for name, summary, add_arguments, run in SUBCOMMANDS:
        add_arguments(sub.add_parser(name, help=summary, description=summary))
        runners[name] = run
    args = parser.parse_args(argv)
    try:
        status = runners[args.command](args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except StreamingError as e:
        exit_with(f"{parser.prog} {args.command}", e)
    except KeyboardInterrupt:
        # Ctrl-C: one line, and the status of a process interrupted by SIGINT (128 + 2)
        left = INTERRUPTED.get(args.command, "")
        sys.stderr.write(f"{parser.prog} {args.command}: interrupted{left}\n")
        sys.stderr.flush()
        return 130


# what an interrupted subcommand leaves (a pack is written beside the old one and renamed over it)
INTERRUPTED = {"pack": "; no pack was written, and a pack that was there is as it was"}


if __name__ == "__main__":
    sys.exit(main())
