"""Streaming options: what they may be, and where they come from.

Every option is a row of ``option_table.OPTIONS``: a ``model_config["streaming_experts"]`` key (and
``mlx_lm_streaming.load`` keyword), an environment variable and, for all but ``verbose``, a flag of the
mlx-lm commands, which sets the variable for the process (see ``integration``). ``StreamingOptions``
checks the values, whichever way they came.

The environment applies wherever streaming is asked for: ``MLX_LM_STREAMING_EXPERTS=1`` turns it on for
every load; for a load that asks for streaming itself (``model_config``, ``mlx_lm_streaming.load``) the
other variables give the values it does not; ``{"streaming_experts": False}`` turns it off for a load.
"""

import math
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Optional

from ..errors import ConfigurationError
from ..option_table import ENV, GB, OFF_WORDS, ON_WORDS, OPTIONS
from .policy import DEFAULT_POLICY, POLICIES
from .variables import misspelt, unknown_variables

CONFIG_KEY = "streaming_experts"
TRUE = ON_WORDS
FALSE = ("",) + OFF_WORDS


def missing_local_path(name: str) -> bool:
    """Whether ``name`` can only be a local path (not a Hugging Face repo id) and nothing is there."""
    if not isinstance(name, str) or os.path.exists(name):
        return False
    return (
        os.path.isabs(name)
        or name.startswith(("./", "../", "~"))
        or name.count("/") > 1
    )


def same_file(a, b) -> bool:
    """Whether paths ``a`` and ``b`` name one file (spelt alike or not, through links, existing or
    not yet)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_budget_gb(value) -> float:
    """A budget in decimal GB as a float: a positive, finite number (raises ``ConfigurationError``).

    A budget is a cap: one above what every expert takes means "every expert". Whether the cache
    and the resident weights fit this machine is checked at load, once the model says what the
    cache would really take (``loading.check_budget_fits``)."""
    try:
        gb = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigurationError(f"{value!r} is not a number of GB") from None
    if gb != gb:
        raise ConfigurationError(f"{value!r} is not a number (a number of GB is needed)")
    if not gb > 0:
        raise ConfigurationError(f"{value!r}: the budget must be positive")
    if not math.isfinite(gb * GB):
        raise ConfigurationError(
            f"{value!r}: the budget must be a finite number of GB (leave it out for the default; "
            "a budget above the experts' total keeps every expert)"
        )
    return gb


def check_host_gb(value) -> float:
    """``expert_host_gb`` as a float: 0 (no host tier) or a positive, finite number of GB."""
    try:
        gb = float(value)
    except (TypeError, ValueError, OverflowError):
        gb = float("nan")
    if not (gb == 0 or gb > 0 and math.isfinite(gb * GB)):
        raise ConfigurationError(
            f"expert_host_gb {value!r}: give 0 (no host tier) or a positive number of GB"
        )
    return gb + 0.0


# every spelling a yes/no value takes, for the message that refuses another
SWITCH_WORDS = (
    f"{', '.join(ON_WORDS[:-1])} or {ON_WORDS[-1]} (on), or {', '.join(OFF_WORDS[:-1])} or "
    f"{OFF_WORDS[-1]} (off)"
)


def parse_switch(value, what: str) -> bool:
    """A yes/no option: a bool, 0 or 1, or one of the words of ``option_table``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    word = value.strip().lower() if isinstance(value, str) else None
    if word in TRUE:
        return True
    if word in OFF_WORDS:
        return False
    raise ConfigurationError(f"{what} must be {SWITCH_WORDS}, got {value!r}")


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
    raise ConfigurationError(f"stats must be {SWITCH_WORDS}, or layers, got {value!r}")


