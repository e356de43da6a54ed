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
