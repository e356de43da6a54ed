"""Slot writes by device copies (``cuda_copy.py``), the path mlx-cuda takes: tested here with a
runtime whose copies are host ``memmove``s, so that the reads into the page-locked buffer, their
grouping and splitting, and the addresses of the slots are checked on the CPU, bit for bit.
The real runtime is only on CUDA machines (bench/slot_write_probe.py, in git at bc42dd5, measured it there)."""

import ctypes

import numpy as np
import pytest
from support import decode, same, with_slots

from mlx_lm_streaming.errors import ExpertIOError
from mlx_lm_streaming.runtime.bank import cuda_copy
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from mlx_lm_streaming.runtime.reads.safetensors_header import TensorRef


class HostRuntime:
    """The runtime calls ``SlotCopier`` makes, done on the host: copies are ``memmove``s."""

    def __init__(self, fail_copy=False):
        self.fail_copy = fail_copy
        self.copies = []  # (destination, bytes)
        self.held = {}  # pointer -> buffer of cudaHostAlloc (and of cudaMalloc)
        self.freed = 0
        self.freed_pointers = []  # of cudaFreeHost
        self.device = []  # (pointer, bytes) of each cudaMalloc
        self.device_freed = 0

    def cudaHostAlloc(self, pointer, nbytes, flags):
        buf = ctypes.create_string_buffer(nbytes)
        pointer._obj.value = ctypes.addressof(buf)
        self.held[ctypes.addressof(buf)] = buf
        return 0

    def cudaFreeHost(self, pointer):
        self.freed += 1
        self.freed_pointers.append(pointer.value)
        return 0

    def cudaMalloc(self, pointer, nbytes):  # (device memory: host memory here)
        buf = ctypes.create_string_buffer(nbytes)
        pointer._obj.value = ctypes.addressof(buf)
        self.held[ctypes.addressof(buf)] = buf
        self.device.append((ctypes.addressof(buf), nbytes))
        return 0

    def cudaFree(self, pointer):
        self.device_freed += 1
        return 0

    def cudaStreamCreateWithFlags(self, stream, flags):
        return 0

    def cudaStreamSynchronize(self, stream):
        return 0

    def cudaStreamDestroy(self, stream):
        return 0

    def cudaMemcpyAsync(self, dst, src, nbytes, kind, stream):
        if self.fail_copy:
            return 700
        ctypes.memmove(dst, src, nbytes)
        self.copies.append((dst, nbytes))
        return 0


def read_from(source: bytes):
    """``read_ranges`` over an in-memory file: each ref's bytes at its offset."""

    def read_ranges(jobs):
        for ref, out in jobs:
            out[:] = source[ref.offset : ref.offset + ref.nbytes]

    return read_ranges


def ref(offset, nbytes):
    return TensorRef(file="f", name=f"t{offset}", offset=offset, nbytes=nbytes, dtype="U8",
                     shape=(nbytes,))


def test_ranges_are_grouped_and_split_to_the_buffer():
    source = bytes(np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8))
    runtime = HostRuntime()
    copier = cuda_copy.SlotCopier(runtime, buffer_bytes=1000)
    out = np.zeros(6000, dtype=np.uint8)
    at = out.ctypes.data
    # 300 + 600 fit one buffer; 2500 is split in three; 10 after it
    pieces = [(ref(0, 300), at), (ref(1000, 600), at + 300), (ref(4000, 2500), at + 900),
              (ref(9000, 10), at + 3400)]
    copier.read(read_from(source), pieces)
    want = source[0:300] + source[1000:1600] + source[4000:6500] + source[9000:9010]
    assert out[:3410].tobytes() == want
    assert not out[3410:].any()
    assert max(n for _, n in runtime.copies) <= 1000


def test_a_failed_copy_is_an_expert_read_error():
    copier = cuda_copy.SlotCopier(HostRuntime(fail_copy=True), buffer_bytes=1000)
    out = np.zeros(100, dtype=np.uint8)
    with pytest.raises(ExpertIOError, match="cudaMemcpyAsync"):
        copier.read(read_from(bytes(100)), [(ref(0, 100), out.ctypes.data)])


class Managed(cuda_copy.SlotCopier):
    def manages(self, address):
        return True


