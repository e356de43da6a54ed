"""``mlx_shims.switch_glu``: mlx-lm's ``SwitchGLU`` call below the sort threshold with each
projection's rows of ``x`` given to ``gather_qmm`` / ``gather_mm`` (``CacheTuning.
kept_row_indices``), where MLX would build an ``arange`` in every call: the module's bits, three
graph nodes with a kernel each fewer a call, and the module's own call wherever the projections'
bodies are not the ones it repeats (``mlx_compat.switch_linears``). Run under the oldest supported
mlx-lm too (``core``: its projections' bodies differ)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

from mlx_lm_streaming.runtime import mlx_compat, mlx_shims
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

from support import load_streaming

pytestmark = pytest.mark.core

H, I, E = 128, 64, 8
MODES = [("affine", 64, 4), ("affine", 32, 8), ("mxfp4", 32, 4), ("nvfp4", 16, 4), None]


def _glu(mode, bias=False, seed=1):
    mx.random.seed(seed)
    glu = SwitchGLU(H, I, E, bias=bias)
    if mode is not None:
        group, bits, name = mode[1], mode[2], mode[0]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            q = getattr(glu, proj).to_quantized(group_size=group, bits=bits, mode=name)
            setattr(glu, proj, q)
    mx.eval(glu.parameters())
    return glu


def _bits(a):
    return np.array(a.astype(mx.float32))


def _nodes(tmp_path, out, name):
    """The primitives of ``out``'s graph, by name, with their counts."""
    path = tmp_path / f"{name}.dot"
    mx.export_to_dot(str(path), out)
    counts = {}
    for line in path.read_text().splitlines():
        if 'label ="' in line:
            label = line.split('label ="')[1].split('"')[0].split("\\n")[0]
            counts[label] = counts.get(label, 0) + 1
    return counts


def test_both_projection_classes_are_known_here():
    # the installed mlx-lm's bodies are among those repeated (0.30-0.31 and 0.32 differ)
    found = mlx_compat.switch_linears()
    assert set(found) == {QuantizedSwitchLinear, SwitchLinear}
    assert found[SwitchLinear] == "plain"
    assert mlx_shims.rows_kept(_glu(MODES[0]))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "float" if m is None else f"{m[0]}{m[2]}")
@pytest.mark.parametrize("shape", [(1, 1, 8), (1, 1, 2), (1, 3, 4), (2, 1, 8), (1, 8, 8)])
def test_the_modules_bits_below_and_at_the_sort_threshold(mode, shape):
    glu = _glu(mode, bias=mode is None)  # (the float projections with biases: their gather too)
    assert mlx_shims.rows_kept(glu)
    b, t, k = shape
    x = mx.random.normal((b, t, H), key=mx.random.key(3)).astype(mx.bfloat16)
    idx = mx.random.randint(0, E, shape, key=mx.random.key(4)).astype(mx.uint32)
    want, got = glu(x, idx), mlx_shims.switch_glu(glu)(x, idx)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.array_equal(got, want).item(), (mode, shape)
    assert np.array_equal(_bits(got), _bits(want))


def test_no_arange_in_the_graph_and_the_rows_made_once(tmp_path):
    glu = _glu(MODES[0])
    assert mlx_shims.rows_kept(glu)
    x = mx.random.normal((1, 1, H)).astype(mx.bfloat16)
    idx = mx.array([[[1, 5, 2, 7, 0, 3, 6, 4]]], dtype=mx.uint32)
    stock = _nodes(tmp_path, glu(x, idx), "stock")
    ours = _nodes(tmp_path, mlx_shims.switch_glu(glu)(x, idx), "ours")
    assert stock.get("Arange") == 3 and "Arange" not in ours
    assert ours["GatherQMM"] == stock["GatherQMM"] == 3
    assert sum(ours.values()) < sum(stock.values())
    rows = mlx_shims.row_indices((1, 1, 8))
    assert rows is mlx_shims.row_indices((1, 1, 8))  # kept, evaluated
    assert rows.dtype == mx.uint32 and np.array(rows).ravel().tolist() == list(range(8))


def test_sorted_calls_are_the_modules_own(monkeypatch):
    # at 64 ids and more SwitchGLU sorts, and gather_qmm's primitive depends on whether rows were
    # given: the module's call, untouched
    glu = _glu(MODES[0])
    calls = []
    monkeypatch.setattr(SwitchGLU, "__call__", lambda self, x, i: calls.append(i.size) or x)
    x = mx.zeros((1, 8, H))
    mlx_shims.switch_glu(glu)(x, mx.zeros((1, 8, 8), dtype=mx.uint32))
    assert calls == [64]


def test_a_projection_of_another_call_keeps_the_modules_call():
    class Scaled(SwitchLinear):  # a subclass: its call may differ
        def __call__(self, x, indices, sorted_indices=False):
            return 2 * super().__call__(x, indices, sorted_indices)

    glu = _glu(None)
    glu.down_proj = Scaled(I, H, E, bias=False)
    assert not mlx_shims.rows_kept(glu)

    class Glu(SwitchGLU):
        pass

    assert not mlx_shims.rows_kept(Glu(H, I, E))


def test_a_changed_projection_body_is_not_repeated(monkeypatch):
    def changed(self, x, indices, sorted_indices=False):
        return mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices) * 2

    monkeypatch.setattr(SwitchLinear, "__call__", changed)
    assert SwitchLinear not in mlx_compat.switch_linears()


@pytest.mark.parametrize("kept", [True, False])
def test_the_banks_call_follows_the_tuning(checkpoint, kept):
    model, _ = load_streaming(checkpoint("qwen3_moe"), tuning=CacheTuning(kept_row_indices=kept))
    cache = model.expert_streaming.cache
    cache.ensure_planned()
    for bank in cache.banks:
        assert (bank.glu_call is bank.glu) is not kept
    model.expert_streaming.close()


def test_rows_made_on_one_thread_serve_another():
    # MLX's streams are per thread: the rows are evaluated where they are made, then shared
    import threading

    glu = _glu(MODES[0])
    assert mlx_shims.rows_kept(glu)
    x = mx.random.normal((1, 2, H)).astype(mx.bfloat16)
    idx = mx.array([[[1, 2], [3, 4]]], dtype=mx.uint32)
    want, out = glu(x, idx), {}
    mx.eval(x, idx, want)  # (an array is evaluated on its own thread's streams)

    def run():
        out["y"] = mlx_shims.switch_glu(glu)(x, idx)  # (its rows made on this thread)
        mx.eval(out["y"])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert mx.array_equal(out["y"], want).item()
    assert mx.array_equal(mlx_shims.switch_glu(glu)(x, idx), want).item()  # (here, made there)


def test_only_the_gather_kernels_own_call_is_made_by_the_layer():
    # a kernel whose call is ``bank.glu_call`` alone is called so by the layer (a call fewer); a
    # subclass with a call of its own (a plugin's counting kernel) keeps being called
    from mlx_lm_streaming.kernels.base import ExpertKernel
    from mlx_lm_streaming.kernels.gather import GatherKernel

    class Renamed(GatherKernel):
        name = "renamed"

    class Counting(GatherKernel):
        def __call__(self, x, slots, slots_np, bank):
            return super().__call__(x, slots, slots_np, bank)

    assert GatherKernel.calls_only_glu and Renamed.calls_only_glu
    assert not Counting.calls_only_glu and not ExpertKernel.calls_only_glu
