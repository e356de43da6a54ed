"""Build a streaming model with mlx-lm's own ``load_model``.

mlx-lm builds the model from config, sanitizes the checkpoint's (lazy) tensors and quantizes the modules
as usual. Just before the weights are put into the model, ``load_weights`` is intercepted: every routed
``SwitchGLU`` (or ``SwitchMLP``) is swapped for a ``StreamingSwitchGLU`` over a slot bank, its tensors
are dropped from the weight list (they were never read: ``mx.load`` is lazy), and the rest loads
through mlx-lm unchanged. The shapes the index checks the checkpoint against are those of the
quantized stock modules, i.e. the config's.
"""

import atexit
import weakref
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import plugins
from ..errors import (
    CheckpointError,
    ConfigurationError,
    NotMixtureOfExpertsError,
    UnsupportedModelError,
)
from ..files.outputs import ROUTING_TRACE, TIMELINE, check_output
from ..files.routing_trace import RoutingRecorder
from ..files.timeline import Timeline, open_timeline
from ..kernels.selector import KernelSelector
from ..runtime import mlx_compat, mlx_shims
from ..runtime.decode.runner import StepRunner
from ..runtime.decode.switch import StreamingSwitchGLU
from ..runtime.memory import machine as memory, report, tiers
from ..runtime.memory.expert_cache import CacheTuning, ExpertCache, close_all
from ..runtime.options import CONFIG_KEY, StreamingOptions
from ..runtime.prefill.layer_major import PrefillStats
from ..runtime.reads.index import CheckpointFiles, ExpertIndex, checkpoint_layer, projections_of
from ..runtime.reads.lookahead import find_router
from ..runtime.sizes import budget_bytes, decimal_gb, gb_as_given
from .unstreamable import adapter_for, model_module, refuse_listed


def default_budget(state: "StreamingState"):
    """``(budget, free)``: the default budget for ``state``'s model on this machine,
    ``clamp(share * free, one expert per layer, every expert)``, and ``free``, the memory the
    resident weights leave (``machine.budget_base``: the GPU's on CUDA, the machine's RAM elsewhere)."""
    cache = state.cache
    total, share, _ = memory.budget_base()
    free = total - state.resident_bytes
    per_slot = sum(b.layer.expert_nbytes for b in cache.banks)
    budget = min(cache.total_expert_bytes, max(per_slot, share * free))
    return int(budget), free


def check_budget_fits(state: "StreamingState") -> None:
    """Fail at load, not at the first token: a budget below one expert per MoE layer, or a given
    budget whose cache (what its slots really take: at most every expert) and the resident weights
    do not fit this machine's memory plus swap. A budget above every expert means every expert."""
    cache = state.cache
    cache.slots_for_budget()
    given = state.options.expert_cache_gb
    machine = memory.memory_and_swap() if given is not None else None
    if machine is None:
        return
    used = sum(n * b.layer.expert_nbytes for n, b in zip(cache.plan_slots(), cache.banks))
    ram, swap = machine
    needed = used + state.resident_bytes
    if needed > ram + swap:
        every = " (every expert)" if cache.budget_bytes >= cache.total_expert_bytes else ""
        raise ConfigurationError(
            f"expert cache budget of {gb_as_given(given)} GB: the cache would take "
            f"{decimal_gb(used)}{every} and the resident weights {decimal_gb(state.resident_bytes)}, "
            f"{decimal_gb(needed)} in all, more than this machine's memory plus swap, "
            f"{decimal_gb(ram + swap)} ({decimal_gb(ram)} + {decimal_gb(swap)}): lower "
            "--expert-cache-gb / MLX_LM_STREAMING_CACHE_GB / expert_cache_gb, or leave it out "
            "for the default"
        )


def set_default_budget(state: "StreamingState") -> None:
    """Give ``state``'s cache the default budget, and keep the free memory it was derived from."""
    state.cache.budget_bytes, state.free_bytes = default_budget(state)


