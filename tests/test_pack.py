"""``mlx_lm_streaming pack`` and the ``packed`` store: exact round trip, one read per expert, and bad or
partial packs rejected with a named error."""

import os
import struct
import threading
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from support import load_stock, load_streaming

from mlx_lm_streaming.__main__ import main as cli
from mlx_lm_streaming.errors import CheckpointError, ConfigurationError, ExpertIOError
from mlx_lm_streaming.files.packfile import ALIGN, PACK_NAME, PREFIX
from mlx_lm_streaming.option_table import GB
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from mlx_lm_streaming.stores import packed as packed_mod
from mlx_lm_streaming.stores.packed import PackedStore
from mlx_lm_streaming.tools.pack import index_checkpoint, pack_checkpoint
from synthetic import build_checkpoint


def run(model, steps=4):
    tokens = mx.array([[(7 * i + 3) % 512 for i in range(10)]])
    cache = make_prompt_cache(model)
    out = [model(tokens, cache=cache)]
    for i in range(steps):
        out.append(model(mx.array([[(13 * i + 5) % 512]]), cache=cache))
    mx.eval(out)
    return out


def same(a, b):
    return all(mx.array_equal(x, y).item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    path = build_checkpoint(
        tmp_path_factory.mktemp("pack") / "q3", "qwen3_moe", "affine4", overrides={"experts": 8}
    )
    assert cli(["pack", str(path), "--quiet"]) == 0
    stock, _ = load_stock(path)
    return path, run(stock)


def small_budget(path):
    probe, _ = load_streaming(path)
    per_slot = sum(b.layer.expert_nbytes for b in probe.expert_streaming.cache.banks)
    probe.expert_streaming.close()
    return (3 * per_slot + 0.5) / GB


@pytest.mark.parametrize("options", [{}, {"verify": "always"}, {"direct": True}, {"threads": 1}])
def test_packed_store_is_exact(packed, options):
    path, want = packed
    if options.get("direct") and not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here")
    model, _ = load_streaming(
        path, expert_cache_gb=small_budget(path), store="packed", store_options=options
    )
    store = model.expert_streaming.store
    assert store.name == "packed"
    assert same(want, run(model))
    cache = model.expert_streaming.cache
    assert cache.stats.misses > 0 and cache.stats.evictions > 0
    assert store.pack.verified.count(1) > 0
    model.expert_streaming.close()


@pytest.mark.parametrize("wait", [True, False])
def test_packed_store_closes_after_threaded_reads(packed, wait):
    """Staged demand reads batch several experts, so the store's reader pool runs; closing it then
    (``wait=False``: as a garbage-collection finalizer does) stops the pool without error."""
    path, want = packed
    model, _ = load_streaming(
        path,
        expert_cache_gb=small_budget(path),
        store="packed",
        store_options={"threads": 4},
        direct_reads=False,
    )
    store = model.expert_streaming.store
    assert same(want, run(model))
    assert store._pool is not None
    store.close(wait=wait)
    assert store._pool is None and store.pack.fd is None
    store.close()  # a second close is a no-op


def expert_jobs(path, experts):
    """A packed store of ``path`` and read jobs for ``experts`` of its first layer."""
    index = index_checkpoint(path)
    layer = index.layers[sorted(index.layers)[0]]
    jobs = [
        (ref, memoryview(bytearray(ref.nbytes))) for e in experts for ref in layer.refs(e)
    ]
    return PackedStore(index.files, threads=4), jobs


@pytest.mark.parametrize("experts", [[0], [0, 1, 2]])
def test_read_racing_close_raises_our_error(packed, experts):
    """``close`` between a read's check and its reads: ExpertIOError, not AttributeError (the pool
    was read outside the lock) or TypeError (the pack's descriptor)."""
    path, _ = packed
    store, jobs = expert_jobs(path, experts)
    store.read_many(jobs)  # the pool exists (several experts) or not (one)
    real = store._check
    store._check = lambda: (real(), store.close())
    with pytest.raises(ExpertIOError, match="is closed"):
        store.read_many(jobs)


def test_one_fallback_store_for_concurrent_reads(packed, monkeypatch):
    """Ranges the pack does not hold are read through one SafetensorsStore, however many threads ask
    at once (a second copy, made outside the lock, leaked its descriptors)."""
    path, _ = packed
    store, _ = expert_jobs(path, [])
    made = []

    class Slow(packed_mod.SafetensorsStore):
        def __init__(self, *args, **kwargs):
            made.append(self)
            time.sleep(0.05)  # widens the window in which a second thread finds no fallback
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(packed_mod, "SafetensorsStore", Slow)
    ref = store.files.tensors["model.embed_tokens.weight"]
    errors = []

    def read():
        try:
            store.read_many([(ref, memoryview(bytearray(ref.nbytes)))])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(made) == 1
    store.close()
    assert made[0]._closed


def test_one_read_per_expert(packed):
    path, _ = packed
    # no lookahead: wrong guesses would be reads too
    model, _ = load_streaming(
        path, expert_cache_gb=small_budget(path), store="packed", tuning=CacheTuning(lookahead=False)
    )
    store = model.expert_streaming.store
    calls = []
    real = os.preadv

    def counting(fd, bufs, offset, *a):
        if fd == store.pack.fd:
            calls.append((offset, len(bufs)))
        return real(fd, bufs, offset, *a)

    os.preadv = counting
    try:
        run(model)
    finally:
        os.preadv = real
    misses = model.expert_streaming.cache.stats.misses
    assert calls and len(calls) == misses
    assert all(off % ALIGN == 0 for off, _ in calls)
    parts = len(model.expert_streaming.cache.banks[0].layer.parts)
    assert all(n == parts for _, n in calls)
    model.expert_streaming.close()


def test_pack_is_kept_when_valid_and_rewritten_with_force(packed):
    path, _ = packed
    pack = path / PACK_NAME
    before = pack.stat().st_mtime_ns
    pack_checkpoint(path, progress=False)
    assert pack.stat().st_mtime_ns == before
    pack_checkpoint(path, progress=False, force=True)
    assert pack.stat().st_mtime_ns != before
    assert not list(path.glob(PACK_NAME + ".tmp-*"))


def corrupt_copy(path, tmp_path, damage):
    """A copy of the checkpoint whose pack ``damage(bytearray)`` edits."""
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in path.iterdir():
        if f.is_file():
            os.link(f, dst / f.name) if f.name != PACK_NAME else None
    data = bytearray((path / PACK_NAME).read_bytes())
    damage(data)
    (dst / PACK_NAME).write_bytes(bytes(data))
    return dst


def test_bad_existing_pack_is_named_then_rewritten(packed, tmp_path, capsys):
    """``pack`` without ``--force`` over a damaged pack wrote a new one without a word. A file
    without the pack's magic is not a pack at all: refused, untouched (issue 21)."""
    path, want = packed
    dst = corrupt_copy(path, tmp_path, lambda d: d.__setitem__(slice(0, 8), b"NOTAPACK"))
    before = (dst / PACK_NAME).read_bytes()
    with pytest.raises(ConfigurationError, match="is not an expert pack .by its first bytes"):
        pack_checkpoint(dst, progress=False)
    assert (dst / PACK_NAME).read_bytes() == before
    (tmp_path / "2").mkdir()
    dst = corrupt_copy(path, tmp_path / "2", lambda d: d.__setitem__(60, d[60] ^ 1))
    capsys.readouterr()
    pack_checkpoint(dst, progress=False)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"{dst / PACK_NAME}: header checksum mismatch (damaged); writing a new pack"]
    model, _ = load_streaming(dst, store="packed")
    assert same(want, run(model))
    model.expert_streaming.close()


