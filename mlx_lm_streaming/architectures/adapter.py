"""Architecture adapters: declarative notes on where a model family keeps its routed experts.

mlx-lm builds, sanitizes and quantizes the model; an adapter only says how a raw Hugging Face
checkpoint names one expert's tensor (by default ``{parent}.experts.{expert}.{proj}.{part}``, ``parent``
being the module that holds the ``switch_mlp``). Converted (stacked) checkpoints need no naming at all.
The routed experts are always mlx-lm's ``SwitchGLU`` modules (subclasses included): loading streams
their three projections, ``gate_proj``, ``up_proj`` and ``down_proj``.
"""

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Tuple, Union

from mlx_lm.models.switch_layers import SwitchGLU

DEFAULT_RAW_KEY = "{parent}.experts.{expert}.{proj}.{part}"


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

    def is_routed_experts(self, path: str, module) -> bool:
        """Every ``SwitchGLU`` by default; a subclass may leave some out (by path)."""
        return isinstance(module, SwitchGLU)

    def raw_name(self, path: str, expert: int, proj: str, part: str) -> Optional[str]:
        if self.raw_key is None:
            return None
        if callable(self.raw_key):
            return self.raw_key(path, expert, proj, part)
        parent = path.rsplit(".", 1)[0]
        proj = self.raw_projections.get(proj, proj)
        return self.raw_key.format(parent=parent, expert=expert, proj=proj, part=part)
