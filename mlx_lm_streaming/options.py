"""Streaming options and the three ways to ask for them.

1. ``model_config={"streaming_experts": {...}}`` (or ``True``) in code;
2. environment variables, for scripts that cannot take a flag: ``MLX_LM_STREAMING_EXPERTS=1`` plus
   ``MLX_LM_STREAMING_CACHE_GB``, ``MLX_LM_STREAMING_STORE``, ``MLX_LM_STREAMING_KERNEL``,
   ``MLX_LM_STREAMING_STATS``, ``MLX_LM_STREAMING_DIRECT_READS``, ``MLX_LM_STREAMING_CACHE_POLICY``,
   ``MLX_LM_STREAMING_RECORD_ROUTING``;
3. CLI flags on the mlx-lm commands (``--streaming-experts`` ...), which set the environment variables
   for the process (see ``integration``).

An explicit ``model_config`` entry wins over the environment; ``{"streaming_experts": False}`` turns
streaming off even when the environment asks for it.
"""

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Optional

from .errors import ConfigurationError
from .policy import DEFAULT_POLICY, POLICIES

CONFIG_KEY = "streaming_experts"
ENV = {
    "enabled": "MLX_LM_STREAMING_EXPERTS",
    "expert_cache_gb": "MLX_LM_STREAMING_CACHE_GB",
    "store": "MLX_LM_STREAMING_STORE",
    "kernel": "MLX_LM_STREAMING_KERNEL",
    "stats": "MLX_LM_STREAMING_STATS",
    "direct_reads": "MLX_LM_STREAMING_DIRECT_READS",
    "cache_policy": "MLX_LM_STREAMING_CACHE_POLICY",
    "record_routing": "MLX_LM_STREAMING_RECORD_ROUTING",
}
TRUE = ("1", "true", "yes", "on")
FALSE = ("", "0", "false", "no", "off")


@dataclass
class StreamingOptions:
    """What to stream through: cache budget, store backend, kernel choice."""

    expert_cache_gb: Optional[float] = None  # None: derived from memory (docs/usage.md)
    store: str = "safetensors"
    kernel: str = "auto"
    stats: bool = False  # print one summary line at exit
    store_options: Dict[str, Any] = field(default_factory=dict)
    # demand reads straight into the slot banks (bank_io.py): None = where verified bit-exact, i.e.
    # MLX's CPU backend; on CUDA and Metal off unless asked for (docs/usage.md says why)
    direct_reads: Optional[bool] = None
    # which resident expert a full bank evicts (policy.py): "decay" (default) or "lru"
    cache_policy: str = DEFAULT_POLICY
    # write the run's routing to this file as it goes (routing_trace.py; docs/routing.md)
    record_routing: Optional[str] = None

    def __post_init__(self):
        if self.expert_cache_gb is not None:
            try:
                self.expert_cache_gb = float(self.expert_cache_gb)
            except (TypeError, ValueError):
                raise ConfigurationError(
                    f"expert_cache_gb must be a number of GB, got {self.expert_cache_gb!r}"
                ) from None
            if not self.expert_cache_gb > 0:
                raise ConfigurationError(
                    f"expert_cache_gb must be positive, got {self.expert_cache_gb}"
                )
        for name in ("store", "kernel"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigurationError(f"{name} must be a non-empty name")
        if self.record_routing is not None:
            if not isinstance(self.record_routing, (str, os.PathLike)) or not str(
                self.record_routing
            ):
                raise ConfigurationError("record_routing must be a file path")
            self.record_routing = str(self.record_routing)
        if self.cache_policy not in POLICIES:
            raise ConfigurationError(
                f"cache_policy {self.cache_policy!r} is unknown; known: "
                f"{', '.join(sorted(POLICIES))}"
            )
        value = self.direct_reads
        if isinstance(value, str):
            word = value.strip().lower()
            value = None if word == "auto" else True if word in TRUE else False if word in FALSE else value
        if value is not None and not isinstance(value, bool):
            raise ConfigurationError(
                f"direct_reads must be true, false or auto, got {self.direct_reads!r}"
            )
        self.direct_reads = value

    def use_direct_reads(self, backend: str) -> bool:
        """Whether demand reads go straight into the banks on ``backend`` (cpu, cuda, metal)."""
        if self.direct_reads is None:
            # on CUDA since the H200 measurements (docs/benchmarks/gpu-trace.md): 1.15-1.3x cold,
            # stock's logits token by token; Metal stays off until checked on a Mac
            return backend in ("cpu", "cuda")
        return self.direct_reads

    @classmethod
    def from_value(cls, value) -> Optional["StreamingOptions"]:
        """From a ``model_config["streaming_experts"]`` value: bool, dict or options."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = set(value) - known - {"enabled"}
            if unknown:
                raise ConfigurationError(
                    f"unknown streaming_experts option(s) {sorted(unknown)}; known: "
                    f"{sorted(known)}"
                )
            if value.get("enabled", True) in (False, 0):
                return None
            return cls(**{k: v for k, v in value.items() if k in known})
        raise ConfigurationError(
            f"model_config['streaming_experts'] must be a bool or a dict, got {value!r}"
        )

    @classmethod
    def from_env(cls, environ=os.environ) -> Optional["StreamingOptions"]:
        flag = environ.get(ENV["enabled"], "").strip().lower()
        if flag in FALSE:
            return None
        if flag not in TRUE:
            raise ConfigurationError(
                f"{ENV['enabled']}={environ[ENV['enabled']]!r}: use 1 or 0"
            )
        kwargs = {}
        for name in ("expert_cache_gb", "store", "kernel", "direct_reads", "cache_policy",
                     "record_routing"):
            if environ.get(ENV[name]):
                kwargs[name] = environ[ENV[name]]
        kwargs["stats"] = environ.get(ENV["stats"], "").strip().lower() in TRUE
        try:
            return cls(**kwargs)
        except ConfigurationError as e:
            raise ConfigurationError(f"from the environment: {e}") from None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def requested(model_config: Optional[dict]) -> Optional[StreamingOptions]:
    """The options asked for by ``model_config`` or, failing that, the environment."""
    if model_config and CONFIG_KEY in model_config:
        return StreamingOptions.from_value(model_config[CONFIG_KEY])
    return StreamingOptions.from_env()
