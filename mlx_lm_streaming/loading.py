"""Build a streaming model with mlx-lm's own ``load_model``.

mlx-lm builds the model from config, sanitizes the checkpoint's (lazy) tensors and quantizes the modules
as usual. Just before the weights are put into the model, ``load_weights`` is intercepted: every routed
``SwitchGLU`` is swapped for a ``StreamingSwitchGLU`` over a slot bank, its tensors are dropped from the
weight list (they were never read: ``mx.load`` is lazy), and the rest loads through mlx-lm unchanged. The
shapes the index checks the checkpoint against are those of the quantized stock modules, i.e. the config's.
"""

import atexit
import os
import sys
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from . import plugins
from .expert_cache import GB, CacheTuning, ExpertCache, close_all
from .errors import CheckpointError, ConfigurationError, UnsupportedModelError
from .index import PROJECTIONS, CheckpointFiles, ExpertIndex, checkpoint_layer
from .kernels.selector import KernelSelector
from .options import CONFIG_KEY, StreamingOptions, decimal_gb
from .prefetch import find_router
from .routing_trace import RoutingRecorder
from .switch import StreamingSwitchGLU
from .timeline import open_timeline

# Of the memory the resident weights leave free, this share goes to the expert cache; the rest stays
# for the OS page cache, the KV cache and activations.
DEFAULT_CACHE_SHARE = 0.5


# what the default budget assumes where the OS does not say how much memory there is
ASSUMED_MEMORY_BYTES = 16 * GB
_memory_warned = False


def physical_memory_bytes() -> int:
    """This machine's RAM; where the OS does not tell, ``ASSUMED_MEMORY_BYTES``, said once on
    stderr (the default expert budget depends on it)."""
    global _memory_warned
    try:
        page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
        why = f"page size {page}, pages {pages}"
    except (ValueError, OSError, AttributeError) as e:
        page, pages, why = 0, 0, f"{type(e).__name__}: {e}"
    if page > 0 and pages > 0:
        return page * pages
    if not _memory_warned:
        _memory_warned = True
        print(
            f"mlx-lm-streaming: cannot read this machine's memory size from the OS ({why}); the "
            f"default expert cache budget assumes {ASSUMED_MEMORY_BYTES // GB} GB: set "
            "--expert-cache-gb (MLX_LM_STREAMING_CACHE_GB) to choose it",
            file=sys.stderr,
            flush=True,
        )
    return ASSUMED_MEMORY_BYTES


def set_default_budget(state: "StreamingState") -> None:
    """The default budget of ``state``'s cache, and the free memory it was derived from."""
    cache = state.cache
    state.free_bytes = physical_memory_bytes() - state.resident_bytes
    cache.budget_bytes = default_budget_bytes(
        state.resident_bytes,
        cache.total_expert_bytes,
        sum(b.layer.expert_nbytes for b in cache.banks),
    )


def default_budget_bytes(resident_bytes: int, total_expert_bytes: int, min_bytes: int) -> int:
    """``clamp(0.5 * (RAM - resident weights), one expert per layer, every expert)``."""
    free = physical_memory_bytes() - resident_bytes
    return int(min(total_expert_bytes, max(min_bytes, DEFAULT_CACHE_SHARE * free)))


