"""The runtime's shims over mlx-lm internals: the few places where the hot path repeats or reaches
into mlx-lm's own code (``SwitchGLU.__call__`` a step at a time, a decoder layer's call wrapped, a
KV cache entry taken back or put at an offset, a hybrid's recurrent state, ``ArraysCache``, given
back its arrays).

Each is used only where ``mlx_compat`` (the gate) found mlx-lm as expected at patch time: the
version in ``SUPPORTED``, ``SwitchGLU``'s body (``switch_glu_problem``), ``generate_step``'s
(``generate_step_problem``); the cache reach-ins check the entry they touch
(``rewindable``, ``recurrent_state``, ``plain_kv_cache_problem``) and decline where it differs.
"""

import contextlib
import functools
import inspect
import threading
from threading import get_ident
from typing import Optional

import mlx.core as mx

from .mlx_compat import SORT_THRESHOLD, switch_linears


def is_stock_switch_glu(module) -> bool:
    """Whether ``module`` is mlx-lm's own ``SwitchGLU`` (a subclass may call differently)."""
    from mlx_lm.models.switch_layers import SwitchGLU

    return type(module) is SwitchGLU


def switch_glu_input(x):
    """``x`` as SwitchGLU.__call__ hands it to its projections."""
    return mx.expand_dims(x, (-2, -3))


def switch_glu_projection(glu, proj: str, x, indices):
    """``gate_proj`` or ``up_proj`` of ``switch_glu_input(x)``, unsorted."""
    return getattr(glu, proj)(x, indices, sorted_indices=False)


def switch_glu_output(glu, up, gate, indices):
    """The rest of the call: activation, ``down_proj``, the squeeze."""
    return glu.down_proj(glu.activation(up, gate), indices, sorted_indices=False).squeeze(-2)


ROWS: dict = {}  # a batch shape -> its rows' indices (``row_indices``)
_ROWS_STREAM = threading.local()  # each thread's stream they are made on (MLX's are per thread)


def rows_kept(glu) -> bool:
    """Whether ``switch_glu`` may make ``glu``'s call with its rows' indices given: mlx-lm's own
    ``SwitchGLU`` whose projections are of classes whose call ``mlx_compat.switch_linears``
    found as it repeats them."""
    projections = (getattr(glu, p, None) for p in ("gate_proj", "up_proj", "down_proj"))
    return is_stock_switch_glu(glu) and all(type(p) in linear_kinds() for p in projections)


@functools.lru_cache(maxsize=None)
def linear_kinds() -> dict:
    """``mlx_compat.switch_linears()``, read once (the installed mlx-lm's sources)."""
    return switch_linears()


# mlx-lm's ``SwiGLU.__call__`` and the ``swiglu`` it calls (mlx_lm.models.activations), whitespace
# removed: a compiled ``silu(gate) * x``, which ``bank.compiled_glu`` may compile inside its graph
_SWIGLU_CALL = "def__call__(self,x,gate):returnswiglu(gate,x)"
_SWIGLU = "@partial(mx.compile,shapeless=True)defswiglu(gate,x):returnnn.silu(gate)*x"


@functools.lru_cache(maxsize=None)
def stock_swiglu():
    """mlx-lm's ``SwiGLU`` class where its call is ``swiglu(gate, x)`` and that ``swiglu`` is
    mlx-lm's own compiled ``silu(gate) * x`` (the installed sources read once); None where
    either differs or cannot be read."""
    import re

    try:
        from mlx_lm.models import activations, switch_layers

        cls, fused = switch_layers.SwiGLU, switch_layers.swiglu
        call = re.sub(r"\s+", "", inspect.getsource(cls.__call__))
        source = re.sub(r"\s+", "", inspect.getsource(activations))
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    ok = call == _SWIGLU_CALL and _SWIGLU in source and fused is activations.swiglu
    return cls if ok else None