def _option_value(text: str):
    """``"8"`` -> 8, ``"0.5"`` -> 0.5, ``"true"`` -> True, anything else stays text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    word = text.lower()
    if word in ("true", "false"):
        return word == "true"
    return text


def parse_store_options(value) -> Dict[str, Any]:
    """``store_options``: a dict, or its text form ``key=value,key=value``."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ConfigurationError(f"store_options keys must be names, got {value!r}")
        return dict(value)
    if not isinstance(value, str):
        raise ConfigurationError(f"store_options must be a dict or key=value,..., got {value!r}")
    options = {}
    for item in filter(None, (p.strip() for p in value.split(","))):
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise ConfigurationError(
                f"store_options {value!r}: {item!r} is not key=value (e.g. threads=8)"
            )
        options[key.strip()] = _option_value(text.strip())
    return options


# the values of ``if_unstreamable``
UNSTREAMABLE = ("refuse", "whole")


def parse_choice(value, name: str, choices) -> Optional[str]:
    """One of ``choices`` (a word, any case), or None where not given."""
    if value is None:
        return None
    word = value.strip().lower() if isinstance(value, str) else value
    if word not in choices:
        raise ConfigurationError(f"{name} must be {' or '.join(choices)}, got {value!r}")
    return word


def auto_switch(value, name: str) -> Optional[bool]:
    """An ``auto|on|off`` option: None (auto), True or False, from a bool, None or a word."""
    if isinstance(value, str):
        word = value.strip().lower()
        value = None if word == "auto" else True if word in TRUE else False if word in FALSE else value
    if value is not None and not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be {SWITCH_WORDS}, or auto, got {value!r}")
    return value