class StreamingState:
    """What a streaming model carries besides its parameters (``model.expert_streaming``)."""

    def __init__(
        self, model_path: Path, options: StreamingOptions, allow_missing_shards: bool = False
    ):
        self.model_path = Path(model_path)
        self.options = options
        # a lazy, non-strict load (mlx-lm's sharded_load) may lack the shards of other pipeline
        # ranks' layers: checked once ``pipeline`` says which layers this rank keeps
        self.files = CheckpointFiles(self.model_path, allow_missing=allow_missing_shards)
        self.index = ExpertIndex(self.files)
        self.store = plugins.make_store(options.store, self.files, **options.store_options)
        budget = None
        if options.expert_cache_gb is not None:
            budget = int(options.expert_cache_gb * GB)
        self.selector = KernelSelector(options.kernel)
        recording = bool(options.record_routing) and not RoutingRecorder.claimed(
            options.record_routing
        )
        tuning = options.tuning or CacheTuning()
        tuning = replace(
            tuning,
            direct_reads=options.use_direct_reads(self.selector.backend),
            # every call reports its ids when recording: complete banks must not skip the host sync
            skip_sync=tuning.skip_sync and not recording,
        )
        self.cache = ExpertCache(self.store, budget, tuning, options.cache_policy)
        self.recorder = None
        if recording:
            cache = self.cache
            self.recorder = RoutingRecorder(
                options.record_routing,
                lambda: cache.banks,
                model=self.model_path.name,
                source="mlx_lm_streaming --record-routing",
                note="expert ids in the order mlx-lm's router returned them (for most models "
                "argpartition order, not sorted by score); calls of more than one token are prefill",
            )
            self.cache.recorder = self.recorder
        # last: nothing after it can fail and leave the file open
        self.timeline = open_timeline(options.trace, f"mlx-lm-streaming {self.model_path.name}")
        self.cache.timeline = self.timeline
        if self.timeline is not None:
            atexit.register(self.timeline.close)
        self.resident_bytes = 0
        # memory the resident weights leave free, where the default budget was derived from it
        self.free_bytes: Optional[int] = None
        # (rank, size, first layer, end layer) once mlx-lm's ``pipeline(group)`` split the model
        self.pipeline: Optional[tuple] = None
        self.closed = False

    def stats(self) -> Dict[str, float]:
        return self.cache.summary()

    def stats_line(self, label: bool = False) -> str:
        """The ``--streaming-stats`` line; ``label``: name the model (several stream in this
        process, e.g. a draft model or the server's models)."""
        s = self.stats()
        # no expert was asked for yet (nothing generated): no rate to give
        rate = "n/a" if s["hits"] + s["misses"] == 0 else f"{s['hit_rate']:.1%}"
        name = f"{self.model_path.name}: " if label else ""
        line = (
            f"[streaming] {name}hit rate {rate}, experts read {s['experts_read']}, "
            f"{s['gb_read']:.3f} GB read, {s['io_seconds']:.2f} s in I/O, "
            f"cache {s['cache_gb']:.3f} GB"
        )
        if s.get("failed_background_reads"):
            line += (
                f", background reads of {s['failed_background_reads']} experts failed (read "
                f"again on demand; first: {s['first_background_error']})"
            )
        if self.pipeline is not None:
            rank, size, start, end = self.pipeline
            line += f", pipeline rank {rank}/{size} (layers {start}-{end - 1})"
        if s["span_seconds"] > 0:
            line += (
                f"; {s['span_seconds']:.2f} s from first to last expert request: "
                f"{s['io_wait_seconds']:.2f} s waiting for reads, {s['install_seconds']:.2f} s "
                f"installing, {s['other_seconds']:.2f} s everything else"
            )
        return line

    def layers_table(self) -> str:
        """``--streaming-stats layers``: hit rate, misses and GB read of each MoE layer."""
        rows = [("layer", "slots", "hit rate", "misses", "GB read")]
        for layer in self.stats()["per_layer"]:
            asked = layer["hits"] + layer["misses"]
            rows.append(
                (
                    layer["layer"],
                    str(layer["slots"]),
                    f"{layer['hit_rate']:.1%}" if asked else "n/a",
                    str(layer["misses"]),
                    f"{layer['gb_read']:.3f}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "[streaming]   " + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
            for r in rows
        )

    def choice_line(self) -> str:
        """What was chosen, said at load: budget (and where it came from), slots, resident weights."""
        cache = self.cache
        banks = cache.banks
        if cache.budget_bytes is None or not banks:
            return f"[streaming] {self.model_path.name}: no MoE layer streams on this rank"
        per_slot = sum(b.layer.expert_nbytes for b in banks)
        if self.options.expert_cache_gb is not None:
            how = f"given {self.options.expert_cache_gb:g} GiB"
        elif self.free_bytes is None:
            how = "default"
        else:
            share = f"{DEFAULT_CACHE_SHARE:.0%} of the {decimal_gb(self.free_bytes)}"
            how = f"default: {share} that the resident weights leave free"
            if cache.budget_bytes >= cache.total_expert_bytes:
                how += ", capped at every expert"
            elif cache.budget_bytes == per_slot:
                how += ", raised to one expert per layer"
        plan = cache.plan_slots()
        slots = min(plan)
        more = sum(n > slots for n in plan)
        extra = f" ({slots + 1} in {more} layer{'s' if more > 1 else ''})" if more else ""
        experts = "/".join(sorted({str(b.num_experts) for b in banks}))
        return (
            f"[streaming] {self.model_path.name}: expert cache {decimal_gb(cache.budget_bytes)} "
            f"({how}), {slots} of {experts} experts per layer{extra} in {len(banks)} MoE "
            f"layer{'s' if len(banks) > 1 else ''}, resident weights {decimal_gb(self.resident_bytes)}"
        )

    def close(self, wait: bool = True) -> None:
        """Stop background reads, then close the store. ``wait=False`` (the finalizer of a model
        that was garbage collected): join no thread (see ``ExpertCache.close``)."""
        self.closed = True
        self.cache.close(wait=wait)  # background reads first
        if self.recorder is not None:
            self.recorder.close()
        if self.timeline is not None:
            self.timeline.close()
        self.store.close(wait=wait)


def _module_at(model, path: str):
    parent = model
    parts = path.split(".")
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else parent[p]
    return parent, parts[-1]


def adapter_for(model, config: dict):
    module = type(model).__module__.rsplit(".", 1)[-1]
    adapters = plugins.architectures()
    adapter = adapters.get(module)
    if adapter is None:
        raise UnsupportedModelError(
            f"model_type {config.get('model_type')!r} (mlx_lm.models.{module}) has no "
            f"streaming adapter; supported: {', '.join(sorted(adapters))}. Load it without "
            "--streaming-experts, or register an adapter (docs/plugins.md)"
        )
    return adapter


def convert_model(
    model, weights: dict, config: dict, state: StreamingState, check_budget: bool = True
) -> dict:
    """Swap routed experts for streaming ones; return the weights still to load.

    ``check_budget=False`` (lazy loads) leaves the budget check to ``pipeline`` or the first call:
    ``sharded_load`` loads lazily and only then keeps the layers of this rank, and a per-rank budget
    is meant for those layers only."""
    adapter = adapter_for(model, config)
    routed = [
        (path, m)
        for path, m in model.named_modules()
        if adapter.is_routed_experts(path, m)
    ]
    if not routed:
        raise UnsupportedModelError(
            f"model_type {config.get('model_type')!r}: no routed-expert modules "
            "(SwitchGLU) found to stream"
        )
    # layers with tensors in absent shards stay stock and unloaded, as mlx-lm leaves them: they
    # belong to other pipeline ranks (``_stream_per_pipeline_stage`` refuses a rank that keeps one)
    routed = [(p, m) for p, m in routed if not state.files.layer_missing(checkpoint_layer(p))]
    for path, glu in routed:
        expected = {}
        for proj in PROJECTIONS:
            for part, arr in tree_flatten(glu[proj].parameters()):
                expected[(proj, part)] = tuple(arr.shape)
                weights.pop(f"{path}.{proj}.{part}", None)
        num_experts = expected[("gate_proj", "weight")][0]
        layer = state.index.add_layer(path, num_experts, expected, adapter.raw_name)
        bank = state.cache.register(layer, glu)
        parent, name = _module_at(model, path)
        bank.router = find_router(parent, num_experts)  # for the previous layer's lookahead
        parent[name] = StreamingSwitchGLU(bank, state.selector)
    # raw HF names that sanitize did not consume (strict loading would reject them)
    for name in state.index.expert_names():
        weights.pop(name, None)
    state.resident_bytes = sum(v.nbytes for v in weights.values())
    if state.cache.budget_bytes is None:
        set_default_budget(state)
    # fail at load, not at the first token, if the budget is too small
    if check_budget:
        state.cache.slots_for_budget()
    return weights


def load_streaming_model(stock_load_model, bound, options: StreamingOptions):
    """Like mlx-lm's ``load_model``, with the routed experts streamed.

    ``bound``: the caller's arguments bound to ``stock_load_model``'s signature; they are passed on
    as given (``trust_remote_code`` and whatever else this mlx-lm takes), with ``get_model_classes``
    replaced by one that intercepts the model's weights."""
    from mlx_lm.utils import _get_classes, load_config

    bound = bound.signature.bind(*bound.args, **bound.kwargs)  # the caller's stays as it was
    arguments = bound.arguments
    model_path = Path(arguments["model_path"])
    lazy = arguments.get("lazy", False)
    model_config = {
        k: v for k, v in (arguments.get("model_config") or {}).items() if k != CONFIG_KEY
    }
    arguments["model_config"] = model_config
    config = {**_read_config(model_path, load_config), **model_config}
    if config.get("model_file") is not None:
        raise UnsupportedModelError(
            f"{model_path}: custom model_file {config['model_file']!r} architectures cannot "
            "be streamed; load without --streaming-experts"
        )
    get_model_classes = arguments.get("get_model_classes") or _get_classes
    strict = arguments.get("strict", True)
    _join_background_threads_at_exit()
    state = StreamingState(model_path, options, allow_missing_shards=lazy and not strict)

    def classes(config):
        try:
            model_class, args_class = get_model_classes(config=config)
        except KeyError as e:
            raise CheckpointError(f"{model_path / 'config.json'}: no {e} entry") from e
        except ValueError as e:  # mlx-lm has no model file for this model_type
            from mlx_lm import __version__

            raise CheckpointError(
                f"{model_path / 'config.json'}: mlx-lm {__version__}: {e}"
            ) from e

        def build(args):
            model = model_class(args)
            stock_load_weights = model.load_weights
            stock_sanitize = getattr(model, "sanitize", None)

            def sanitize(weights):
                try:
                    return stock_sanitize(weights)
                except KeyError as e:
                    raise CheckpointError(
                        f"{model_path}: tensor {e.args[0]!r} is missing (needed by "
                        f"{type(model).__module__}.sanitize; incomplete checkpoint?)"
                    ) from e

            if stock_sanitize is not None:
                model.sanitize = sanitize

            def load_weights(file_or_weights, strict=True):
                if isinstance(file_or_weights, (str, Path)):
                    file_or_weights = list(mx.load(str(file_or_weights)).items())
                remaining = convert_model(
                    model, dict(file_or_weights), config, state, check_budget=not lazy
                )
                return stock_load_weights(list(remaining.items()), strict=strict)

            model.load_weights = load_weights
            return model

        return build, args_class

    try:
        arguments["get_model_classes"] = classes
        model, config = stock_load_model(*bound.args, **bound.kwargs)
    except BaseException:
        state.close()
        raise
    # back to the class methods
    del model.load_weights
    if "sanitize" in model.__dict__:
        del model.sanitize
    model.expert_streaming = state
    if hasattr(model, "shard"):
        model.shard = _tensor_parallel_unsupported
    _stream_per_pipeline_stage(model, state)
    weakref.finalize(model, state.close, wait=False)
    if not lazy and _say_choice(options):
        _say(state.choice_line())
    if options.stats:
        _print_stats_at_exit(state)
    return model, config


_SAID: set = set()  # choice lines already printed in this process


def _say(line: str) -> None:
    # once per process: sharded_load splits a structure-only model before the real one, and a
    # server that loads a model again chooses the same
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr, flush=True)


