"""The ``--streaming-experts`` flags on mlx-lm's commands: the first ``ArgumentParser`` a wrapped
``main`` parses with takes the flags (one per row of ``option_table.OPTIONS`` that has one), checks
them in one line each, and turns them into the environment variables of ``options.ENV``
(``integration.patch_module`` wraps the commands' ``main`` where ``mlx_compat``'s checks pass)."""

import argparse
import functools
import os
import signal
import sys
import threading
from pathlib import Path

from ..option_table import OPTIONS
from ..runtime.memory import report
from ..runtime.mlx_compat import say_refusal, streaming_in_environment
from ..runtime.options import (
    ENV,
    StreamingOptions,
    check_budget_gb,
    missing_local_path,
    streaming_asked_by_environment,
)

FLAG_GROUP = "streaming experts (mlx-lm-streaming)"
# argparse dest -> the option of that flag (option_table: one row per option)
FLAG_OPTION = {o.flag[2:].replace("-", "_"): o for o in OPTIONS if o.flag}
# argparse dest -> environment variable it sets
FLAG_ENV = {dest: o.env for dest, o in FLAG_OPTION.items()}


def fail(parser, message: str, status: int = 2) -> None:
    """One line, ``<prog>: error: <message>``, and exit: our errors name the flag or variable at
    fault, so argparse's usage block would only push that line out of sight."""
    parser.exit(status, f"{parser.prog}: error: {' '.join(message.split())}\n")