class StreamingState:
    """What a streaming model carries besides its parameters (``model.expert_streaming``)."""

    def __init__(
        self, model_path: Path, options: StreamingOptions, allow_missing_shards: bool = False
    ):
        self.model_path = Path(model_path)
        self.options = options
        # the files this run writes, before anything is made (nothing is opened yet); a file this
        # process already writes for another model is not written by this one (``claimed``)
        for path, kind, claimed in (
            (options.record_routing, ROUTING_TRACE, RoutingRecorder.claimed),
            (options.trace, TIMELINE, Timeline.claimed),
        ):
            if path and not claimed(path):
                check_output(path, kind, self.model_path)
        # a lazy, non-strict load (mlx-lm's sharded_load) may lack the shards of other pipeline
        # ranks' layers: checked once ``pipeline`` says which layers this rank keeps
        self.files = CheckpointFiles(self.model_path, allow_missing=allow_missing_shards)
        self.index = ExpertIndex(self.files)
        self.store = plugins.make_store(options.store, self.files, **options.store_options)
        budget = None
        if options.expert_cache_gb is not None:
            budget = budget_bytes(options.expert_cache_gb)
        self.selector = KernelSelector(options.kernel)
        recording = bool(options.record_routing) and not RoutingRecorder.claimed(
            options.record_routing
        )
        backend = self.selector.backend
        self.cache = ExpertCache(
            self.store,
            budget,
            options.tuning or CacheTuning(),
            options.cache_policy,
            direct_reads=options.use_direct_reads(backend),
            layer_major_prefill=options.use_layer_major_prefill(backend),
            follow_memory=not options.expert_cache_fixed,
        )
        self.recorder = None
        if recording:
            cache = self.cache
            self.recorder = RoutingRecorder(
                options.record_routing,
                lambda: cache.banks,
                model_path=self.model_path,
                model=self.model_path.name,
                source="mlx_lm_streaming --record-routing",
                note="expert ids in the order mlx-lm's router returned them (for most models "
                "argpartition order, not sorted by score); calls of more than one token are prefill",
            )
            self.cache.recorder = self.recorder
        # checked now, opened at its first write (after the load passed)
        self.timeline = open_timeline(
            options.trace, f"mlx-lm-streaming {self.model_path.name}", self.model_path
        )
        if self.timeline is not None:  # (else the cache keeps its null timeline)
            self.cache.timeline = self.timeline
            atexit.register(self.timeline.close)
        self.resident_bytes = 0
        # what layer-major prefill did, or why it did not apply (layer_major.py)
        self.prefill = PrefillStats()
        # runner.StepRunner (set once the model is built)
        self.steps = None
        # memory the resident weights leave free, where the default budget was derived from it
        self.free_bytes: Optional[int] = None
        # (rank, size, first layer, end layer) once mlx-lm's ``pipeline(group)`` split the model
        self.pipeline: Optional[tuple] = None
        self.closed = False

    def stats(self) -> Dict[str, float]:
        return self.cache.summary()

    def stats_line(self, label: bool = False) -> str:
        return report.stats_line(self, label)

    def close(self, wait: bool = True) -> None:
        """Stop background reads, then close the store. ``wait=False`` (the finalizer of a model
        that was garbage collected): join no thread (see ``ExpertCache.close``)."""
        self.closed = True
        self.cache.stop_fills()  # (the flush's host work would ask for fills)
        if self.steps is not None:
            self.steps.flush()  # the last verified step's counts and routing record
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