def switch_glu(glu):
    """``glu``'s call, ``(x, indices) -> glu(x, indices)``, for a ``glu`` that ``rows_kept``
    accepts. Below the sort threshold, ``SwitchGLU.__call__``'s statements and its projections'
    (``mlx_compat.switch_linears``), unsorted, with each projection's rows of ``x`` given
    (``row_indices``): MLX's ``gather_qmm`` and ``gather_mm`` build an ``arange`` for them in each
    call when none are (three kernels a MoE call, each launched on a GPU), and with
    ``sorted_indices`` off the primitive and its inputs' values are the same, so the bits are
    stock's. At the threshold and above (sorted calls, whose primitive would differ): ``glu``.
    Each projection's fixed arguments are bound here, its arrays read at each call (a bank's are
    swapped in place); one function a call (the hot path's calls are counted)."""
    act, specs = glu.activation, []
    for proj in (glu.up_proj, glu.gate_proj, glu.down_proj):
        kind = linear_kinds()[type(proj)]
        qmm = None
        if kind != "plain":
            qmm = functools.partial(mx.gather_qmm, transpose=True, group_size=proj.group_size,
                                    bits=proj.bits, mode=proj.mode)  # fmt: skip
        specs.append((proj, qmm, kind == "global"))

    def call(x, indices):
        if indices.size >= SORT_THRESHOLD:
            return glu(x, indices)
        x = mx.expand_dims(x, (-2, -3))
        out = []
        for proj, qmm, scaled in specs:
            if len(out) == 2:
                x = act(out[0], out[1])
            rows = ROWS.get(x.shape[:-2])
            if rows is None:
                rows = row_indices(x.shape[:-2])
            if qmm is None:
                y = mx.gather_mm(x, proj["weight"].swapaxes(-1, -2), rows, indices)
            elif scaled:
                y = qmm(x, proj["weight"], proj["scales"], proj.get("biases"), rows, indices,
                        global_scale=proj.global_scale)  # fmt: skip
            else:
                y = qmm(x, proj["weight"], proj["scales"], proj.get("biases"), rows, indices)
            if "bias" in proj:
                y = y + mx.expand_dims(proj["bias"][indices], -2)
            out.append(y)
        return out[2].squeeze(-2)

    return call


def row_indices(shape):
    """``arange(prod(shape)).reshape(shape)`` in uint32, what ``gather_qmm`` makes when given no
    ``lhs_indices``: made once per shape and evaluated on a stream of the thread's own (an
    evaluation on the model's stream would wait behind its queued work), in memory its kernel
    wrote; then any thread's."""
    rows = ROWS.get(shape)
    if rows is None:
        stream = getattr(_ROWS_STREAM, "stream", None)
        if stream is None:
            stream = _ROWS_STREAM.stream = mx.new_stream(mx.default_device())
        n = 1
        for size in shape:
            n *= size
        with mx.stream(stream):
            rows = mx.arange(n, dtype=mx.uint32).reshape(shape)
            mx.eval(rows)
        rows = ROWS.setdefault(shape, rows)
    return rows


def wrap_call(module, around) -> None:
    """Route calls of ``module`` (the ``Model``: ``model(inputs, cache=...)``, or one of its decoder
    layers: ``layer(x, mask, cache)``) through ``around(call, args, kwargs)``, where
    ``call(*args, **kwargs)`` is the stock call. The module gets a subclass of its own class, of the
    same name and module, with that one method: its parameters, attributes and every other method
    are untouched."""

    def method(cls):
        def __call__(self, *args, **kwargs):
            return around(functools.partial(cls.__call__, self), args, kwargs)

        return __call__

    wrap_method(module, method)


def wrap_layer(module, i: int, cache) -> None:
    """Route calls of decoder layer ``module`` through ``cache.mode.layer_call(i, call, args,
    kwargs)`` while the running model call's mode takes its layers' calls (``modes.Mode.wraps``:
    a verified step, layer-major prefill's recorder) and is this thread's, stock otherwise:
    ``wrap_call`` with the check in the method itself (one call fewer per layer), and the stock
    call bound to ``module`` once (the subclass is the module's own), not per call."""

    def method(cls):
        stock = cls.__call__
        bound = functools.partial(stock, module)

        def __call__(self, *args, **kwargs):
            mode = cache.mode
            if mode.wraps and mode.owner == get_ident():
                call = bound if self is module else functools.partial(stock, self)
                return mode.layer_call(i, call, args, kwargs)
            return stock(self, *args, **kwargs)

        return __call__

    wrap_method(module, method)