def add_streaming_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--streaming-experts`` group to an mlx-lm command's parser: one flag per row of
    ``option_table.OPTIONS`` that has one."""
    group = parser.add_argument_group(
        FLAG_GROUP,
        "Stream the routed experts of a Mixture-of-Experts model from disk instead of "
        "loading them into memory. Each flag sets the environment variable named in its help.",
    )
    for option in FLAG_OPTION.values():
        text = option.help.replace("%", "%%")  # argparse formats help with %
        if option.metavar is None:
            group.add_argument(
                option.flag,
                action="store_true",
                default=None,
                help=f"{text} ({option.env}=1).",
            )
        elif option.metavar == "?":
            group.add_argument(
                option.flag,
                nargs="?",
                const=True,
                default=None,
                metavar="layers",
                help=f"{text} ({option.env}=1 or layers).",
            )
        else:
            group.add_argument(
                option.flag, metavar=option.metavar, help=f"{text} ({option.env})."
            )


def export_streaming_arguments(parser, namespace, environ=os.environ) -> None:
    """Move our flags out of ``namespace`` into the environment that ``options`` reads.

    When streaming is asked for (flag or environment), the options are checked here, before
    anything loads: an error is one line naming the flag or variable at fault."""
    from ..errors import StreamingError

    given = {}
    for dest in FLAG_ENV:
        value = getattr(namespace, dest, None)
        if hasattr(namespace, dest):
            delattr(namespace, dest)
        if value is not None:
            given[dest] = value
    enabled = bool(given.get("streaming_experts"))
    if not enabled:
        try:
            enabled = streaming_asked_by_environment(environ)
        except StreamingError as e:
            fail(parser, str(e))
    if not given and not enabled:
        return
    if not enabled:
        flags = ", ".join("--" + d.replace("_", "-") for d in given)
        verb = "needs" if len(given) == 1 else "need"
        fail(parser, f"{flags} {verb} --streaming-experts (or {ENV['enabled']}=1)")
    if getattr(namespace, "pipeline", None) is False and _distributed_size() > 1:
        # server and chat shard tensor-parallel without --pipeline; a streaming model refuses that
        # at load, where the server would only log it and keep running without a model
        fail(
            parser,
            "--streaming-experts over several ranks needs --pipeline: tensor parallelism is not "
            "supported with streaming experts yet (docs/distributed.md)",
        )
    model = getattr(namespace, "model", None)
    _check_distinct_outputs(parser, given, environ, namespace)
    _check_flags(parser, given, model, environ)
    for dest, value in given.items():
        environ[FLAG_ENV[dest]] = "1" if value is True else str(value)
    if given.get("streaming_experts") and not environ.get(ENV["if_unstreamable"], "").strip():
        # asked for on this command line: a model that cannot stream is refused (with only the
        # variable, a standing wish for every load, it loads whole: unstreamable.py)
        environ[ENV["if_unstreamable"]] = "refuse"
    # what is left to check came from the environment: the error names the variable
    try:
        options = StreamingOptions.from_env(environ)
        _check_outputs(options, model)
        _check_store_options(options, "expert_store_options" not in given, environ)
    except StreamingError as e:
        fail(parser, str(e))
    if missing_local_path(model):
        fail(parser, f"argument --model: {model}: no such model directory", 1)
    _refuse_a_listed_model(parser, model, environ)
    report.cli_streaming = True
    if given.get("streaming_stats"):
        _exit_cleanly_on_sigterm()


def _refuse_a_listed_model(parser, model, environ) -> None:
    """A local ``--model`` of a type that cannot stream (``unstreamable.REFUSED``), refused now
    where its load would refuse it: the server loads its model on a thread, where the refusal
    would be a traceback in its log and a server that cannot answer."""
    from ..errors import UnstreamableModelError
    from ..runtime.mlx_compat import model_classes
    from .unstreamable import REFUSE, model_module, refusal, refuse_listed

    if environ.get(ENV["if_unstreamable"], "").strip().lower() != REFUSE or not _local_model(model):
        return
    try:
        from mlx_lm.utils import load_config  # (the config as the load reads it)

        config = load_config(Path(model))
        model_class, _ = model_classes()(config=config)
    except Exception:  # the load names what is wrong with the checkpoint
        return
    try:
        refuse_listed(model_module(model_class), config.get("model_type"), model)
    except UnstreamableModelError as e:
        fail(parser, str(refusal(e)), 1)


def _local_model(model):
    """The model directory, where ``--model`` names one here (else None: a hub id, or none)."""
    return model if isinstance(model, str) and os.path.isdir(model) else None


def _check_outputs(options, model) -> None:
    """The files the run writes: checked, never opened (``outputs.check_output``)."""
    from ..files.outputs import ROUTING_TRACE, TIMELINE, check_output

    for path, kind in ((options.record_routing, ROUTING_TRACE), (options.trace, TIMELINE)):
        if path:
            check_output(path, kind, _local_model(model))


def _check_distinct_outputs(parser, given: dict, environ, namespace=None) -> None:
    """Two files of one run on one path (``--record-routing X --streaming-trace X``, or either
    on the command's own ``--prompt-cache-file``) would overwrite each other: refused at start,
    naming both, by flag or by variable."""
    from ..runtime.options import same_file

    named = []
    for dest in ("record_routing", "streaming_trace"):
        option = FLAG_OPTION[dest]
        if given.get(dest):
            named.append((option.flag, str(given[dest])))
        elif environ.get(option.env, "").strip():
            named.append((option.env, environ[option.env]))
    cache_file = getattr(namespace, "prompt_cache_file", None)
    if isinstance(cache_file, str) and cache_file.strip():
        named.append(("--prompt-cache-file", cache_file))
    for i, (a, path) in enumerate(named):
        for b, other in named[i + 1 :]:
            if same_file(path, other):
                fail(
                    parser,
                    f"{a} and {b} name one file, {path}: two files of one run cannot share a "
                    "path; give each its own",
                )


def _check_store_options(options, from_environment: bool, environ) -> None:
    """The store's options by name and value; those of the variable name it."""
    from .. import plugins
    from ..errors import ConfigurationError

    try:
        plugins.check_store_options(options.store, options.store_options)
    except ConfigurationError as e:
        variable = ENV["store_options"]
        if from_environment and environ.get(variable):
            raise ConfigurationError(f"{variable}={environ[variable]!r}: {e}") from None
        raise


def _check_flags(parser, given: dict, model=None, environ=os.environ) -> None:
    """Each flag's value on its own, so that the error names the flag (the budget as a float)."""
    from .. import plugins
    from ..errors import ConfigurationError, StreamingError
    from ..files.outputs import ROUTING_TRACE, TIMELINE, check_output

    for dest, value in given.items():
        if isinstance(value, str) and not value.strip():
            fail(parser, f"argument {FLAG_OPTION[dest].flag}: an empty value; leave the flag out")
    if "expert_cache_gb" in given:
        try:
            given["expert_cache_gb"] = check_budget_gb(given["expert_cache_gb"])
        except ConfigurationError as e:
            fail(parser, f"argument --expert-cache-gb: {e}")
    for dest, registered in (
        ("expert_store", plugins.stores),
        ("expert_kernel", plugins.kernels),
    ):
        name = given.get(dest)
        if name is None:
            continue
        known = set(registered()) | ({"auto"} if dest == "expert_kernel" else set())
        if name not in known:
            flag = "--" + dest.replace("_", "-")
            what = dest.replace("_", " ")
            fail(
                parser,
                f"argument {flag}: {plugins.unknown_name(what, name, known, flag)}",
            )
    if given.get("streaming_stats") not in (None, True, "layers"):
        value = given["streaming_stats"]
        fail(parser, f"argument --streaming-stats: {value!r}: the only value it takes is layers")
    for dest, option in FLAG_OPTION.items():
        if dest in given and dest not in ("streaming_experts", "expert_cache_gb"):
            try:  # the rest of the values, each on its own
                StreamingOptions(**{option.name: given[dest]})
            except StreamingError as e:
                fail(parser, f"argument {option.flag}: {e}")
    if "expert_store_options" in given:
        store = given.get("expert_store") or environ.get(ENV["store"]) or (
            "packed" if given.get("expert_pack") or environ.get(ENV["pack"]) else "safetensors"
        )
        try:
            plugins.check_store_options(
                store, StreamingOptions(store_options=given["expert_store_options"]).store_options
            )
        except StreamingError as e:
            fail(parser, f"argument --expert-store-options: {e}")
    for dest, kind in (("record_routing", ROUTING_TRACE), ("streaming_trace", TIMELINE)):
        if given.get(dest):
            try:
                check_output(given[dest], kind, _local_model(model))
            except StreamingError as e:
                fail(parser, f"argument --{dest.replace('_', '-')}: {e}")
    if given.get("expert_pack"):
        _check_pack_flag(parser, given)


def _check_pack_flag(parser, given: dict) -> None:
    from ..files.packfile import pack_path

    store = given.get("expert_store", "packed")
    if store != "packed":
        fail(parser, f"argument --expert-pack: needs --expert-store packed (or none), not {store}")
    pack = pack_path(".", given["expert_pack"])
    if not pack.is_file():
        fail(
            parser,
            f"argument --expert-pack: {pack}: no such file; write it with `mlx_lm_streaming pack "
            f"MODEL --out {given['expert_pack']}`",
        )


def _distributed_size() -> int:
    # the commands that take --pipeline call mx.distributed.init() right after parsing anyway
    import mlx.core as mx

    return mx.distributed.init().size()


class Terminated(KeyboardInterrupt):
    """`kill` (SIGTERM), raised where Ctrl-C would be, so that the commands end as on Ctrl-C."""

    signum = signal.SIGTERM


def _exit_cleanly_on_sigterm() -> None:
    # so that the end-of-run stats line (an atexit handler) is printed for `kill` too; servers
    # shut down on KeyboardInterrupt
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, on_sigterm)