def convert_model(
    model, weights: dict, config: dict, state: StreamingState, check_budget: bool = True
) -> dict:
    """Swap routed experts for streaming ones; return the weights still to load.

    ``check_budget=False`` (lazy loads) leaves the budget check to ``pipeline`` or the first call:
    ``sharded_load`` loads lazily and only then keeps the layers of this rank, and a per-rank budget
    is meant for those layers only."""
    adapter = adapter_for(model, config, state.model_path)
    routed = [
        (path, m)
        for path, m in model.named_modules()
        if adapter.is_routed_experts(path, m)
    ]
    if not routed:
        raise NotMixtureOfExpertsError(  # a dense model of a family that has MoE ones
            f"{state.model_path}: model_type {config.get('model_type')!r} is not a "
            "Mixture-of-Experts model"
        )
    # layers with tensors in absent shards stay stock and unloaded, as mlx-lm leaves them: they
    # belong to other pipeline ranks (``_stream_per_pipeline_stage`` refuses a rank that keeps one)
    routed = [(p, m) for p, m in routed if not state.files.layer_missing(checkpoint_layer(p))]
    for path, glu in routed:
        expected = {}
        projections = projections_of(glu)
        for proj in projections:
            for part, arr in tree_flatten(glu[proj].parameters()):
                expected[(proj, part)] = tuple(arr.shape)
                weights.pop(f"{path}.{proj}.{part}", None)
        num_experts = expected[(projections[0], "weight")][0]
        layer = state.index.add_layer(path, num_experts, expected, adapter.raw_name)
        bank = state.cache.register(layer, glu)
        parent, name = _module_at(model, path)
        bank.router = find_router(parent, num_experts)  # for the previous layer's lookahead
        streaming = StreamingSwitchGLU(bank, state.selector)
        # modules a model hangs on its SwitchGLU besides the projections stay resident and load as
        # stock (muse_spark keeps its post-expert norm there)
        for child, module in glu.children().items():
            if child not in projections_of(glu) and isinstance(module, nn.Module) and module.parameters():
                setattr(streaming, child, module)
        parent[name] = streaming
    # raw HF names that sanitize did not consume (strict loading would reject them)
    for name in state.index.expert_names():
        weights.pop(name, None)
    state.resident_bytes = sum(v.nbytes for v in weights.values())
    if state.cache.budget_bytes is None:
        set_default_budget(state)
    tiers.set_up(state.cache, state.options.expert_host_gb, state.selector.backend)
    if check_budget:
        check_budget_fits(state)  # at load, not at the first token
    return weights


def load_streaming_model(stock_load_model, bound, options: StreamingOptions):
    """Like mlx-lm's ``load_model``, with the routed experts streamed.

    ``bound``: the caller's arguments bound to ``stock_load_model``'s signature; they are passed on
    as given (``trust_remote_code`` and whatever else this mlx-lm takes), with ``get_model_classes``
    replaced by one that intercepts the model's weights."""
    from mlx_lm.utils import load_config

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
    get_model_classes = arguments.get("get_model_classes") or mlx_compat.model_classes(
        stock_load_model
    )
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
        refuse_listed(model_module(model_class), config.get("model_type"), model_path)
        # the counts the experts are built from, before the model is built from them
        adapter = plugins.architectures().get(model_module(model_class))
        if adapter is not None and hasattr(adapter, "check_config"):
            adapter.check_config(config, args_class, model_path / "config.json")

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
        if state.timeline is not None:
            state.timeline.discard()  # the run never started: an old file stays as it was
        state.close()
        raise
    # back to the class methods
    del model.load_weights
    if "sanitize" in model.__dict__:
        del model.sanitize
    model.expert_streaming = state
    state.steps = state.cache.steps = StepRunner(state)
    mlx_shims.wrap_call(model, state.steps)
    state.steps.wrap_layers(model)
    if hasattr(model, "shard"):
        model.shard = _tensor_parallel_unsupported
    _stream_per_pipeline_stage(model, state)
    if not lazy:
        # the slot banks' memory made now, as stock's load makes its weights' (mlx-lm's lazy
        # loads, a pipeline's among them, plan at the first call, once the stage's banks are
        # known): the H200's 4K prompt waited 146 ms for it at its first call, 2.2 s over two
        # tiers (docs/benchmarks/prefill.md)
        try:
            state.cache.ensure_planned()
        except BaseException:
            state.close()
            raise
    weakref.finalize(model, state.close, wait=False)
    if not lazy and report.say_choice(options):
        report.say(report.choice_line(state))
    if options.stats:
        report.print_stats_at_exit(state)
    return model, config


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
    model_ref = weakref.ref(model)  # no reference cycle: the model must stay collectable

    def pipeline(stock_pipeline, group, *args, **kwargs):
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
        start, end = mlx_compat.pipeline_span(model)
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
            check_budget_fits(state)
        except ConfigurationError as e:
            raise ConfigurationError(f"{stage}: {e}") from None
        if report.say_choice(state.options):
            report.say(report.choice_line(state))
        return result

    mlx_compat.wrap_pipeline(model, pipeline)


