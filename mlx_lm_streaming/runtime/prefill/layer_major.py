"""Layer-major prefill: every chunk of a long prompt through decoder layer L before layer L+1.

mlx-lm's ``generate_step`` prefills a prompt in chunks of ``prefill_step_size`` tokens, each chunk
through every layer. With streaming, each chunk then reads again every expert the cache could not
keep since the chunk before: a prompt of k chunks reads the uncached experts up to k times.

Layer L's output and KV entries for chunk c depend only on chunk c's input to layer L and on layer
L's cache of the chunks before c. So running every chunk through layer L before any chunk goes
through layer L+1 does the same operations, on the same values and shapes, as stock's order, and a
layer's experts are read while its chunks follow one another: each uncached expert about once per
prompt (per group of chunks, below), not once per chunk.

How, without knowing the architecture's forward (``prefill``):

1. each chunk's model call runs stock with every decoder layer skipped (``Recorder``: a layer's call
   is recorded and its input handed on). What each layer gets besides its input (the attention
   mask, its cache entry) is made there, before layer 0, from cache entry 0: at that moment entry 0
   holds exactly the chunks before this one, as in stock;
2. layer 0 runs on the chunk right away, so that the next chunk's call finds entry 0 as stock would;
3. once a group's chunks went through layer 0, each later layer runs on each chunk in order: the
   recorded call, with the layer before's output as input.

In waves (``LayerPass``) each layer runs twice per chunk: to route (its MoE answered with zeros),
then with the experts' rows, its attention and norms given back their first outputs.

The recorded calls are checked (``Recorder.problem``); where the model's forward is not "make the
layers' arguments, then each layer on the output of the one before, one cache entry each", the
prompt prefills chunk by chunk, as stock. The hidden states of a group's chunks are held between
layers: chunks are grouped so that they stay under ``CacheTuning.prefill_hold_bytes``.

``wrap_generate_step`` puts this in front of ``mlx_lm.generate.generate_step`` (``generate``,
``stream_generate``, the ``generate``, ``chat`` and ``cache_prompt`` commands, the server's requests
served one at a time): the prompt but its last token is prefilled here, and the stock function takes
the last token from there, with the logits processors given the whole prompt as stock's would see
it. mlx-lm's prefills outside ``generate_step`` (``BatchGenerator``: the server's batched requests;
``speculative_generate_step``) stay stock; a long prompt there says so once (``note_elsewhere``).
"""

import functools
import inspect
from dataclasses import dataclass, field
from threading import get_ident
from typing import List, Optional

import mlx.core as mx

from .. import mlx_shims
from ..decode import checked_late
from ..decode.modes import Mode
from ..memory import report
from .layer_pass import Chunk, LayerPass
from .set_pass import SetPass, layer_banks, layer_sets


# why a chunk prefills as stock: its call could not take the mode (``modes``), another's held it
ANOTHER_CALL = "another thread's model call was running"


class Fallback(Exception):
    """Layer-major prefill does not apply here; the message says why."""


@dataclass
class PrefillStats:
    """What layer-major prefill did (``--streaming-stats``)."""

    prompts: int = 0
    chunks: int = 0
    groups: int = 0
    # most bytes of hidden states (and array arguments) held between layers at once
    held_bytes: int = 0
    # calls of the layers' parts (attention, norms) given back their output recorded while
    # routing, and calls given the layer's KV entry (attention) run again: their arguments differed
    parts_given: int = 0
    attention_run: int = 0
    # where a long prompt's layers went in waves through the slots, not over layer sets: why
    waves_why: Optional[str] = None
    # layer sets (``bank.layer_set``): experts read into them, copied into them from the slot
    # banks, copied from them into the slot banks after a layer; the most bytes both took
    set_experts_read: int = 0
    set_experts_copied: int = 0
    set_kept: int = 0
    set_bytes: int = 0
    # prompts that fell back, and why (the first reason)
    fallbacks: int = 0
    why: Optional[str] = None
    said: set = field(default_factory=set)


