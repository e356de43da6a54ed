"""Reliability of the expert bytes: checkpoint changed on disk after load, and I/O faults in the store.

Every case ends in one of two ways: logits exactly equal to the stock model's, or an error naming the
shard file. Never different numbers.
"""

import dataclasses
import errno
import os
import random
import shutil

import mlx.core as mx
import numpy as np
import pytest
from support import load_stock, load_streaming

from mlx_lm_streaming.errors import CheckpointChangedError, ExpertIOError, StreamingError
from mlx_lm_streaming.option_table import GB
from mlx_lm_streaming.runtime.reads.index import CheckpointFiles
from mlx_lm_streaming.stores import safetensors as safetensors_store

STORES = [
    ("safetensors", {"threads": 1}),
    ("safetensors", {"threads": 4}),
    ("memory", {}),
]


def prompt(seed: int, length: int = 12, vocab: int = 512):
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(0, vocab, (1, length)))


def slots_budget_gb(path, slots: int) -> float:
    """A budget of ``slots`` experts per layer (fewer than a layer has: evictions and waves)."""
    model, _ = load_streaming(path)
    per_slot = sum(b.layer.expert_nbytes for b in model.expert_streaming.cache.banks)
    return (slots * per_slot + 0.5) / GB


@pytest.fixture(scope="module")
def reference(checkpoint):
    """(checkpoint path, stock logits for prompts 0..15, budget of 3 slots per layer)."""
    path = checkpoint("qwen3_moe", "affine4")
    stock, _ = load_stock(path)
    logits = [stock(prompt(i)) for i in range(16)]
    mx.eval(logits)
    return path, logits, slots_budget_gb(path, 3)


@pytest.fixture
def private_copy(reference, tmp_path):
    """A copy of the reference checkpoint that a test may damage."""
    path, logits, budget = reference
    copy = tmp_path / path.name
    shutil.copytree(path, copy)
    return copy, logits, budget


def expert_shards(model):
    """The shard files holding routed experts."""
    return sorted({f for bank in model.expert_streaming.cache.banks for f in bank.layer.files()})


# --- checkpoint changed on disk after load ------------------------------------------------------


def rewrite_in_place(path):
    """Same size, different bytes, same inode: flip every byte of the data section."""
    with open(path, "r+b") as f:
        head = f.read(8)
        start = 8 + int.from_bytes(head, "little")
        f.seek(start)
        data = f.read()
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))


def replace(path):
    """A new file renamed over the old name (new inode), as a re-download does."""
    tmp = path.with_name(path.name + ".new")
    shutil.copyfile(path, tmp)
    rewrite_in_place(tmp)
    os.replace(tmp, path)


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def delete(path):
    os.unlink(path)


CHANGES = {"rewritten in place": rewrite_in_place, "replaced": replace, "truncated": truncate,
           "deleted": delete}


@pytest.mark.parametrize("store,store_options", STORES)
@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("when", ["before first read", "after first read"])
def test_checkpoint_changed_after_load(private_copy, store, store_options, change, when):
    path, expected, budget = private_copy
    model, _ = load_streaming(path, expert_cache_gb=budget, store=store, store_options=store_options)
    shards = expert_shards(model)
    if when == "after first read":
        assert mx.array_equal(model(prompt(0)), expected[0]).item()
    for shard in shards:
        CHANGES[change](shard)
    if store == "memory" and when == "after first read":
        # the memory store holds a snapshot taken (and checked) at first use: the bytes it serves
        # are those the index was built from, so the answer stays right
        for i in range(1, 6):
            assert mx.array_equal(model(prompt(i)), expected[i]).item()
        return
    with pytest.raises(CheckpointChangedError) as info:
        for i in range(1, 6):
            # prompts that need experts not yet resident: every one reads the changed shard
            mx.eval(model(prompt(i)))
    assert any(str(shard) in str(info.value) for shard in shards), info.value
    assert "reload the model" in str(info.value) or "truncated" in str(info.value)


def test_changed_with_same_size_and_restored_mtime_is_caught_by_inode(private_copy):
    """A replacement that keeps size and mtime (cp -p, rsync -t) still has a new inode."""
    path, expected, budget = private_copy
    model, _ = load_streaming(path, expert_cache_gb=budget)
    for shard in expert_shards(model):
        st = os.stat(shard)
        replace(shard)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(shard).st_size == st.st_size
    with pytest.raises(CheckpointChangedError, match="changed on disk"):
        mx.eval(model(prompt(1)))


# --- I/O faults ---------------------------------------------------------------------------------


