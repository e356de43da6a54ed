"""Reads past the page cache (stores/uncached.py): a range the page cache holds all of read from
it, any other with O_DIRECT; every byte the file's, the logits stock's, and a file or filesystem
refusing O_DIRECT read buffered."""

import errno
import os

import mlx.core as mx
import numpy as np
import pytest
from support import load_stock, with_slots

from mlx_lm_streaming.errors import ConfigurationError
from mlx_lm_streaming.stores import safetensors as safetensors_store
from mlx_lm_streaming.stores import uncached

pytestmark = pytest.mark.skipif(not uncached.AVAILABLE, reason="no O_DIRECT here")


def drop_cached(path) -> None:
    """``path``'s pages out of the page cache (written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def random_file(path, size: int, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    drop_cached(path)
    return data


def read(reads, path, offset: int, sizes):
    """``bank_reads.read`` of ``sum(sizes)`` bytes at ``offset`` into buffers of ``sizes``: (the bytes,
    how many it read with O_DIRECT)."""
    bufs = [bytearray(n) for n in sizes]
    fd = os.open(path, os.O_RDONLY)
    try:
        direct = reads.read(fd, path, [memoryview(b) for b in bufs], offset, sum(sizes))
    finally:
        os.close(fd)
    return b"".join(bufs), direct


def no_check(path, stat):
    pass


def refuse_o_direct(monkeypatch) -> None:
    """``open`` with O_DIRECT fails with EINVAL, as on a filesystem without it."""
    real_open = os.open

    def refusing_open(p, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args)

    monkeypatch.setattr(uncached.os, "open", refusing_open)


# unaligned starts and lengths, several buffers, a range longer than the bounce buffer, the end
CASES = [(0, [4096]), (1, [5000, 3, 70001]), (12345, [1 << 20]), (3 << 20, [123, 456])]


@pytest.mark.parametrize("offset,sizes", CASES)
def test_cold_bytes_read_with_o_direct_are_the_files(tmp_path, monkeypatch, offset, sizes):
    monkeypatch.setattr(uncached, "BOUNCE", 64 << 10)  # several bounces a range
    path = tmp_path / "data.bin"
    size = offset + sum(sizes) if offset == 3 << 20 else 4 << 20  # the last case ends the file
    data = random_file(path, size)
    reads = uncached.UncachedReads(no_check)
    try:
        got, direct = read(reads, path, offset, sizes)
        assert got == data[offset : offset + sum(sizes)]
        assert direct == sum(sizes)  # cold: all of it past the page cache
        # and it stayed out of the page cache: cold again, read with O_DIRECT again
        assert read(reads, path, offset, sizes)[1] == sum(sizes)
        # warm: the caller reads it buffered
        with open(path, "rb") as f:
            f.read()
        assert read(reads, path, offset, sizes)[1] == 0
        # one page of the range not cached: all of it read with O_DIRECT
        fd = os.open(path, os.O_RDONLY)
        last_page = (offset + sum(sizes) - 1) // 4096 * 4096
        os.posix_fadvise(fd, last_page, 4096, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        got, direct = read(reads, path, offset, sizes)
        assert got == data[offset : offset + sum(sizes)] and direct == sum(sizes)
    finally:
        reads.close()


def test_a_refused_o_direct_leaves_the_rest_to_the_buffered_read(tmp_path, monkeypatch):
    path = tmp_path / "data.bin"
    data = random_file(path, 1 << 20)
    refuse_o_direct(monkeypatch)
    reads = uncached.UncachedReads(no_check)
    assert read(reads, path, 100, [1000])[1] == 0  # O_DIRECT refused: all left to the caller
    assert reads._files[path] is None  # asked once


def test_tmpfs_reads_the_files_bytes(monkeypatch):
    """A file in /dev/shm (tmpfs: O_DIRECT refused on older kernels, taken on newer ones): the
    file's bytes either way, through the store's own reads."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    from pathlib import Path

    path = Path("/dev/shm") / f"mlx-lm-streaming-test-{os.getpid()}.bin"
    try:
        data = random_file(path, 1 << 20)
        reads = uncached.UncachedReads(no_check)
        try:
            got, direct = read(reads, path, 777, [300000])
        finally:
            reads.close()
        if direct < 300000:  # refused, or tmpfs always cached: the rest the caller's
            fd = os.open(path, os.O_RDONLY)
            rest = os.pread(fd, 300000 - direct, 777 + direct)
            os.close(fd)
            got = got[:direct] + rest
        assert got == data[777 : 777 + 300000]
    finally:
        path.unlink(missing_ok=True)