class Recorder(Mode):
    """One chunk's model call with every decoder layer skipped: each layer's call is recorded
    (the call's mode, ``modes``: the decoder layers' wrappers call ``layer_call``)."""

    wraps = True

    def __init__(self):
        self.owner = get_ident()
        self.calls: List[tuple] = []  # (layer index, stock call, args, kwargs)

    def layer_call(self, i, call, args, kwargs):
        self.calls.append((i, call, args, kwargs))
        return args[0] if args else kwargs.get("x")

    def problem(self, layers: int, kv) -> Optional[str]:
        """None if the recorded forward is one call per decoder layer, in order, each with its own
        cache entry and the previous layer's output, and arrays among the other arguments only
        those layer 0 got; else what differs."""
        if [c[0] for c in self.calls] != list(range(layers)):
            return "the model's forward does not call each decoder layer once, in order"
        first = self.calls[0][2][0] if self.calls[0][2] else None
        if not isinstance(first, mx.array):
            return "decoder layers take no hidden states as their first argument"
        entries = [mlx_shims.layer_cache(args, kwargs) for _, _, args, kwargs in self.calls]
        hybrid = any(mlx_shims.recurrent_state(c) for c in kv)
        if not hybrid and len(kv) != layers:
            return f"{len(kv)} cache entries for {layers} decoder layers"
        given = [id(c) for c in entries if c is not None]
        if sorted(given) != sorted(id(c) for c in kv):
            return "the decoder layers are not given one cache entry each, every entry once"
        shared = {id(a) for a in _arrays(self.calls[0])}
        for (i, _, args, kwargs), entry in zip(self.calls, entries):
            if not args or args[0] is not first:
                return "the model's forward changes the hidden states between decoder layers"
            if not hybrid and entry is not kv[i]:
                return f"decoder layer {i} is not given cache entry {i}"
            if hybrid and _made_from_caches((i, None, args, kwargs), entry):
                # made before layer 0 from entries that hold only the groups before: in stock
                # order they would hold this group's chunks before this one too
                return (
                    f"decoder layer {i} of a hybrid gets an array mask or an offset that the "
                    "model makes from the caches before layer 0, too early in layer-major order"
                )
            if any(id(a) not in shared for a in _arrays((i, None, args, kwargs))):
                return f"decoder layer {i} gets an array argument that layer 0 does not"
        return None


def _made_from_caches(call, entry) -> bool:
    """Whether a recorded layer call gets, besides its hidden states and its cache entry, anything
    but None and strings ("causal"): an array mask or a number the model may have made from an
    entry's offset."""
    _, _, args, kwargs = call
    return any(
        a is not None and a is not entry and not isinstance(a, str)
        for a in (*args[1:], *kwargs.values())
    )


def _arrays(call):
    """The mx.array arguments of a recorded layer call but its first (the hidden states)."""
    _, _, args, kwargs = call
    return [a for a in (*args[1:], *kwargs.values()) if isinstance(a, mx.array)]


def prefill(model, kv, prompt: mx.array, step: int, progress=None) -> None:
    """Put ``prompt`` (1-D tokens) into ``kv`` (``model``'s KV cache, every entry a ``KVCache``)
    in chunks of ``step`` tokens, layer-major (module docstring). ``progress(tokens)``: after each
    layer, the prompt tokens that many layers' worth of work stands for. Raises ``Fallback``, with
    nothing computed, where the model's forward is not as it must be."""
    state = model.expert_streaming
    decoder = model.layers  # the decoder layers (``StepRunner.wrap_layers``)
    sets, why = layer_sets(state, decoder)
    stats = state.prefill
    if why is not None:
        stats.waves_why = why
    try:
        _prefill(state, model, kv, prompt, step, progress, _passes(state.cache, decoder, sets))
    finally:
        if sets is not None:
            sets.release()
            stats.set_experts_read += sets.read
            stats.set_experts_copied += sets.copied
            stats.set_kept += sets.kept
            stats.set_bytes = max(stats.set_bytes, sets.nbytes)
            mx.clear_cache()


def _passes(cache, decoder, sets):
    """``make(i)``: the pass of decoder layer ``i`` over a group of chunks: over the layer's set
    where there are sets (``set_pass``), else through the slots in waves (``layer_pass``)."""
    if sets is None:
        return lambda i: LayerPass(cache, None, decoder[i])
    banks = [(layer_banks(layer) or [None])[0] for layer in decoder]
    last = len(banks) - 1  # (its MoE output is not computed: no set)

    def make(i):
        after = next((b for b in banks[i + 1 : last] if b is not None), None)
        return SetPass(cache, sets, banks[i], after, last=i == last)

    return make