def flip_data_byte(data):
    (hlen,) = struct.unpack("<Q", bytes(data[8:16]))
    start = -(-(PREFIX + hlen) // ALIGN) * ALIGN
    data[start + 100] ^= 0xFF


CASES = {
    "truncated": (lambda d: d.__delitem__(slice(len(d) - ALIGN, None)), "partial"),
    "bad magic": (lambda d: d.__setitem__(slice(0, 8), b"NOTAPACK"), "bad magic"),
    "header edited": (lambda d: d.__setitem__(60, d[60] ^ 1), "checksum"),
    "extra bytes": (lambda d: d.extend(b"\0" * ALIGN), "partial"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_packs_are_rejected_at_load(packed, tmp_path, case):
    path, _ = packed
    damage, message = CASES[case]
    bad = corrupt_copy(path, tmp_path, damage)
    with pytest.raises(CheckpointError, match=message):
        load_streaming(bad, store="packed")


def test_damaged_expert_fails_its_checksum(packed, tmp_path):
    path, _ = packed
    bad = corrupt_copy(path, tmp_path, flip_data_byte)
    model, _ = load_streaming(bad, store="packed")
    with pytest.raises(CheckpointError, match="checksum"):
        run(model)
    model.expert_streaming.close()


def test_changed_source_shard_is_rejected(packed, tmp_path):
    path, _ = packed
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in path.iterdir():
        if f.is_file():
            os.link(f, dst / f.name)
    shard = sorted(dst.glob("model*.safetensors"))[0]
    st = shard.stat()
    try:
        # rewritten in place: same size and header, new mtime; the pack (a link to the one made
        # in ``path``) names where it was made (issue 21: it said "changed" for another model)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with pytest.raises(CheckpointError, match=f"made from the checkpoint at {path.resolve()}"):
            load_streaming(dst, store="packed")
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_missing_pack_names_the_fix(tmp_path, packed):
    path, _ = packed
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in path.iterdir():
        if f.is_file() and f.name != PACK_NAME:
            os.link(f, dst / f.name)
    with pytest.raises(CheckpointError, match="mlx_lm_streaming pack"):
        load_streaming(dst, store="packed")


def test_interrupted_pack_leaves_no_pack(packed, tmp_path, monkeypatch):
    path, _ = packed
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in path.iterdir():
        if f.is_file() and f.name != PACK_NAME:
            os.link(f, dst / f.name)
    import mlx_lm_streaming.files.packfile as pack_mod

    real = pack_mod.zlib.crc32
    calls = []

    def failing(*a):
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(pack_mod.zlib, "crc32", failing)
    with pytest.raises(KeyboardInterrupt):
        pack_checkpoint(dst, progress=False)
    assert not (dst / PACK_NAME).exists()
    assert not list(dst.glob(PACK_NAME + ".tmp-*"))
