"""What cannot stream, and what a load that asks for streaming does with it.

``REFUSED`` is the one list of mlx-lm's Mixture-of-Experts model modules that do not stream, each
with its reason: the loader's refusal names it, and ``tests/test_architectures.py`` holds every MoE
model module of mlx-lm to being streamed (an adapter) or listed here (docs/architectures.md names
each). Keys are mlx-lm model modules (``mlx_lm.models.<name>``, the module of the model's class:
``MODEL_REMAPPING`` has led there already). A plugin's adapter for one of them wins over the list.

A model with no routed experts (no ``switch_layers`` module) loads as stock would, with one line. A
Mixture-of-Experts model that cannot stream is refused in one line where ``--streaming-experts`` or
``model_config`` asks for streaming, and loads whole, as stock, with one line where only the
environment does (``MLX_LM_STREAMING_EXPERTS``: a standing wish for every load); the
``if_unstreamable`` option (``--if-unstreamable refuse|whole``) says which, whichever way it came.
"""

from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from .. import plugins
from ..errors import NotMixtureOfExpertsError, UnstreamableModelError
from ..option_table import BY_NAME
from ..runtime.options import UNSTREAMABLE

# stock mlx-lm routes muse_spark's experts and computes its norms with the Metal kernels of
# mlx_lm/kernels: it runs only where Metal does, and no machine of this project has it
_METAL_ONLY = (
    "stock mlx-lm runs it only on Metal (its expert routing is a Metal kernel of "
    "mlx_lm.kernels), where streaming it is not yet checked against stock"
)

REFUSED = {
    "dbrx": "its experts are a list of per-expert MLP modules that stock computes one by one, "
    "not a switch_layers module",
    "muse_spark": _METAL_ONLY,
    # mlx-lm 0.32.1's name for muse_spark
    "muse_spark_open": _METAL_ONLY,
}

OPTION = BY_NAME["if_unstreamable"]
REFUSE, WHOLE = UNSTREAMABLE


def model_module(model_class) -> str:
    """The mlx-lm model module of a model class (``mlx_lm.models.<name>``): what adapters and
    ``REFUSED`` are keyed by."""
    return model_class.__module__.rsplit(".", 1)[-1]


def refuse_listed(module: str, model_type, model_path) -> None:
    """``UnstreamableModelError`` where ``REFUSED`` lists ``module`` and no adapter takes it; called
    before the model is built, so nothing is read."""
    why = REFUSED.get(module)
    if why is not None and module not in plugins.architectures():
        raise UnstreamableModelError(
            f"{model_path}: model_type {model_type!r} cannot stream: {why}"
        )


def adapter_for(model, config: dict, model_path):
    """The adapter of ``model``'s family; else ``NotMixtureOfExpertsError`` where the model has no
    ``switch_layers`` module (nothing to stream), ``UnstreamableModelError`` where it has one."""
    module = model_module(type(model))
    model_type = config.get("model_type")
    refuse_listed(module, model_type, model_path)  # (dbrx's experts are no switch_layers module)
    if not any(isinstance(m, (SwitchGLU, SwitchMLP)) for _, m in model.named_modules()):
        raise NotMixtureOfExpertsError(
            f"{model_path}: model_type {model_type!r} is not a Mixture-of-Experts model"
        )
    adapter = plugins.architectures().get(module)
    if adapter is None:
        raise UnstreamableModelError(
            f"{model_path}: model_type {model_type!r} cannot stream: mlx_lm.models.{module} has "
            "no streaming adapter (docs/architectures.md; docs/plugins.md says how to add one)"
        )
    return adapter


def instead(error, options, explicit: bool):
    """For a load that asked for streaming and got ``error`` (an ``UnsupportedModelError``): the
    one line to print before loading the model as stock would, or None where it is refused. A
    model with no routed experts always loads. One that cannot stream does what
    ``if_unstreamable`` says (the ``--streaming-experts`` flag sets it to refuse unless given);
    left out, it is refused where ``model_config`` asked (``explicit``) and loads whole where
    only the environment did."""
    if isinstance(error, NotMixtureOfExpertsError):
        return f"mlx-lm-streaming: {error}: loaded as stock mlx-lm would"
    choice = options.if_unstreamable or (REFUSE if explicit else WHOLE)
    if choice == REFUSE:
        return None
    return f"mlx-lm-streaming: {error}: loaded whole, as stock mlx-lm would"


def refusal(error):
    """``error`` with how to load the model whole anyway: the one line of a refusal."""
    return type(error)(
        f"{error}; to load every expert as stock does: {OPTION.flag} {WHOLE} "
        f"({OPTION.env}={WHOLE}; in code, {OPTION.name}={WHOLE!r})"
    )