def _prefill(state, model, kv, prompt, step, progress, make) -> None:
    runner = state.steps
    layers = runner.layers
    stats = state.prefill
    limit = state.cache.tuning.prefill_hold_bytes
    total = prompt.shape[0]
    starts = list(range(0, total, step))
    group: List[Chunk] = []
    decoder = model.layers
    cache = state.cache
    first = None  # layer 0's pass of the group being recorded (its entry: ``route``)
    done = 0  # tokens of the groups finished
    for c, start in enumerate(starts):
        tokens = prompt[start : start + step]
        recorder = Recorder()
        runner.flush()
        try:
            with cache.running(recorder) as installed:
                if installed:  # (else another thread's model call runs: its mode stays)
                    mlx_shims.stock_call(model, tokens[None], cache=kv)
        except Exception as e:  # a forward that cannot run with its layers skipped
            why = f"the model's forward cannot run with its layers skipped ({type(e).__name__})"
        else:
            why = recorder.problem(layers, kv) if installed else ANOTHER_CALL
        if why is not None:
            if c == 0:
                raise Fallback(why)
            # the chunks so far, layer-major; the rest chunk by chunk, as stock
            done = _finish(group, first, make, stats, progress, done)
            _chunk_by_chunk(model, kv, prompt[start:], step, progress, done)
            note_fallback(state, why)
            return
        chunk = Chunk(recorder.calls)
        group.append(chunk)
        if first is None:
            first = make(0)
        # layer 0 now: the next chunk's forward makes its arguments from cache entry 0
        first.route(chunk, 0)
        stats.chunks += 1
        # per token held between layers: the hidden states, and where the layer runs twice its
        # MoE's input and output rows (top_k), its attention's and two norms' outputs
        held = sum(ch.h.nbytes for ch in group) * first.hold
        if c == len(starts) - 1 or (limit is not None and held >= limit):
            done = _finish(group, first, make, stats, progress, done)
            group, first = [], None
            mx.clear_cache()
    stats.prompts += 1
    runner.per_layer_calls = 1  # the last token's step (``StepRunner.per_layer_calls``)


def _chunk_by_chunk(model, kv, tokens: mx.array, step: int, progress, done: int) -> None:
    """The rest of a prompt, ``tokens``, into ``kv`` chunk by chunk, as stock's ``generate_step``
    prefills it: one model call per chunk of ``step`` tokens, its cache entries evaluated."""
    for start in range(0, tokens.shape[0], step):
        chunk = tokens[start : start + step]
        model(chunk[None], cache=kv)
        mx.eval([mlx_shims.kv_state(c) for c in kv])
        done += chunk.shape[0]
        if progress is not None:
            progress(done)


