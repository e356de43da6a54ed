"""Patches that make stock mlx-lm entry points build streaming models when asked.

mlx-lm has no plugin mechanism, so ``install()`` rebinds ``mlx_lm.utils.load_model`` to a wrapper that
builds a streaming model when ``model_config["streaming_experts"]`` or ``MLX_LM_STREAMING_EXPERTS`` asks
for one, and calls the stock function untouched otherwise. ``load`` needs no patch of its own: it looks
``load_model`` up in its module at call time.
"""

import functools

from .options import requested

_installed = False


def install() -> None:
    """Idempotently wrap ``mlx_lm.utils.load_model``."""
    global _installed
    if _installed:
        return
    import mlx_lm.utils as utils

    from .loading import load_streaming_model

    stock_load_model = utils.load_model

    @functools.wraps(stock_load_model)
    def load_model(
        model_path,
        lazy=False,
        strict=True,
        model_config=None,
        get_model_classes=None,
        trust_remote_code=False,
    ):
        options = requested(model_config)
        if options is None:
            kwargs = {}
            if get_model_classes is not None:
                kwargs["get_model_classes"] = get_model_classes
            return stock_load_model(
                model_path,
                lazy,
                strict,
                model_config=model_config,
                trust_remote_code=trust_remote_code,
                **kwargs,
            )
        return load_streaming_model(
            stock_load_model,
            model_path,
            options,
            lazy=lazy,
            strict=strict,
            model_config=model_config,
            get_model_classes=get_model_classes,
            trust_remote_code=trust_remote_code,
        )

    load_model.stock = stock_load_model
    utils.load_model = load_model
    _installed = True