@pytest.mark.parametrize("slots", [2, 5])
def test_banks_written_by_copies_give_stock_bits(q3, slots, monkeypatch):
    """Every direct read of a streaming model goes through the copier (small buffers: experts in
    pieces), and the logits are stock's."""
    runtime = HostRuntime()
    copier = Managed(runtime, buffer_bytes=50_000)
    monkeypatch.setattr(cuda_copy, "copier_for", lambda addresses: copier)
    path, tokens, want = q3
    model = with_slots(path, slots, tuning=CacheTuning(lookahead=False))
    cache = model.expert_streaming.cache
    cache.ensure_planned()
    assert all(b.copier is copier for b in cache.banks)
    assert same(want, decode(model, tokens))
    assert cache.stats.misses > 0
    assert sum(n for _, n in runtime.copies) >= cache.stats.misses * cache.banks[0].layer.expert_nbytes
    model.expert_streaming.close()


def test_device_copies_off_writes_through_the_views(q3, monkeypatch):
    monkeypatch.setattr(cuda_copy, "copier_for", lambda addresses: Managed(HostRuntime()))
    path, tokens, want = q3
    model = with_slots(path, 2, tuning=CacheTuning(lookahead=False, device_copies=False))
    cache = model.expert_streaming.cache
    cache.ensure_planned()
    assert all(b.copier is None and b.direct for b in cache.banks)
    assert same(want, decode(model, tokens))
    model.expert_streaming.close()


def test_no_copier_on_the_cpu_backend():
    import mlx.core as mx

    if mx.default_device().type == mx.gpu:
        pytest.skip("a GPU device: the check is the CPU backend's")
    assert cuda_copy.copier_for([1 << 20]) is None


def test_ids_read_by_the_copy_engine_are_the_arrays_bytes():
    # ``IdsReader`` (``CacheTuning.ids_by_copy``): an array's bytes copied by the runtime into
    # the thread's page-locked buffer, then to the host: its values, shape and dtype; arrays the
    # buffer cannot take, or not contiguous, read by numpy as before; a failed copy: an error
    import mlx.core as mx

    runtime = HostRuntime()
    read = cuda_copy.IdsReader(cuda_copy.SlotCopier(runtime, buffer_bytes=4096))
    for arr in (mx.arange(128, dtype=mx.uint32).reshape(16, 8), mx.array([3, 1, 2], mx.int32),
                mx.argpartition(mx.arange(64.0)[::-1].reshape(1, 1, 64), 7, axis=-1)[..., :8]):
        got = read(arr)
        want = np.array(arr)
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    assert len(runtime.copies) == 3
    big = mx.zeros((2048,), dtype=mx.uint32)  # (8 KB: over the buffer)
    assert np.array_equal(read(big), np.zeros(2048, dtype=np.uint32)) and len(runtime.copies) == 3
    failing = cuda_copy.IdsReader(cuda_copy.SlotCopier(HostRuntime(fail_copy=True)))
    with pytest.raises(ExpertIOError, match="ids"):
        failing(mx.arange(8, dtype=mx.uint32))


def test_a_check_whose_ids_are_read_by_a_reader_gives_stocks_tokens(q3):
    # the plumbing of ``CacheTuning.ids_by_copy`` on the CPU: a reader (here numpy's, counted) in
    # place of ``IdsReader``: every check's ids go through it, and decode is stock's, bit for bit.
    # A step found complete commits the rows its check read (a row per MoE layer): no second
    # read of the same ids (with the copy engine, a second copy); a step run again from the
    # layer that missed reads its kept ids once more, flat
    path, tokens, want = q3
    model = with_slots(path, 8, tuning=CacheTuning(verify_choice="always"))
    runner, reads = model.expert_streaming.steps, []

    def read(arr):
        reads.append(arr.shape)
        return np.array(arr)

    assert runner.read_ids is None  # (the CPU: off)
    runner.read_ids = read
    assert same(want, decode(model, tokens))
    layers = len(model.expert_streaming.cache.banks)
    checks = [shape for shape in reads if len(shape) == 2 and shape[0] == layers]
    assert runner.verified > 0 and len(checks) >= runner.verified
    # (a commit's read of its ids, flat: only after a step ran again from the layer that missed)
    again = [i for i, shape in enumerate(reads) if len(shape) == 1]
    assert again and all(0 < i and reads[i - 1][0] < layers for i in again), reads


def test_ids_by_copy_is_mlx_cudas_where_said_and_off_by_default(monkeypatch):
    from types import SimpleNamespace as NS

    from mlx_lm_streaming.runtime.decode import runner as runner_module

    monkeypatch.setattr(runner_module, "ids_reader", lambda: "reader")
    assert CacheTuning().ids_by_copy is False
    for backend, said, want in [("cuda", False, None), ("cuda", None, "reader"),
                                ("cuda", True, "reader"), ("cpu", True, None)]:  # fmt: skip
        state = NS(cache=NS(tuning=CacheTuning(ids_by_copy=said)), selector=NS(backend=backend))
        assert runner_module.StepRunner(state).read_ids == want, (backend, said)
