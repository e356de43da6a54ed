"""How the runtime gets into mlx-lm.

``loading`` builds a streaming model inside mlx-lm's own ``load_model`` (the routed ``SwitchGLU``
modules swapped for streaming ones over an expert cache); ``integration`` patches mlx-lm's ``load``
and command-line entry points (``cli``: their flags), through ``runtime.mlx_compat``'s version and
shape guard. The
startup hook (``_bootstrap``), the public ``load`` and the distributed ``pipeline_generate`` stay at
the package's top and call in here.

May import: errors, option_table, plugins, runtime, files, kernels
"""


def __getattr__(name):
    """``mlx_lm_streaming.integration.install`` (and ``patch_module``), where they were before the
    wings, imported only when asked for: the wing itself imports nothing."""
    if name in ("install", "patch_module"):
        from . import integration

        return getattr(integration, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
