"""Architecture adapters: declarative notes on where a model family keeps its routed experts.

mlx-lm builds, sanitizes and quantizes the model; an adapter only says how a raw Hugging Face
checkpoint names one expert's tensor (by default ``{parent}.experts.{expert}.{proj}.{part}``, ``parent``
being the module that holds the ``switch_mlp``). Converted (stacked) checkpoints need no naming at all.
The routed experts are always mlx-lm's ``SwitchGLU`` modules (subclasses included): loading streams
their three projections, ``gate_proj``, ``up_proj`` and ``down_proj``; or its ``SwitchMLP``
(nemotron_h, phixtral): ``fc1`` and ``fc2``, the module's own activation between them.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Tuple, Union

from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from ..errors import CheckpointError

DEFAULT_RAW_KEY = "{parent}.experts.{expert}.{proj}.{part}"
# config keys every adapter's model reads as a count (besides its experts and experts per token)
COUNT_KEYS = ("num_hidden_layers", "hidden_size")


@dataclass(frozen=True)
class ArchitectureAdapter:
    """Where one family of mlx-lm models keeps its routed experts."""

    # mlx-lm model modules this adapter covers (``mlx_lm.models.<name>``)
    model_types: Tuple[str, ...]
    # how a raw HF checkpoint names one expert's tensor: a template, a function
    # (path, expert, proj, part) -> name or None, or None: only converted checkpoints stream
    raw_key: Union[str, Callable, None] = DEFAULT_RAW_KEY
    # stock projection name -> raw checkpoint name (Mixtral: gate_proj -> w1)
    raw_projections: Mapping[str, str] = field(default_factory=dict)
    # the config keys of the routed experts per layer and the experts each token picks, checked
    # before mlx-lm builds the model (``check_config``)
    num_experts_key: str = "num_experts"
    top_k_key: str = "num_experts_per_tok"
    # the part of config.json that holds them: None, the top level; "text_config" (llama4)
    config_section: Optional[str] = None

    def check_config(self, config: dict, args_class, path) -> None:
        """``CheckpointError`` naming ``path`` (the config.json) and the key, where a count the
        model is built from is missing, not a whole number of at least 1, or where a token picks
        more experts than a layer has: stock mlx-lm fails on these with a ``TypeError``,
        chained tracebacks, or an ``argpartition`` error at the first token, or builds a plan
        from them without a word. At the top level, only keys that ``args_class`` (the model's
        ``ModelArgs``) takes are checked, and a missing one only where it has no default."""
        section, prefix = config, ""
        # key -> default (``_REQUIRED``: none), for the keys the model's args class takes
        defaults = _defaults(args_class)
        if self.config_section is not None:
            section, prefix = config.get(self.config_section), self.config_section + "."
            if not isinstance(section, dict):
                raise CheckpointError(f"{path}: {self.config_section} must be a JSON object")
        counts = {}
        for key in COUNT_KEYS + (self.num_experts_key, self.top_k_key):
            if self.config_section is not None:
                # a wrapper's text model has its own defaults (and may be dense): a missing key
                # is that model's to judge
                default = None
            elif defaults is None:
                default = None  # not a dataclass: a missing key is the model's to judge
            elif key in defaults:
                default = defaults[key]
            else:
                continue  # the model does not read it
            if key not in section:
                if default is _REQUIRED:
                    raise CheckpointError(f"{path}: {prefix}{key} is missing (the model needs it)")
                counts[key] = default
                continue
            value = section[key]
            if value is None and default is None:
                counts[key] = None  # optional, e.g. no routed experts: a dense model
                continue
            # a list: one count per layer (hunyuan's moe_topk)
            per_layer = value if isinstance(value, list) and value else [value]
            for v in per_layer:
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    lists = " (or a list of them, one per layer)" if per_layer is value else ""
                    raise CheckpointError(
                        f"{path}: {prefix}{key} is {value!r}; it must be a whole number, 1 or "
                        f"more{lists}"
                    )
            counts[key] = max(per_layer)
        experts, top_k = counts.get(self.num_experts_key), counts.get(self.top_k_key)
        if isinstance(experts, int) and isinstance(top_k, int) and top_k > experts:
            raise CheckpointError(
                f"{path}: {prefix}{self.top_k_key} is {top_k}, more than the {experts} experts "
                f"of {prefix}{self.num_experts_key}: a token cannot pick more experts than a "
                "layer has"
            )

    def is_routed_experts(self, path: str, module) -> bool:
        """Every ``SwitchGLU`` and ``SwitchMLP`` by default; a subclass may leave some out (by
        path)."""
        return isinstance(module, (SwitchGLU, SwitchMLP))

    def raw_name(self, path: str, expert: int, proj: str, part: str) -> Optional[str]:
        if self.raw_key is None:
            return None
        if callable(self.raw_key):
            return self.raw_key(path, expert, proj, part)
        parent = path.rsplit(".", 1)[0]
        proj = self.raw_projections.get(proj, proj)
        return self.raw_key.format(parent=parent, expert=expert, proj=proj, part=part)


_REQUIRED = object()


def _defaults(args_class) -> Optional[dict]:
    """``field name -> default`` (``_REQUIRED`` where there is none) of a dataclass, else None."""
    if not dataclasses.is_dataclass(args_class):
        return None
    out = {}
    for f in dataclasses.fields(args_class):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = None
        else:
            out[f.name] = _REQUIRED
    return out