def wrap_method(module, method) -> None:
    """Give ``module`` a subclass of its own class whose ``__call__`` is ``method(its class)``
    (``wrap_call``)."""
    cls = type(module)
    __call__ = method(cls)
    sub = type(
        cls.__name__,
        (cls,),
        {
            "__call__": __call__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_mlx_lm_streaming_wrapped": True,
        },
    )
    module.__class__ = sub


def call_inputs(args, kwargs):
    """``(tokens per sequence or None, cache)`` of a model call ``model(inputs, cache=None,
    ...)`` (``inputs``: ``(batch, tokens)`` or ``(tokens,)``)."""
    inputs = args[0] if args else kwargs.get("inputs")
    cache = args[1] if len(args) > 1 else kwargs.get("cache")
    shape = getattr(inputs, "shape", None)
    if not shape:
        return None, cache
    return int(shape[-1]) if len(shape) >= 2 else int(shape[0]), cache


def rewindable(cache, tokens: int) -> bool:
    """Whether a forward of ``tokens`` tokens over ``cache`` (a model's list of mlx-lm caches,
    or None) can be undone exactly by ``put_back``: every entry a ``KVCache`` or
    ``QuantizedKVCache`` (a write past ``offset`` that ``trim`` takes back), a ``RotatingKVCache``
    that stays short of its window (it then overwrites nothing kept), or an ``ArraysCache`` (the
    recurrent or linear-attention state of hybrids: ``recurrent_state``) outside a batch's
    prepared lengths or padding. Any other cache (batches, chunked caches) is not rewound."""
    if cache is None:
        return True
    # (each a lookup of ``_cache_class``'s cache: a verified step asks once per decode call)
    plain = (_cache_class("KVCache"), _cache_class("QuantizedKVCache"))
    rotating = _cache_class("RotatingKVCache")
    for c in cache:
        if type(c) in plain:
            continue
        if rotating is not None and type(c) is rotating and c.offset + tokens < c.max_size:
            continue
        if recurrent_state(c):
            continue
        return False
    return True


def recurrent_state(entry) -> bool:
    """Whether ``entry`` is exactly mlx-lm's ``ArraysCache`` as a model's own step leaves it: a list
    of arrays (``cache``) that each step replaces (``cache[i] = new``, never written into: MLX
    arrays are values), no batch lengths or left padding (``prepare``; ``advance`` changes
    those in place). Keeping the list's references (``mark``) is then enough to put it back."""
    arrays = _cache_class("ArraysCache")
    return (
        arrays is not None
        and type(entry) is arrays
        and isinstance(getattr(entry, "cache", None), list)
        and getattr(entry, "lengths", 0) is None
        and getattr(entry, "left_padding", 0) is None
    )


@functools.lru_cache(maxsize=None)
def _cache_class(name: str):
    """mlx-lm's cache class ``name`` (``mlx_lm.models.cache``), or None; looked up once (a
    verified step marks every entry of every decode call)."""
    from mlx_lm.models import cache as mc

    return getattr(mc, name, None)


def mark(entry):
    """What ``put_back`` needs to put ``entry`` (``rewindable``) back as it is now: a recurrent
    state's arrays (references), a KV entry's offset (None: no entry)."""
    if entry is None:
        return None
    if type(entry) is _cache_class("ArraysCache"):  # (``rewindable``: a ``recurrent_state``)
        return list(entry.cache)
    return entry.offset


def marks(cache) -> dict:
    """``id(entry) -> mark(entry)`` for every entry of ``cache`` (a model's list of entries, or
    None: no cache), in one call (a verified step marks every entry of every decode call)."""
    if cache is None:
        return {}
    arrays = _cache_class("ArraysCache")
    marked = {}
    for c in cache:  # (a loop: on Python 3.11 a comprehension is a call, once per decode token)
        marked[id(c)] = None if c is None else list(c.cache) if type(c) is arrays else c.offset
    return marked


def put_back(entry, marked) -> None:
    """Put ``entry`` back as it was when ``mark`` gave ``marked``: its arrays again, or the tokens
    written past its offset then taken back (``trim``)."""
    if isinstance(marked, list):
        entry.cache = list(marked)
    elif entry.offset > marked:
        entry.trim(entry.offset - marked)