@dataclass
class StreamingOptions:
    """What to stream through: cache budget, store backend, kernel choice. The fields are the rows
    of ``option_table.OPTIONS`` (but ``enabled``), and ``tuning``."""

    # decimal GB (10**9 bytes); None: derived from memory (docs/usage.md)
    expert_cache_gb: Optional[float] = None
    # the budget pinned: the cache keeps it whatever the memory free; off (default): the budget
    # is a ceiling, the cache follows free memory below it (moving_budget.py)
    expert_cache_fixed: bool = False
    # mlx-cuda only: decimal GB of host memory for the experts the device budget cannot hold
    # (runtime/memory/tiers.py); 0: none; None: every expert where free host RAM allows (``tiers``)
    expert_host_gb: Optional[float] = None
    store: str = "safetensors"
    kernel: str = "auto"
    # at exit, print one summary line (True), and a table per MoE layer ("layers")
    stats: Any = False
    # say at load which budget was chosen, on stderr (the mlx-lm commands always do)
    verbose: bool = False
    store_options: Dict[str, Any] = field(default_factory=dict)
    # demand reads straight into the slot banks (reads/bank_reads.py): None = where verified bit-exact, i.e.
    # MLX's CPU and CUDA backends; on Metal off unless asked for (docs/usage.md says why)
    direct_reads: Optional[bool] = None
    # prompts of several chunks prefilled layer by layer (layer_major.py): None = auto, on with
    # every backend (each layer over its whole expert set, stock's own calls, where two layers'
    # sets fit beside the budget); docs/usage.md, "Long prompts"; docs/benchmarks/prefill.md
    layer_major_prefill: Optional[bool] = None
    # which resident expert a full bank evicts (policy.py): "decay_next" (default), "decay", "lru"
    cache_policy: str = DEFAULT_POLICY
    # write the run's routing to this file as it goes (routing_trace.py; docs/routing.md)
    record_routing: Optional[str] = None
    # write a timeline of reads, installs, syncs and compute to this file (timeline.py)
    trace: Optional[str] = None
    # the expert pack to read (``mlx_lm_streaming pack``; a file, or a directory holding
    # experts.pack): implies store "packed" and becomes its ``path`` store option
    pack: Optional[str] = None
    # what a Mixture-of-Experts model that cannot stream does: "refuse" or "whole"; None: refuse
    # where model_config (or the --streaming-experts flag) asks, whole where only the environment
    # does (integration/unstreamable.py)
    if_unstreamable: Optional[str] = None
    # internal, not a user option: an ``expert_cache.CacheTuning`` for benchmarks and tests (what
    # the options above choose is not in it); None: the defaults
    tuning: Any = field(default=None, repr=False, metadata={"internal": True})

    def __post_init__(self):
        if self.expert_cache_gb is not None:
            try:
                self.expert_cache_gb = check_budget_gb(self.expert_cache_gb)
            except ConfigurationError as e:
                raise ConfigurationError(f"expert_cache_gb {e}") from None
        if self.expert_host_gb is not None:
            self.expert_host_gb = check_host_gb(self.expert_host_gb)
        for name in ("store", "kernel"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigurationError(f"{name} must be a non-empty name")
        self.store_options = parse_store_options(self.store_options)
        for name in ("record_routing", "trace"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (str, os.PathLike)):
                raise ConfigurationError(f"{name} must be a file path, got {value!r}")
            if not str(value).strip():
                raise ConfigurationError(f"{name}: an empty path; give a file path")
            setattr(self, name, str(value))
        if self.record_routing and self.trace and same_file(self.record_routing, self.trace):
            raise ConfigurationError(
                f"record_routing and trace name one file, {self.trace}: two outputs of one run "
                "cannot share a path; give each its own"
            )
        if self.pack is not None:
            self._use_pack()
        if self.cache_policy not in POLICIES:
            raise ConfigurationError(
                f"cache_policy {self.cache_policy!r} is unknown; known: "
                f"{', '.join(sorted(POLICIES))}"
            )
        self.stats = parse_stats(self.stats)
        self.if_unstreamable = parse_choice(self.if_unstreamable, "if_unstreamable", UNSTREAMABLE)
        self.verbose = parse_switch(self.verbose, "verbose")
        self.expert_cache_fixed = parse_switch(self.expert_cache_fixed, "expert_cache_fixed")
        self.direct_reads = auto_switch(self.direct_reads, "direct_reads")
        self.layer_major_prefill = auto_switch(self.layer_major_prefill, "layer_major_prefill")

    def _use_pack(self) -> None:
        if not isinstance(self.pack, (str, os.PathLike)):
            raise ConfigurationError(f"pack must be a file or directory path, got {self.pack!r}")
        if not str(self.pack).strip():
            raise ConfigurationError("pack: an empty path; give the pack file or its directory")
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

    def use_layer_major_prefill(self, backend: str) -> bool:
        """Whether long prompts prefill layer by layer on ``backend`` (cpu, cuda, metal): as asked;
        auto: on with every backend. Where two layers' whole expert sets fit beside the budget, each
        chunk's MoE call is stock's own call over its layer's set, so what holds on the CPU and
        CUDA holds on Metal too (its speed there is not measured: docs/benchmarks/prefill.md)."""
        if self.layer_major_prefill is None:
            return True
        return self.layer_major_prefill

    def use_direct_reads(self, backend: str) -> bool:
        """Whether demand reads go straight into the banks on ``backend`` (cpu, cuda, metal)."""
        if self.direct_reads is None:
            # on CUDA too: faster cold on the H200, stock's logits token by token
            # (docs/benchmarks/README.md); Metal stays off until checked on a Mac
            return backend in ("cpu", "cuda")
        return self.direct_reads

    @classmethod
    def from_value(cls, value, environ=os.environ) -> Optional["StreamingOptions"]:
        """From a ``model_config["streaming_experts"]`` value: bool, dict or options. For True and a
        dict, the environment gives the options the value does not give."""
        if value is None or value is False:
            return None
        if isinstance(value, cls):
            return value
        if value is True:
            value = {}
        if not isinstance(value, dict):
            raise ConfigurationError(
                f"model_config['streaming_experts'] must be a bool or a dict, got {value!r}"
            )
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known - {"enabled"}
        if unknown:
            raise ConfigurationError(
                f"unknown streaming_experts option(s) {sorted(unknown)}; known: "
                f"{sorted(known - {'tuning'})}"
            )
        if "enabled" in value and not parse_switch(value["enabled"], "enabled"):
            return None
        given = {k: v for k, v in value.items() if k != "enabled" and v is not None}
        return cls._merged(environment_options(environ), given, environ)

    @classmethod
    def _merged(cls, from_env: dict, given: dict, environ) -> "StreamingOptions":
        kwargs = {**from_env, **given}
        if "pack" in from_env and "store" in given and "pack" not in given:
            # the variable's pack needs the packed store; a store given here wins over it
            kwargs.pop("pack")
        try:
            return cls(**kwargs)
        except ConfigurationError as e:
            if not set(from_env) - set(given):
                raise
            named = ", ".join(
                f"{ENV[k]}={environ[ENV[k]]!r}" for k in sorted(set(from_env) - set(given))
            )
            raise ConfigurationError(f"{e} (with {named} from the environment)") from None

    @classmethod
    def from_env(cls, environ=os.environ) -> Optional["StreamingOptions"]:
        """What the environment asks for: None unless ``MLX_LM_STREAMING_EXPERTS`` is on; then
        the options its variables give."""
        if not streaming_asked_by_environment(environ):
            return None
        options = environment_options(environ)
        if "pack" in options and options.get("store", "packed") != "packed":
            raise ConfigurationError(
                f"{ENV['pack']} needs {ENV['store']}=packed (or unset), not {options['store']!r}"
            )
        return cls._merged(options, {}, environ)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def streaming_asked_by_environment(environ=os.environ) -> bool:
    """Whether ``MLX_LM_STREAMING_EXPERTS`` turns streaming on. A bad value, or an option variable
    set while it is unset or off (like an option flag without ``--streaming-experts``), is an
    error: ``=0`` is the same as unset, for the options as for the rest."""
    variable = ENV["enabled"]
    value = environ.get(variable, "")
    try:
        on = bool(value.strip()) and parse_switch(value, variable)
    except ConfigurationError:
        raise ConfigurationError(f"{variable}={value!r}: use {SWITCH_WORDS}") from None
    if not on:
        given = [o.env for o in OPTIONS if o.name != "enabled" and environ.get(o.env, "")]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            now = f" (it is {value!r})" if value.strip() else ""
            raise ConfigurationError(
                f"{', '.join(given)} {verb} {variable}=1 (or --streaming-experts){now}; set it "
                "to stream, or unset them"
            )
    return on


_unknown_warned = False


def warn_unknown_variables(environ=os.environ) -> None:
    """For a load that does not stream: one line on stderr, once per process, naming each
    ``MLX_LM_STREAMING_*`` variable that is not ours (``MLX_LM_STREAMING_EXPERT=1``, the S missing,
    would otherwise load every expert without a word). Nothing else changes: the load is stock."""
    global _unknown_warned
    unknown = [] if _unknown_warned else unknown_variables(environ)
    if not unknown:
        return
    _unknown_warned = True
    noun = "variable" if len(unknown) == 1 else "variables"
    print(
        f"mlx-lm-streaming: warning: unknown {noun} {', '.join(map(misspelt, unknown))}: "
        "ignored, this model loads without streaming experts",
        file=sys.stderr,
        flush=True,
    )


def environment_options(environ=os.environ) -> Dict[str, str]:
    """The options the environment gives (empty variables count as unset), each checked on its
    own so that an error names the variable; an unknown ``MLX_LM_STREAMING_*`` is an error."""
    unknown = unknown_variables(environ)
    if unknown:
        listed = ", ".join(sorted(o.env for o in OPTIONS))
        raise ConfigurationError(
            f"unknown variable {misspelt(unknown[0])}; the options are {listed}"
        )
    options = {}
    for option in OPTIONS:
        value = environ.get(option.env, "")
        if option.name == "enabled" or not value:
            continue
        try:  # one at a time, so that the error names the variable at fault
            StreamingOptions(**{option.name: value})
        except ConfigurationError as e:
            raise ConfigurationError(f"{option.env}={value!r}: {e}") from None
        options[option.name] = value
    return options


def requested(model_config: Optional[dict], environ=os.environ) -> Optional[StreamingOptions]:
    """The options asked for by ``model_config`` or, failing that, the environment."""
    if model_config and CONFIG_KEY in model_config:
        return StreamingOptions.from_value(model_config[CONFIG_KEY], environ)
    return StreamingOptions.from_env(environ)