def _say_choice(options: StreamingOptions) -> bool:
    """At load, in the mlx-lm commands and where the API asked for it (``verbose=True``)."""
    from . import integration

    return options.verbose or integration.cli_streaming



_JOINING_AT_EXIT = []  # non-empty once ``close_all`` is registered with atexit


def _join_background_threads_at_exit() -> None:
    """Once, at the first load: at exit, join every cache's background threads before the
    interpreter finalizes (``expert_cache.close_all``; the model's finalizer joins none)."""
    if not _JOINING_AT_EXIT:
        _JOINING_AT_EXIT.append(True)
        atexit.register(close_all)


def _read_config(model_path: Path, load_config) -> dict:
    """mlx-lm's ``load_config``, with a missing or invalid ``config.json`` named in one line."""
    path = model_path / "config.json"
    if not model_path.is_dir():
        raise CheckpointError(f"{model_path}: no such model directory")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (not a model directory?)")
    try:
        config = load_config(model_path)
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return config


def _tensor_parallel_unsupported(*args, **kwargs):
    raise UnsupportedModelError(
        "tensor parallelism (model.shard / sharded_load with a tensor group) is not supported "
        "with streaming experts yet: each rank would need a slice of every expert. Use pipeline "
        "parallelism instead (sharded_load(..., pipeline_group=group), mlx_lm.server --pipeline)"
    )


