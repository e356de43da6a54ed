"""runtime/bank/join_ids.py: many small ids arrays joined into one (one kernel on mlx-cuda,
MLX's stack or concatenation elsewhere): the ids in order, whatever the shapes; on mlx-cuda the
kernel's bytes are MLX's stack's (run there: ``pytest tests/test_join.py`` on the device)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_streaming.runtime.bank import join_ids as join
from mlx_lm_streaming.runtime.devices import backend


def _router_ids(n, k=8, experts=128, rows=1, seed=0):
    """``n`` ids arrays as mlx-lm's routers make them: the top ``k`` of ``experts`` scores, a
    slice of ``argpartition`` (not a copy), ``(rows, 1, k)`` each."""
    scores = mx.random.normal((n, rows, 1, experts), key=mx.random.key(seed))
    return [mx.argpartition(-scores[i], k - 1, axis=-1)[..., :k] for i in range(n)]


def _host(arrays):
    return [np.array(a).reshape(-1) for a in arrays]


@pytest.mark.parametrize("n, rows", [(2, 1), (16, 1), (128, 1), (384, 1), (16, 3)])
def test_rows_and_flat_keep_every_id_in_order(n, rows):
    arrays = _router_ids(n, rows=rows)
    want = _host(arrays)
    got = np.array(join.join_rows(arrays))
    assert got.shape == (n, rows * 8)
    assert [r.tolist() for r in got] == [w.tolist() for w in want]
    flat = np.array(join.join_flat(arrays, False)).reshape(-1)
    assert flat.tolist() == np.concatenate(want).tolist()


def test_arrays_of_other_shapes_are_flattened_in_order():
    arrays = _router_ids(3) + _router_ids(2, rows=2, seed=1) + [mx.array([5, 7], dtype=mx.uint32)]
    flat = np.array(join.join_flat(arrays, False)).reshape(-1)
    assert flat.tolist() == np.concatenate(_host(arrays)).tolist()


def test_one_array_and_more_than_the_kernel_takes():
    (one,) = _router_ids(1)
    assert np.array(join.join_rows([one])).tolist() == [np.array(one).reshape(-1).tolist()]
    many = _router_ids(join.MAX_ARRAYS + 1)
    got = np.array(join.join_rows(many))
    assert got.shape == (join.MAX_ARRAYS + 1, 8) and got[-1].tolist() == _host(many)[-1].tolist()


def test_the_kernels_source_switches_over_every_input():
    name, inputs, outputs, source = join._source(5)
    assert name == "mlx_lm_streaming_join_5" and inputs == ["a0", "a1", "a2", "a3", "a4"]
    assert outputs == ["out"]
    assert [f"case {i}: src = a{i};" in source for i in range(1, 5)] == [True] * 4
    assert "case 0:" not in source and "case 5:" not in source  # (a0: the default)


@pytest.mark.skipif(backend() != "cuda", reason="the kernel runs on mlx-cuda only")
def test_on_cuda_the_kernels_bytes_are_stacks():
    join._kernels.clear()
    for n, rows, dtype in [(16, 1, mx.uint32), (128, 1, mx.uint32), (384, 1, mx.uint32),
                           (16, 3, mx.uint32), (7, 1, mx.int32)]:  # fmt: skip
        arrays = [a.astype(dtype) if dtype != mx.uint32 else a for a in _router_ids(n, rows=rows)]
        got, want = join.join_rows(arrays), mx.stack(arrays).reshape(n, -1)
        assert got.dtype == want.dtype and np.array_equal(np.array(got), np.array(want)), (n, rows)
    assert sorted(join._kernels) == [7, 16, 128, 384]  # (the kernel ran: one made per count)


def test_the_kernel_is_mlx_cudas_where_join_kernel_says_and_off_by_default():
    # ``CacheTuning.join_kernel``: False (the default, until a GPU run checks it) or any value off
    # mlx-cuda: MLX's stack; None or True on mlx-cuda: the kernel, for the check and the tiers
    from types import SimpleNamespace as NS

    from support import PlacementRecorder

    from mlx_lm_streaming.runtime.decode.runner import StepRunner
    from mlx_lm_streaming.runtime.memory import tiers
    from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

    assert CacheTuning().join_kernel is False
    for backend_, said, want in [("cuda", False, False), ("cuda", None, True), ("cuda", True, True),
                                 ("cpu", True, False), ("metal", None, False)]:  # fmt: skip
        state = NS(cache=NS(tuning=CacheTuning(join_kernel=said)), selector=NS(backend=backend_))
        assert StepRunner(state).join is want, (backend_, said)
    for said, want in [(False, False), (None, True), (True, True)]:
        bank = NS(num_experts=4, layer=NS(expert_nbytes=1000))
        cache = NS(tuning=CacheTuning(join_kernel=said), budget_bytes=1000, banks=[bank],
                   total_expert_bytes=4000, host_bytes=0, tiers=None, planned=True)  # fmt: skip
        tiers.set_up(cache, 1.0, "cuda", placer=PlacementRecorder(), available=10**12)
        assert cache.tiers is not None and cache.tiers.join is want, said
