"""Streaming options and the three ways to ask for them.

1. ``model_config={"streaming_experts": {...}}`` (or ``True``) in code;
2. environment variables, for scripts that cannot take a flag: ``MLX_LM_STREAMING_EXPERTS=1`` plus
   ``MLX_LM_STREAMING_CACHE_GB``, ``MLX_LM_STREAMING_STORE``, ``MLX_LM_STREAMING_KERNEL``,
   ``MLX_LM_STREAMING_STATS``, ``MLX_LM_STREAMING_DIRECT_READS``, ``MLX_LM_STREAMING_CACHE_POLICY``,
   ``MLX_LM_STREAMING_RECORD_ROUTING``, ``MLX_LM_STREAMING_TRACE``, ``MLX_LM_STREAMING_PACK``;
3. CLI flags on the mlx-lm commands (``--streaming-experts`` ...), which set the environment variables
   for the process (see ``integration``).

An explicit ``model_config`` entry wins over the environment; ``{"streaming_experts": False}`` turns
streaming off even when the environment asks for it.
"""

import math
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
    "trace": "MLX_LM_STREAMING_TRACE",
    "pack": "MLX_LM_STREAMING_PACK",
}
# Of the memory the resident weights leave free, this share goes to the expert cache by default; the
# rest stays for the OS page cache, the KV cache and activations.
DEFAULT_CACHE_SHARE = 0.5
TRUE = ("1", "true", "yes", "on")
FALSE = ("", "0", "false", "no", "off")
GiB = 1 << 30


def format_size(nbytes: float) -> str:
    """Bytes in the largest unit that keeps them readable: ``512 B``, ``95.4 KB``, ``2.5 GB``."""
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024


def decimal_gb(nbytes: float) -> str:
    """Bytes as decimal GB (10**9 bytes, as mlx-lm's "Peak memory"): ``4.295 GB``, ``0.00265 GB``."""
    gb = nbytes / 1e9
    return f"{gb:.3f} GB" if gb >= 1 else f"{gb:.3g} GB"


def gb_at_least(nbytes: int) -> str:
    """``nbytes`` as a number of GB to pass to ``--expert-cache-gb``, rounded up (3 digits)."""
    gb = nbytes / GiB
    step = 10.0 ** (math.floor(math.log10(gb)) - 2)
    value = math.ceil(gb / step) * step
    text = f"{value:.3g}"
    while int(float(text) * GiB) < nbytes:  # loading takes int(gb * 2**30) bytes
        value += step
        text = f"{value:.3g}"
    return text


def missing_local_path(name: str) -> bool:
    """Whether ``name`` can only be a local path (not a Hugging Face repo id) and nothing is there."""
    if not isinstance(name, str) or os.path.exists(name):
        return False
    return (
        os.path.isabs(name)
        or name.startswith(("./", "../", "~"))
        or name.count("/") > 1
    )


def check_budget_gb(value) -> float:
    """A budget in GiB as a float: a positive, finite number (raises ``ConfigurationError``)."""
    try:
        gb = float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{value!r} is not a number of GB") from None
    if not gb > 0:
        raise ConfigurationError(f"{value!r}: the budget must be positive")
    if not math.isfinite(gb * GiB):
        raise ConfigurationError(
            f"{value!r}: the budget must be a finite number of GB (leave it out for the default; "
            "a budget above the experts' total keeps every expert)"
        )
    return gb


def parse_stats(value):
    """``stats`` as False, True (one line at exit) or ``"layers"`` (and a per-layer table)."""
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    if word == "layers":
        return "layers"
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ConfigurationError(f"stats must be true, false or 'layers', got {value!r}")