def test_the_store_reads_the_checkpoints_bytes_every_way(checkpoint, monkeypatch):
    """The safetensors store's reads, direct (cold and warm), buffered, and direct where the
    filesystem refuses O_DIRECT: the same bytes."""
    path = checkpoint("qwen3_moe", "affine4")
    model = with_slots(path, 2)
    banks = model.expert_streaming.cache.banks
    files = model.expert_streaming.store.files
    refs = [ref for bank in banks[:2] for e in (0, 3, 5) for ref in bank.layer.refs(e)]

    def read_all(**options):
        store = safetensors_store.SafetensorsStore(files, threads=2, **options)
        try:
            for f in {r.file for r in refs}:
                drop_cached(f)
            bufs = [bytearray(r.nbytes) for r in refs]
            store.read_many(list(zip(refs, [memoryview(b) for b in bufs])))
            return bufs, store.stats.uncached_bytes
        finally:
            store.close()

    buffered, none = read_all(direct=False)
    assert none == 0
    direct, cold = read_all(direct=True)
    assert direct == buffered and cold == sum(r.nbytes for r in refs)
    refuse_o_direct(monkeypatch)
    refused, none = read_all(direct=True)
    assert refused == buffered and none == 0


def test_direct_option_is_checked():
    assert safetensors_store.direct_option("off") is False
    with pytest.raises(ConfigurationError, match="direct='maybe'"):
        safetensors_store.direct_option("maybe")


def test_logits_are_stocks_with_reads_past_the_page_cache(checkpoint):
    """Decode with 2 slots a layer (misses every step), the shards dropped from the page cache
    before every step: the same logits as stock, bit for bit, direct and buffered; the direct
    model read past the page cache."""
    path = checkpoint("qwen3_moe", "affine4")
    stock, _ = load_stock(path)
    tokens = mx.array([[5, 77, 301, 12, 9, 400]])
    want = [stock(tokens[:, : i + 1]) for i in range(tokens.shape[1])]
    mx.eval(want)
    for direct in (True, False):
        model = with_slots(path, 2, store_options={"direct": direct})
        state = model.expert_streaming
        shards = {f for bank in state.cache.banks for f in bank.layer.files()}
        for i in range(tokens.shape[1]):
            for f in shards:
                drop_cached(f)
            got = model(tokens[:, : i + 1])
            assert mx.array_equal(got, want[i]).item(), (direct, i)
        uncached_bytes = state.store.stats.uncached_bytes
        assert (uncached_bytes > 0) == direct, (direct, uncached_bytes)


def test_the_stats_line_says_bytes_read_against_those_the_misses_need(checkpoint):
    """Cold decode with 2 slots a layer: the stats line gives the bytes read over the missed
    experts' bytes and the share of the reads past the page cache, from the counters."""
    from mlx_lm_streaming.runtime.memory.report import stats_line

    path = checkpoint("qwen3_moe", "affine4")
    model = with_slots(path, 2, store_options={"direct": True})
    state = model.expert_streaming
    shards = {f for bank in state.cache.banks for f in bank.layer.files()}
    for token in (3, 9, 27, 81):
        for f in shards:
            drop_cached(f)
        mx.eval(model(mx.array([[token]])))
    s = state.stats()
    missed = sum(b["misses"] for b in s["per_layer"])
    nbytes = state.cache.banks[0].layer.expert_nbytes
    assert s["gb_needed"] * 1e9 == pytest.approx(missed * nbytes) and missed > 0
    assert s["gb_read"] >= s["gb_needed"] and s["gb_uncached"] > 0, s
    line = stats_line(state)
    assert f", {s['gb_read'] / s['gb_needed']:.2f}x the bytes the misses need, " in line, line
    assert f", {s['gb_uncached'] / s['gb_read']:.0%} of the reads past the page cache" in line
    state.close()
    # the default store reads buffered (direct is off by default): no share said
    model = with_slots(path, 2)
    assert model.expert_streaming.store.uncached is None
    mx.eval(model(mx.array([[3]])))
    line = stats_line(model.expert_streaming)
    assert "the bytes the misses need" in line and "past the page cache" not in line, line


def test_after_close_nothing_is_opened_again(tmp_path):
    """A read racing the store's close opens no descriptor that close would not see."""
    path = tmp_path / "data.bin"
    random_file(path, 1 << 16)
    reads = uncached.UncachedReads(no_check)
    assert read(reads, path, 0, [4096])[1] == 4096
    reads.close()
    assert read(reads, path, 0, [4096])[1] == 0 and reads._files == {}