def _finish(group, first, make, stats, progress, done) -> int:
    """Run a group's chunks (routed through layer 0 already, by ``first``) through every layer,
    layer-major (``make(i)``: layer ``i``'s pass); the tokens done after it."""
    if not group:
        return done
    tokens = sum(ch.tokens for ch in group)
    layers = len(group[0].calls)
    held = first.finish(0)
    _count(stats, first, held)
    if progress is not None:
        progress(done + tokens // layers)
    for i in range(1, layers):
        layer = make(i)
        for chunk in group:
            layer.route(chunk, i)
        _count(stats, layer, layer.finish(i))
        if progress is not None:
            progress(done + tokens * (i + 1) // layers)
    stats.groups += 1
    return done + tokens


def _count(stats, layer: LayerPass, held: int) -> None:
    stats.held_bytes = max(stats.held_bytes, held)
    stats.parts_given += layer.replayed
    stats.attention_run += layer.rerun


def note_fallback(state, why: str) -> None:
    """Count a prompt that prefilled chunk by chunk; say why once (``--streaming-stats``)."""
    stats = state.prefill
    stats.fallbacks += 1
    stats.why = stats.why or why
    if state.options.stats and why not in stats.said:
        stats.said.add(why)
        report.say(report.fallback_line(state, why))


def wrap_generate_step(stock):
    """``generate_step`` with layer-major prefill for streaming models (module docstring); the
    stock function, unchanged, for every other model and where it does not apply."""
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def generate_step(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        model = a["model"]
        state = getattr(model, "expert_streaming", None)
        prompt, step = a["prompt"], a["prefill_step_size"]
        prompt_ahead(model, prompt)
        # whether the decode after the prompt checks each token one token late (checked_late.py)
        late = state is not None and checked_late.problem(stock, a, state) is None
        if (
            state is None
            or not state.cache.layer_major_prefill
            or not isinstance(prompt, mx.array)
            or prompt.ndim != 1
            or not isinstance(step, int)
            or step < 1
            or prompt.shape[0] - 1 <= step  # one chunk: nothing to reorder
            or _holds_every_expert(state.cache)
        ):
            yield from _decode(stock, bound, late)
            return
        why = _problem(state, a)
        if why is None:
            kv = a["prompt_cache"]
            if kv is None:
                kv = mlx_shims.make_prompt_cache(model, max_kv_size=a["max_kv_size"])
            why = mlx_shims.plain_kv_cache_problem(kv)
        if why is not None:
            note_fallback(state, why)
            yield from _decode(stock, bound, late)
            return
        total = prompt.shape[0]
        callback = a["prompt_progress_callback"] or (lambda *_: None)
        callback(0, total)
        try:
            with mx.stream(a["stream"]):
                prefill(model, kv, prompt[:-1], step, lambda n: callback(n, total))
        except Fallback as e:
            note_fallback(state, str(e))
            yield from _decode(stock, bound, late)
            return
        head = prompt[:-1]
        a["prompt"] = prompt[-1:]
        a["prompt_cache"] = kv
        if a["logits_processors"]:
            # stock's processors see every token of the prompt so far, then the generated ones
            a["logits_processors"] = [_after(head, p) for p in a["logits_processors"]]
        a["prompt_progress_callback"] = lambda n, t: callback(total - t + n, total) if n else None
        yield from _decode(stock, bound, late)

    generate_step.mlx_lm_streaming = True
    generate_step.stock = stock
    return generate_step


def _decode(stock, bound, late: bool):
    """The stock ``generate_step`` over ``bound``'s arguments, or, where ``late``, its decode with
    each token checked one token late (checked_late.py)."""
    if late:
        return checked_late.generate(stock, dict(bound.arguments))
    return stock(*bound.args, **bound.kwargs)


# where a prefill that does not go through generate_step falls back (mlx_compat: BATCH_INSERT)
BATCHED = (
    "mlx-lm's BatchGenerator (the server's batched requests, batch_generate) prefills a chunk per "
    "step, between decode steps, into batched caches"
)
SPECULATIVE = "a draft model (speculative_generate_step prefills chunk by chunk itself)"


def note_elsewhere(model, tokens: int, step, why: str) -> None:
    """A prompt of ``tokens`` tokens prefilled by mlx-lm outside ``generate_step`` in chunks of
    ``step``: counted as a fallback, said once, where layer-major prefill would have run."""
    state = getattr(model, "expert_streaming", None)
    if (
        state is None
        or not state.cache.layer_major_prefill
        or not isinstance(step, int)
        or tokens - 1 <= step
        or _holds_every_expert(state.cache)
    ):
        return
    note_fallback(state, why)


def note_batched(generator, lengths) -> None:
    """Prompts inserted into a ``BatchGenerator`` (``mlx_compat.wrap_batch_insert``)."""
    for n in lengths:
        note_elsewhere(generator.model, n, generator.prefill_step_size, BATCHED)


def wrap_speculative(stock):
    """``speculative_generate_step``, stock, with a long prompt's fallback noted for each
    streamed model it prefills (the model and the draft model)."""
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def speculative_generate_step(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        prompt = a["prompt"]
        tokens = prompt.size if isinstance(prompt, mx.array) else len(prompt)
        for model in (a["model"], a["draft_model"]):
            prompt_ahead(model, prompt)
            note_elsewhere(model, tokens, a["prefill_step_size"], SPECULATIVE)
        yield from stock(*args, **kwargs)

    speculative_generate_step.mlx_lm_streaming = True
    speculative_generate_step.stock = stock
    return speculative_generate_step


def prompt_ahead(model, prompt) -> None:
    """Tell the routing recorder of a streamed ``model`` that the prompt but its last token is
    prefill, however it is split into calls (a one-token chunk too)."""
    recorder = getattr(getattr(model, "expert_streaming", None), "recorder", None)
    if recorder is not None and isinstance(prompt, mx.array):
        recorder.prefill_ahead(prompt.size - 1)


def _after(head: mx.array, processor):
    def process(tokens, logits):
        return processor(mx.concat([head, tokens]), logits)

    if callable(getattr(processor, "take_back", None)):  # (checked_late: its draws taken back)
        process.take_back = processor.take_back
    return process


def _holds_every_expert(cache) -> bool:
    """Whether every bank has a slot per expert: an expert read once stays, so chunk by chunk reads
    each at most once already, and layer-major would only run attention twice (over two tiers,
    unless ``CacheTuning.tier_layer_sets``: the host tier's pages are read once per layer then)."""
    cache.ensure_planned()
    every = bool(cache.banks) and all(b.identity for b in cache.banks)
    return every and (cache.tiers is None or not cache.tuning.tier_layer_sets)


def _problem(state, a) -> Optional[str]:
    """Why layer-major prefill does not apply to this call, from its arguments, or None."""
    if a["input_embeddings"] is not None:
        return "input embeddings"
    if a["kv_bits"] is not None:
        return "a quantized KV cache (kv_bits)"
    if state.pipeline is not None:
        return "a pipeline-parallel model"
    if state.steps is None or state.steps.layers == 0:
        return "the model has no list of decoder layers"
    return None
