"""``bank.compiled_glu``: a bank's decode-sized expert call, and a verified step's with its slot
map, compiled by ``mx.compile`` (``CacheTuning.compiled_glu``): the module's bits for every
projection kind, the arrays read at each call (a bank's are swapped in place), the module's own
call at the sort threshold, not taken for an activation of other code, and the tuning's choice
per backend."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU
from support import assert_same_steps, generate_steps, load_stock, load_streaming, with_slots

from mlx_lm_streaming.runtime import devices, mlx_shims
from mlx_lm_streaming.runtime.bank import compiled_glu
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

H, I, E = 128, 64, 8
MODES = [("affine", 64, 4), ("affine", 32, 8), ("mxfp4", 32, 4), ("nvfp4", 16, 4), None]
SHAPES = [(1, 1, 8), (1, 1, 2), (1, 4, 8), (2, 1, 8), (1, 3, 4), (1, 8, 8)]  # (1, 8, 8): sorted


def _glu(mode, bias=False, seed=1):
    mx.random.seed(seed)
    glu = SwitchGLU(H, I, E, bias=bias)
    if mode is not None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            q = getattr(glu, proj).to_quantized(group_size=mode[1], bits=mode[2], mode=mode[0])
            setattr(glu, proj, q)
    mx.eval(glu.parameters())
    return glu


def _inputs(shape, seed=3):
    b, t, k = shape
    x = mx.random.normal((b, t, H), key=mx.random.key(seed)).astype(mx.bfloat16)
    ids = mx.random.randint(0, E, shape, key=mx.random.key(seed + 1)).astype(mx.uint32)
    return x, ids


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "float" if m is None else f"{m[0]}{m[2]}")
@pytest.mark.parametrize("shape", SHAPES)
def test_the_modules_bits_through_both_calls(mode, shape):
    glu = _glu(mode, bias=mode is None)  # (the float projections with biases: their gather too)
    call, mapped = compiled_glu.compiled_calls(glu)
    x, ids = _inputs(shape)
    slots = mx.array(np.random.default_rng(5).permutation(E), dtype=mx.int32)  # expert -> slot
    for _ in range(2):  # (traced, then replayed)
        want, got = glu(x, ids), call(x, ids)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert mx.array_equal(got, want).item(), (mode, shape)
        want, got = glu(x, slots[ids]), mapped(x, slots, ids)
        assert mx.array_equal(got, want).item(), (mode, shape)


def test_the_arrays_are_read_at_each_call():
    # a bank's arrays are swapped in place (a new budget): the compiled graph must take the new
    # ones, not the ones it was traced with
    glu, other = _glu(MODES[0], seed=1), _glu(MODES[0], seed=2)
    call, mapped = compiled_glu.compiled_calls(glu)
    x, ids = _inputs((1, 1, 8))
    before = call(x, ids)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for key in ("weight", "scales", "biases"):
            getattr(glu, proj)[key] = getattr(other, proj)[key]
    after, slots = call(x, ids), mx.arange(E)
    assert mx.array_equal(after, other(x, ids)).item()
    assert not mx.array_equal(after, before).item()
    assert mx.array_equal(mapped(x, slots, ids), other(x, ids)).item()


def test_sorted_calls_are_the_modules_own(monkeypatch):
    glu = _glu(MODES[0])
    call, mapped = compiled_glu.compiled_calls(glu)
    calls = []
    monkeypatch.setattr(SwitchGLU, "__call__", lambda self, x, i: calls.append(i.size) or x)
    x = mx.zeros((1, 8, H))
    call(x, mx.zeros((1, 8, 8), dtype=mx.uint32))
    mapped(x, mx.arange(E), mx.zeros((1, 8, 8), dtype=mx.uint32))
    assert calls == [64, 64]


def test_an_activation_of_other_code_is_not_compiled():
    class Gelu(nn.Module):
        def __call__(self, x, gate):
            return nn.gelu(gate) * x

    glu = _glu(MODES[0])
    glu.activation = Gelu()
    assert mlx_shims.rows_kept(glu)  # (its rows are still given: ``switch_glu``)
    assert compiled_glu.compiled_calls(glu) is None


def test_a_changed_swiglu_is_not_compiled(monkeypatch):
    # the fused kernel is stock's only while mlx-lm's SwiGLU calls its own compiled swiglu: a
    # changed body (a future mlx-lm, a patch) leaves the call uncompiled
    from mlx_lm.models.switch_layers import SwiGLU

    glu = _glu(MODES[0])
    assert mlx_shims.stock_swiglu() is SwiGLU and compiled_glu.compiled_calls(glu) is not None

    def changed(self, x, gate):
        return nn.silu(gate) * x * 2

    monkeypatch.setattr(SwiGLU, "__call__", changed)
    mlx_shims.stock_swiglu.cache_clear()
    try:
        assert mlx_shims.stock_swiglu() is None
        assert compiled_glu.compiled_calls(glu) is None
    finally:
        monkeypatch.undo()
        mlx_shims.stock_swiglu.cache_clear()
    assert mlx_shims.stock_swiglu() is SwiGLU


@pytest.mark.parametrize("choice", [None, True, False])
def test_the_banks_calls_follow_the_tuning(checkpoint, choice):
    model, _ = load_streaming(checkpoint("qwen3_moe"), tuning=CacheTuning(compiled_glu=choice))
    cache = model.expert_streaming.cache
    cache.ensure_planned()
    on = devices.backend() in ("cpu", "cuda") if choice is None else choice
    for bank in cache.banks:
        assert (bank.glu_mapped is not None) is on
        assert bank.glu_call is not bank.glu
    model.expert_streaming.close()


@pytest.mark.parametrize("choice", [True, False])
def test_verified_steps_give_stocks_bits_either_way(q3_path, choice):
    # one slot fewer than experts: held steps that hit, and misses run again from their layer
    prompt = mx.array([3, 17, 42, 5, 9, 101, 7, 64])
    want = generate_steps(load_stock(q3_path)[0], prompt, 16)
    model = with_slots(q3_path, 15, tuning=CacheTuning(compiled_glu=choice))
    got = generate_steps(model, prompt, 16)
    assert_same_steps(want, got)
    runner = model.expert_streaming.steps
    assert runner.verified > runner.replays > 0
    assert all((b.glu_mapped is not None) is choice for b in model.expert_streaming.cache.banks)
    model.expert_streaming.close()
