"""Patches that make stock mlx-lm entry points build streaming models when asked.

mlx-lm has no plugin mechanism. The startup hook (``_bootstrap``) calls ``patch_module`` on each mlx-lm
module listed there right after it is imported; ``mlx_compat`` checks the mlx-lm version and the shape
of what is patched first, and applies these patches only where both checks pass:

- ``mlx_lm.utils``: ``load_model`` is rebound to a wrapper that builds a streaming model when
  ``model_config["streaming_experts"]`` or ``MLX_LM_STREAMING_EXPERTS`` asks for one, and calls the
  stock function with the same arguments otherwise. No other binding needs a patch: ``load`` and
  ``sharded_load`` look ``load_model`` up in ``mlx_lm.utils`` at call time, and every module that
  imported ``load`` by value (``mlx_lm.load``, ``mlx_lm.generate.load``, ``mlx_lm.server.load`` ...)
  holds that same ``load``. No module imports ``load_model`` by value (checked for mlx-lm 0.32.2).
- the command-line modules (``generate``, ``chat``, ``server`` ...): ``main`` is wrapped so that the
  first ``ArgumentParser`` it parses with also takes the ``--streaming-experts`` flags and turns them
  into the environment variables of ``options.ENV``. That works whether or not the module has a
  ``setup_arg_parser()`` (``server`` builds its parser inline) and covers ``python -m mlx_lm <cmd>``,
  which calls the same ``main``.
"""

import functools
import inspect
import sys

from ..runtime.mlx_compat import (
    CLI_MODULES,
    load_model_problem,
    problem,
    refusal,
    say_refusal,
    streaming_in_environment,
)
from ..runtime.options import CONFIG_KEY, requested, warn_unknown_variables
from .cli import wrap_cli_main, wrap_cli_main_refusing


def patch_module(module) -> None:
    """Patch a freshly imported mlx-lm module, or nothing where ``mlx_compat``'s checks fail."""
    name = module.__name__
    why = problem()
    if why is None and name == "mlx_lm.utils":
        why = load_model_problem(getattr(module, "load_model", None))
    if name == "mlx_lm.utils":
        if why is None:
            install(module)
        elif streaming_in_environment():
            # a script that calls mlx_lm.load would otherwise load every expert into memory
            say_refusal(refusal(why))
    elif name in CLI_MODULES and callable(getattr(module, "main", None)):
        if why is None and name == "mlx_lm.generate":
            wrap_generate_step(module)
        if why is None:
            wrap_cli_main(module)
        else:
            wrap_cli_main_refusing(module, refusal(why))


# -- loading -------------------------------------------------------------------------------------


def install(utils=None) -> None:
    """Wrap ``mlx_lm.utils.load_model`` (idempotent; again after a reload of the module).

    Raises ``IncompatibleMlxLmError`` (and patches nothing) where ``mlx_compat`` finds an mlx-lm
    it cannot patch."""
    from ..errors import IncompatibleMlxLmError

    if utils is None:
        import mlx_lm.utils as utils
    if getattr(utils.load_model, "mlx_lm_streaming", False):
        return
    why = problem() or load_model_problem(utils.load_model)
    if why is not None:
        raise IncompatibleMlxLmError(refusal(why))
    utils.load_model = _wrap_load_model(utils.load_model)


def _wrap_load_model(stock_load_model):
    """``load_model`` as a wrapper that takes whatever the stock one takes, by position or name.

    Arguments are bound to the stock signature (so a bad call fails exactly as stock's does) and
    passed on as given; only ``model_config`` is read, and our key taken out of it."""
    signature = inspect.signature(stock_load_model)

    @functools.wraps(stock_load_model)
    def load_model(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        model_config = bound.arguments.get("model_config")
        explicit = bool(model_config) and CONFIG_KEY in model_config
        options = requested(model_config)
        if explicit:
            # mlx-lm must not see our key
            bound.arguments["model_config"] = {
                k: v for k, v in model_config.items() if k != CONFIG_KEY
            }
        if options is None:
            warn_unknown_variables()
            return stock_load_model(*bound.args, **bound.kwargs)
        from ..errors import UnsupportedModelError
        from .loading import load_streaming_model
        from .unstreamable import instead, refusal

        try:
            return load_streaming_model(stock_load_model, bound, options)
        except UnsupportedModelError as e:
            # a model with no experts loads as stock; one that cannot stream is refused where
            # model_config or the flag asked, and loads whole where only the environment did
            # (which also reaches draft models and models named in server requests)
            line = instead(e, options, explicit)
            if line is None:
                raise refusal(e) from None
            print(line, file=sys.stderr, flush=True)
            return stock_load_model(*bound.args, **bound.kwargs)

    load_model.mlx_lm_streaming = True
    load_model.stock = stock_load_model
    return load_model


def load_to_stream(model_path, options, lazy: bool = True):
    """For our own commands (``plan``, ``pack``): ``(model, config)`` of a streaming model, or our
    error; a model that cannot stream, one without experts included, never loads stock here."""
    from .loading import load_streaming_model

    install()
    import mlx_lm.utils

    stock = mlx_lm.utils.load_model.stock
    bound = inspect.signature(stock).bind(model_path, lazy=lazy)
    return load_streaming_model(stock, bound, options)


# -- prefill -------------------------------------------------------------------------------------


def wrap_generate_step(generate) -> None:
    """Put layer-major prefill (layer_major.py) in front of ``mlx_lm.generate.generate_step``,
    where ``mlx_compat.generate_step_problem`` finds it as expected; else leave it stock and keep
    the reason for ``--streaming-stats``. Modules that import ``generate_step`` by name
    (``cache_prompt``) do so after this runs, and get the wrapper."""
    from ..runtime.memory import report
    from ..runtime.mlx_compat import generate_step_problem
    from ..runtime.prefill import layer_major

    stock = getattr(generate, "generate_step", None)
    if stock is None or getattr(stock, "mlx_lm_streaming", False):
        return
    why = generate_step_problem(stock)
    if why is not None:
        report.note_at_exit(f"[streaming] layer-major prefill does not apply ({why}): long "
                            "prompts prefill chunk by chunk")
        return
    generate.generate_step = layer_major.wrap_generate_step(stock)
    wrap_other_prefills(generate)


def wrap_other_prefills(generate) -> None:
    """The prefills of ``mlx_lm.generate`` that do not go through ``generate_step`` (mlx-lm's
    ``BatchGenerator``, ``speculative_generate_step``): layer-major prefill does not apply there,
    and a long prompt's stats line says so (``layer_major.note_elsewhere``). Each only where
    ``mlx_compat``'s check finds it as expected; else left stock, silent."""
    from ..runtime.prefill import layer_major
    from ..runtime.mlx_compat import (
        batch_insert_problem,
        speculative_problem,
        wrap_batch_insert,
    )

    batch = getattr(generate, "BatchGenerator", None)
    if batch_insert_problem(batch) is None:
        wrap_batch_insert(batch, layer_major.note_batched)
    speculative = getattr(generate, "speculative_generate_step", None)
    if (
        callable(speculative)
        and not getattr(speculative, "mlx_lm_streaming", False)
        and speculative_problem(speculative) is None
    ):
        generate.speculative_generate_step = layer_major.wrap_speculative(speculative)