def rewind(cache, marks) -> None:
    """Put each entry of ``cache`` (a list of cache entries, None for a layer that has none; or
    None: no cache) back as ``marks`` (``id(entry) -> mark(entry)``) says it was."""
    if cache is None:
        return
    for c in cache:
        if c is not None:
            put_back(c, marks[id(c)])


def changed(entry, marked) -> bool:
    """Whether ``entry`` was written since ``mark`` gave ``marked``."""
    if isinstance(marked, list):
        return len(entry.cache) != len(marked) or any(
            a is not b for a, b in zip(entry.cache, marked)
        )
    return entry.offset != marked


def stock_call(module, *args, **kwargs):
    """Call ``module`` with its own class's ``__call__``, past a ``wrap_call`` wrapper."""
    cls = type(module)
    if getattr(cls, "_mlx_lm_streaming_wrapped", False):
        cls = cls.__mro__[1]
    return cls.__call__(module, *args, **kwargs)


def layer_cache(args, kwargs):
    """The cache entry of a decoder layer's call ``layer(x, mask, cache)`` (or ``cache=``)."""
    return args[2] if len(args) > 2 else kwargs.get("cache")


def make_prompt_cache(model, max_kv_size=None):
    """mlx-lm's own cache for ``model``, as ``generate_step`` makes it."""
    from mlx_lm.models.cache import make_prompt_cache as make

    return make(model, max_kv_size=max_kv_size)


def plain_kv_cache_problem(cache) -> Optional[str]:
    """None if every entry of ``cache`` is exactly mlx-lm's ``KVCache`` (a write appends; its mask
    and offsets depend on its own length only) or a hybrid's recurrent state (``recurrent_state``),
    else the first other kind, in words."""
    from mlx_lm.models import cache as mc

    plain = getattr(mc, "KVCache", None)
    if not isinstance(cache, list) or not cache:
        return "no list of KV caches"
    for i, c in enumerate(cache):
        if recurrent_state(c):
            continue  # a hybrid's recurrent state: put back between a layer's runs (``seek``)
        if type(c).__name__ == "ArraysCache":
            return (
                f"cache entry {i} is an ArraysCache with a batch's lengths or padding, which "
                "mlx-lm changes in place: it cannot be put back between a layer's two runs"
            )
        if plain is None or type(c) is not plain:
            return f"a {type(c).__name__} (only KVCache entries are prefilled layer by layer)"
        if not all(hasattr(c, a) for a in ("offset", "keys", "trim")):
            return "mlx-lm's KVCache has no offset, keys or trim"
    return None


def kv_seek(entry, offset: int) -> None:
    """Put ``entry`` (a ``KVCache``, ``plain_kv_cache_problem``) at ``offset`` tokens, back or
    forward within what it holds: its next write goes there, and its reads see the tokens before
    it (``trim`` only goes back)."""
    held = 0 if entry.keys is None else entry.keys.shape[2]
    if not 0 <= offset <= held:
        raise ValueError(f"a KVCache holding {held} tokens cannot be put at token {offset}")
    entry.offset = offset


def child_modules(module) -> list:
    """The modules that are direct attributes of ``module`` (a decoder layer's attention, norms,
    MLP), not those in lists or dicts."""
    import mlx.nn as nn

    return [m for m in module.children().values() if isinstance(m, nn.Module)]


@contextlib.contextmanager
def calls_through(modules, around):
    """While the block runs, route calls of each of ``modules`` through ``around(module, call,
    args, kwargs)`` (``call(*args, **kwargs)``: the stock call); their classes are put back
    after it (``wrap_call``, undone)."""
    classes = [(m, type(m)) for m in modules]
    try:
        for m, _ in classes:
            wrap_call(m, lambda call, args, kwargs, m=m: around(m, call, args, kwargs))
        yield
    finally:
        for m, cls in classes:
            m.__class__ = cls


def kv_state(entry):
    """What to evaluate of one KV cache entry (as ``generate_step`` evaluates ``c.state``; a
    layer with no entry: nothing)."""
    return [] if entry is None else entry.state


def seek(entry, marked) -> None:
    """Put ``entry`` where ``mark`` said it was, back or forward: a ``KVCache`` at that offset
    (``kv_seek``), a recurrent state given those arrays; a layer with no entry (None): nothing."""
    if entry is None:
        return
    if isinstance(marked, list):
        entry.cache = list(marked)
    else:
        kv_seek(entry, marked)