class _FirstParser:
    """While active, the first ``ArgumentParser`` to parse gets our flags (once, then restored)."""

    def __init__(self):
        self.stock = argparse.ArgumentParser.parse_known_args
        self.active = False
        self.prog = None  # the command's name, once its parser ran
        self.lock = threading.Lock()

    def __enter__(self):
        stock = self.stock
        first = self

        @functools.wraps(stock)
        def parse_known_args(parser, args=None, namespace=None):
            first.restore()
            if "--streaming-experts" in parser._option_string_actions:
                # the parser has such a flag already: it is not ours to extend
                return stock(parser, args, namespace)
            add_streaming_arguments(parser)
            first.prog = parser.prog
            namespace, extras = stock(parser, args, namespace)
            export_streaming_arguments(parser, namespace)
            return namespace, extras

        with self.lock:
            argparse.ArgumentParser.parse_known_args = parse_known_args
            self.patched = parse_known_args
            self.active = True
        return self

    def restore(self):
        with self.lock:
            if self.active:
                self.active = False
                if argparse.ArgumentParser.parse_known_args is self.patched:
                    argparse.ArgumentParser.parse_known_args = self.stock

    def __exit__(self, *exc):
        self.restore()


def wrap_cli_main(module) -> None:
    """Wrap ``module.main`` so that its command line takes the streaming flags."""
    stock_main = getattr(module, "main", None)
    if stock_main is None or getattr(stock_main, "mlx_lm_streaming", False):
        return

    @functools.wraps(stock_main)
    def main(*args, **kwargs):
        from ..errors import StreamingError, exit_with

        first = _FirstParser()
        said = report.cli_streaming
        try:
            with first:
                return stock_main(*args, **kwargs)
        except StreamingError as e:
            # only we raise these, and only when streaming was asked for: one line, no traceback
            _end_text_line()
            exit_with(first.prog or os.path.basename(sys.argv[0]), e)
        except KeyboardInterrupt as e:
            if not report.cli_streaming:
                raise  # stock's command: stock's way
            # Ctrl-C (or `kill` with --streaming-stats): one line, the status of a process ended
            # by that signal (128 + its number); the stats line follows at exit where asked for
            _end_text_line()
            signum = getattr(e, "signum", signal.SIGINT)
            what = "interrupted" if signum == signal.SIGINT else "terminated"
            sys.stderr.write(f"{first.prog or os.path.basename(sys.argv[0])}: {what}\n")
            sys.stderr.flush()
            raise SystemExit(128 + signum) from None
        finally:
            report.cli_streaming = said

    main.mlx_lm_streaming = True
    main.stock = stock_main
    module.main = main


def _end_text_line() -> None:
    """Before the line of an error raised mid-generation: end the text printed so far with a
    newline, so that the error starts on its own line (on a terminal both share one screen)."""
    if report.generation_began():
        try:
            sys.stdout.write("\n")
            sys.stdout.flush()
        except Exception:  # stdout closed: the error line still goes out
            pass


def wrap_cli_main_refusing(module, message: str) -> None:
    """Where mlx-lm cannot be patched: ``module.main`` runs stock, unless the command line or the
    environment asks for streaming; then it prints ``message`` (one line) and exits with status 2."""
    stock_main = module.main
    if getattr(stock_main, "mlx_lm_streaming", False):
        return

    @functools.wraps(stock_main)
    def main(*args, **kwargs):
        flags = ["--" + dest.replace("_", "-") for dest in FLAG_ENV]
        if streaming_in_environment() or any(
            a.split("=", 1)[0] in flags for a in sys.argv[1:]
        ):
            say_refusal(message)
            raise SystemExit(2)
        return stock_main(*args, **kwargs)

    main.mlx_lm_streaming = True
    main.stock = stock_main
    module.main = main
