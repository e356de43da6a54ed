"""mlx_lm_streaming: run Mixture-of-Experts models larger than RAM with mlx-lm.

The routed experts' weights are read from the checkpoint on demand (only those the router picks) into a
byte-budgeted slot-bank cache; everything else is the stock mlx-lm model. Logits are bit-identical to the
fully resident model. ``load`` is ``mlx_lm.load`` with the experts streamed.
"""

__version__ = "0.1.0"


def load(
    path_or_hf_repo,
    *,
    expert_cache_gb=None,
    store="safetensors",
    kernel="auto",
    store_options=None,
    direct_reads=None,
    stats=False,
    pack=None,
    verbose=False,
    **kwargs,
):
    """``mlx_lm.load(path, **kwargs)`` with the routed experts streamed from disk.

    Returns exactly what ``mlx_lm.load`` returns: ``(model, tokenizer)`` or, with
    ``return_config=True``, ``(model, tokenizer, config)``. The streaming state (cache, store, stats)
    is ``model.expert_streaming``. ``verbose=True`` says on stderr which budget was chosen;
    ``stats=True`` (or ``"layers"``) prints the ``--streaming-stats`` line (and table) at exit.
    """
    import mlx_lm.utils

    from .integration import install
    from .options import CONFIG_KEY, StreamingOptions

    install()
    model_config = dict(kwargs.pop("model_config", None) or {})
    model_config[CONFIG_KEY] = StreamingOptions(
        expert_cache_gb=expert_cache_gb,
        store=store,
        kernel=kernel,
        store_options=dict(store_options or {}),
        direct_reads=direct_reads,
        stats=stats,
        pack=pack,
        verbose=verbose,
    )
    return mlx_lm.utils.load(path_or_hf_repo, model_config=model_config, **kwargs)