def _stream_per_pipeline_stage(model, state: StreamingState) -> None:
    """Wrap mlx-lm's ``model.model.pipeline(group)`` so that a pipeline stage streams only its layers.

    After the stock split (which replaces the other stages' layers by ``None``), the banks of the
    dropped layers leave the cache, a default budget is derived again from this stage's resident
    weights, and the budget is checked against this stage's layers: each rank's budget is its own.
    """
    inner = getattr(model, "model", None)
    stock_pipeline = getattr(inner, "pipeline", None)
    if stock_pipeline is None:
        return
    model_ref = weakref.ref(model)  # no reference cycle: the model must stay collectable

    def pipeline(group, *args, **kwargs):
        result = stock_pipeline(group, *args, **kwargs)
        model = model_ref()
        kept = {
            id(m.bank)
            for _, m in model.named_modules()
            if isinstance(m, StreamingSwitchGLU)
        }
        for bank in state.cache.banks:
            if id(bank) not in kept:
                state.cache.unregister(bank)
        start, end = model.model.start_idx, model.model.end_idx
        state.pipeline = (group.rank(), group.size(), start, end)
        stage = f"pipeline rank {group.rank()} of {group.size()} (layers {start}-{end - 1})"
        needed = state.files.missing_needed(start, end)
        if needed is not None:
            tensor, shard = needed
            raise CheckpointError(
                f"{stage}: tensor {tensor!r} is in shard {shard!r}, which is missing from "
                f"{state.model_path}; this rank needs every shard holding its layers and the "
                "weights outside the layers (incomplete download?)"
            )
        if not state.cache.banks:
            return result
        if state.options.expert_cache_gb is None:
            state.resident_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
            set_default_budget(state)
        try:
            state.cache.slots_for_budget()
        except ConfigurationError as e:
            raise ConfigurationError(f"{stage}: {e}") from None
        if _say_choice(state.options):
            _say(state.choice_line())
        return result

    inner.pipeline = pipeline


_REPORTING: list = []  # states whose stats are printed at exit, in load order


def _print_stats_at_exit(state: StreamingState) -> None:
    if not _REPORTING:
        atexit.register(_report_stats)
    _REPORTING.append(state)


def _report_stats() -> None:
    shown = []
    for state in _REPORTING:
        s = state.stats()
        if state.closed and s["hits"] + s["misses"] == 0:
            # a model that was dropped unused, e.g. the one sharded_load builds only to see the
            # model's structure before loading the rank's part
            continue
        shown.append(state)
    for state in shown:
        print(state.stats_line(label=len(shown) > 1), file=sys.stderr, flush=True)
        if state.options.stats == "layers":
            print(state.layers_table(), file=sys.stderr, flush=True)