class FaultyOS:
    """``os`` for the store module, with ``preadv`` failing at random (seeded)."""

    def __init__(self, seed, short=0.0, eintr=0.0, eio=0.0):
        self.rng = random.Random(seed)
        self.short, self.eintr, self.eio = short, eintr, eio
        self.counts = {"short": 0, "eintr": 0, "eio": 0, "ok": 0}

    def __getattr__(self, name):
        return getattr(os, name)

    def preadv(self, fd, buffers, offset):
        r = self.rng.random()
        if r < self.eio:
            self.counts["eio"] += 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        r -= self.eio
        if r < self.eintr:
            self.counts["eintr"] += 1
            raise InterruptedError(errno.EINTR, os.strerror(errno.EINTR))
        r -= self.eintr
        total = sum(len(b) for b in buffers)
        if r < self.short and total > 1:
            self.counts["short"] += 1
            # cut anywhere, inside a buffer of a read that scatters into several too
            cut, buffers, kept = self.rng.randrange(1, total), list(buffers), []
            for buf in buffers:
                kept.append(buf[:cut])
                cut -= len(kept[-1])
                if cut == 0:
                    break
            buffers = kept
        else:
            self.counts["ok"] += 1
        return os.preadv(fd, buffers, offset)


def test_ranges_side_by_side_are_one_read_even_where_it_comes_short(reference, monkeypatch):
    # neighbouring experts of a stacked tensor asked for together (in any order): one read that
    # scatters into their buffers; a short read or EINTR part-way, inside a buffer or between two,
    # goes on where it stopped
    path, _, _ = reference
    files = CheckpointFiles(path)
    ref = next(r for name, r in files.tensors.items() if "switch_mlp.gate_proj.weight" in name)
    stride = ref.nbytes // ref.shape[0]
    refs = [
        dataclasses.replace(ref, offset=ref.offset + e * stride, nbytes=stride) for e in (9, 4, 3, 5)
    ]
    with open(ref.file, "rb") as f:
        want = [os.pread(f.fileno(), r.nbytes, r.offset) for r in refs]
    for faulty in (os, FaultyOS(seed=1, short=0.6, eintr=0.3)):
        monkeypatch.setattr(safetensors_store, "os", faulty)
        store = safetensors_store.SafetensorsStore(files, threads=1)
        bufs = [bytearray(stride) for _ in refs]
        store.read_many([(r, memoryview(b)) for r, b in zip(refs, bufs)])
        store.close()
        assert [bytes(b) for b in bufs] == want
        assert store.stats.reads == 2  # experts 3-5 in one read, 9 in its own
    assert faulty.counts["short"] > 0


@pytest.mark.parametrize("threads", [1, 4])
def test_short_reads_and_eintr_are_retried(reference, monkeypatch, threads):
    path, expected, budget = reference
    faulty = FaultyOS(seed=threads, short=0.4, eintr=0.3)
    monkeypatch.setattr(safetensors_store, "os", faulty)
    model, _ = load_streaming(path, expert_cache_gb=budget, store_options={"threads": threads})
    for i, want in enumerate(expected):
        assert mx.array_equal(model(prompt(i)), want).item(), f"prompt {i}"
    assert faulty.counts["short"] > 50 and faulty.counts["eintr"] > 50
    assert model.expert_streaming.cache.stats.evictions > 0


def test_endless_eintr_becomes_an_error(reference, monkeypatch):
    path, _, budget = reference
    monkeypatch.setattr(safetensors_store, "os", FaultyOS(seed=0, eintr=1.0))
    model, _ = load_streaming(path, expert_cache_gb=budget)
    with pytest.raises(ExpertIOError, match="interrupted") as info:
        mx.eval(model(prompt(0)))
    assert ".safetensors" in str(info.value) and "switch_mlp" in str(info.value)


def test_eio_names_file_and_tensor(reference, monkeypatch):
    path, _, budget = reference
    monkeypatch.setattr(safetensors_store, "os", FaultyOS(seed=0, eio=1.0))
    model, _ = load_streaming(path, expert_cache_gb=budget)
    with pytest.raises(ExpertIOError) as info:
        mx.eval(model(prompt(0)))
    msg = str(info.value)
    assert str(path) in msg and ".safetensors" in msg and "switch_mlp" in msg
    assert "Input/output error" in msg


@pytest.mark.parametrize("threads", [1, 4])
def test_random_faults_never_give_wrong_logits(reference, monkeypatch, threads):
    """EIO, EINTR and short reads at random: each forward pass gives the stock logits or raises an
    error naming a shard, and the model recovers (right logits) once the faults stop."""
    path, expected, budget = reference
    model, _ = load_streaming(path, expert_cache_gb=budget, store_options={"threads": threads})
    outcomes = {"exact": 0, "error": 0}
    for round_ in range(6):
        faulty = FaultyOS(seed=100 * threads + round_, short=0.2, eintr=0.2, eio=0.003)
        monkeypatch.setattr(safetensors_store, "os", faulty)
        for i, want in enumerate(expected):
            try:
                got = model(prompt(i))
                mx.eval(got)
            except StreamingError as e:
                assert isinstance(e, ExpertIOError) and ".safetensors" in str(e), e
                outcomes["error"] += 1
                continue
            assert mx.array_equal(got, want).item(), f"round {round_} prompt {i}: wrong logits"
            outcomes["exact"] += 1
        monkeypatch.setattr(safetensors_store, "os", os)
        # faults gone: every prompt right again, whatever state the failures left the banks in
        for i, want in enumerate(expected):
            assert mx.array_equal(model(prompt(i)), want).item(), f"after round {round_}: {i}"
    assert outcomes["exact"] > 0 and outcomes["error"] > 0, outcomes
