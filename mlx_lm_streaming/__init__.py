"""mlx_lm_streaming: run Mixture-of-Experts models larger than RAM with mlx-lm.

The routed experts' weights are read from the checkpoint on demand (only those the router picks) into a
byte-budgeted slot-bank cache; everything else is the stock mlx-lm model. Logits are bit-identical to the
fully resident model. ``load`` is ``mlx_lm.load`` with the experts streamed.
"""

__version__ = "0.1.0"


def load(path_or_hf_repo, **kwargs):
    """``mlx_lm.load(path, **kwargs)`` with the routed experts streamed from disk.

    The keywords named in ``option_table.OPTIONS`` are streaming options (``expert_cache_gb``,
    ``store``, ``store_options``, ``kernel``, ``cache_policy``, ``direct_reads``, ``layer_major_prefill``, ``stats``,
    ``verbose``, ``record_routing``, ``trace``, ``pack``, ``if_unstreamable``; docs/usage.md); the
    environment variables give those not given here, as for ``mlx_lm.load``. The other keywords go
    to ``mlx_lm.load``. A model without experts loads as stock, with one line on stderr; one whose
    experts cannot stream raises ``UnsupportedModelError`` unless ``if_unstreamable="whole"``.

    Returns exactly what ``mlx_lm.load`` returns: ``(model, tokenizer)`` or, with
    ``return_config=True``, ``(model, tokenizer, config)``. The streaming state (cache, store, stats)
    is ``model.expert_streaming``. ``verbose=True`` says on stderr which budget was chosen;
    ``stats=True`` (or ``"layers"``) prints the ``--streaming-stats`` line (and table) at exit.
    """
    import inspect
    from dataclasses import fields

    import mlx_lm.utils

    from .errors import ConfigurationError
    from .integration.integration import install
    from .runtime.options import CONFIG_KEY, StreamingOptions

    install()
    names = {f.name for f in fields(StreamingOptions)}
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    stock = inspect.signature(mlx_lm.utils.load).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in stock.values())
    unknown = sorted(set(kwargs) - set(stock))
    if unknown and not takes_any:
        raise ConfigurationError(
            f"mlx_lm_streaming.load: unknown keyword {unknown[0]!r}; streaming options: "
            f"{', '.join(sorted(names - {'tuning'}))}; mlx_lm.load's: "
            f"{', '.join(n for n in stock if n != 'path_or_hf_repo')}"
        )
    model_config = dict(kwargs.pop("model_config", None) or {})
    model_config[CONFIG_KEY] = StreamingOptions.from_value(options)
    return mlx_lm.utils.load(path_or_hf_repo, model_config=model_config, **kwargs)