@dataclass
class StreamingOptions:
    """What to stream through: cache budget, store backend, kernel choice."""

    expert_cache_gb: Optional[float] = None  # None: derived from memory (docs/usage.md)
    store: str = "safetensors"
    kernel: str = "auto"
    # at exit, print one summary line (True), and a table per MoE layer ("layers")
    stats: Any = False
    # say at load which budget was chosen, on stderr (the mlx-lm commands always do)
    verbose: bool = False
    store_options: Dict[str, Any] = field(default_factory=dict)
    # demand reads straight into the slot banks (bank_io.py): None = where verified bit-exact, i.e.
    # MLX's CPU backend; on CUDA and Metal off unless asked for (docs/usage.md says why)
    direct_reads: Optional[bool] = None
    # which resident expert a full bank evicts (policy.py): "decay_next" (default), "decay", "lru"
    cache_policy: str = DEFAULT_POLICY
    # write the run's routing to this file as it goes (routing_trace.py; docs/routing.md)
    record_routing: Optional[str] = None
    # write a timeline of reads, installs, syncs and compute to this file (timeline.py)
    trace: Optional[str] = None
    # the expert pack to read (``mlx_lm_streaming pack``; a file, or a directory holding
    # experts.pack): implies store "packed" and becomes its ``path`` store option
    pack: Optional[str] = None
    # internal, not a user option: an ``expert_cache.CacheTuning`` for benchmarks and tests (its
    # ``direct_reads`` and ``skip_sync`` are set from the options above); None: the defaults
    tuning: Any = field(default=None, repr=False, metadata={"internal": True})

    def __post_init__(self):
        if self.expert_cache_gb is not None:
            try:
                self.expert_cache_gb = check_budget_gb(self.expert_cache_gb)
            except ConfigurationError as e:
                raise ConfigurationError(f"expert_cache_gb {e}") from None
        for name in ("store", "kernel"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigurationError(f"{name} must be a non-empty name")
        if self.record_routing is not None:
            if not isinstance(self.record_routing, (str, os.PathLike)) or not str(
                self.record_routing
            ):
                raise ConfigurationError("record_routing must be a file path")
            self.record_routing = str(self.record_routing)
        if self.trace is not None:
            if not isinstance(self.trace, (str, os.PathLike)) or not str(self.trace):
                raise ConfigurationError("trace must be a file path")
            self.trace = str(self.trace)
        if self.pack is not None:
            self._use_pack()
        if self.cache_policy not in POLICIES:
            raise ConfigurationError(
                f"cache_policy {self.cache_policy!r} is unknown; known: "
                f"{', '.join(sorted(POLICIES))}"
            )
        self.stats = parse_stats(self.stats)
        if not isinstance(self.verbose, bool):
            raise ConfigurationError(f"verbose must be true or false, got {self.verbose!r}")
        value = self.direct_reads
        if isinstance(value, str):
            word = value.strip().lower()
            value = None if word == "auto" else True if word in TRUE else False if word in FALSE else value
        if value is not None and not isinstance(value, bool):
            raise ConfigurationError(
                f"direct_reads must be true, false or auto, got {self.direct_reads!r}"
            )
        self.direct_reads = value

    def _use_pack(self) -> None:
        if not isinstance(self.pack, (str, os.PathLike)) or not str(self.pack):
            raise ConfigurationError("pack must be a file or directory path")
        self.pack = str(self.pack)
        if self.store == "safetensors":  # the default: a pack implies the packed store
            self.store = "packed"
        if self.store != "packed":
            raise ConfigurationError(f"pack needs the packed store, not store {self.store!r}")
        path = self.store_options.get("path", self.pack)
        if str(path) != self.pack:
            raise ConfigurationError(
                f"pack {self.pack!r} and store_options path {str(path)!r} differ; give one"
            )
        self.store_options = {**self.store_options, "path": self.pack}

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
                     "record_routing", "trace", "pack"):
            if environ.get(ENV[name]):
                kwargs[name] = environ[ENV[name]]
                try:  # one at a time, so that the error names the variable at fault
                    cls(**{name: kwargs[name]})
                except ConfigurationError as e:
                    raise ConfigurationError(
                        f"{ENV[name]}={environ[ENV[name]]!r}: {e}"
                    ) from None
        if kwargs.get("pack") and kwargs.get("store", "packed") != "packed":
            raise ConfigurationError(
                f"{ENV['pack']} needs {ENV['store']}=packed (or unset), not {kwargs['store']!r}"
            )
        try:
            kwargs["stats"] = parse_stats(environ.get(ENV["stats"], ""))
        except ConfigurationError:
            raise ConfigurationError(
                f"{ENV['stats']}={environ[ENV['stats']]!r}: use 1, 0 or layers"
            ) from None
        return cls(**kwargs)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def requested(model_config: Optional[dict]) -> Optional[StreamingOptions]:
    """The options asked for by ``model_config`` or, failing that, the environment."""
    if model_config and CONFIG_KEY in model_config:
        return StreamingOptions.from_value(model_config[CONFIG_KEY])
    return StreamingOptions.from_env()
