"""Background reads (lookahead, next wave, fill) and the no-sync path of complete banks stay exact.

Prefetching only moves reads off the critical path: logits must equal stock mlx-lm's bit for bit with
it on, with it off, when background reads fail, and once a bank holding every expert is complete and
the layer passes the router's indices straight to the kernel without a host sync.
"""

import gc
import threading
import time
import weakref

import mlx.core as mx
import numpy as np
import pytest
from support import GB, decode, load_streaming, per_slot, same, with_slots

from mlx_lm_streaming.errors import ExpertIOError
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from mlx_lm_streaming.runtime.reads.lookahead import find_router


@pytest.mark.parametrize("direct", [True, False])
def test_lookahead_is_exact_and_reads_ahead(q3, direct):
    path, tokens, want = q3
    probe, _ = load_streaming(path)
    budget = (4 * per_slot(probe) + 0.5) / GB
    tuning = CacheTuning(
        # room for a few staged experts (by default 5% of so small a budget holds none)
        staging_bytes=4 * probe.expert_streaming.cache.banks[0].layer.expert_nbytes,
        lookahead_min_precision=0.0,  # read every guess, good or not
    )
    model, _ = load_streaming(path, expert_cache_gb=budget, direct_reads=direct, tuning=tuning)
    cache = model.expert_streaming.cache
    assert cache.tuning.lookahead
    assert all(b.router is not None for b in cache.banks)
    assert same(want, decode(model, tokens))
    assert all(b.direct == direct for b in cache.banks)
    stats = cache.prefetch_stats
    assert stats.staged["lookahead"] > 0
    # waves read the next wave into staging; with direct reads, into the other half of the bank
    assert (stats.staged["wave"] > 0) == (not direct)
    assert stats.demand > 0
    s = cache.summary()
    assert 0 <= s["lookahead_precision"] <= 1 and 0 <= s["lookahead_recall"] <= 1
    assert cache.resident_bytes <= budget * GB
    model.expert_streaming.close()


def read_every_guess(path):
    """A model with 4 slots per layer that reads every lookahead guess, with room to stage them."""
    probe, _ = load_streaming(path)
    tuning = CacheTuning(staging_bytes=4 * per_slot(probe), lookahead_min_precision=0.0)
    return with_slots(path, 4, tuning=tuning)


def test_guesses_are_read_only_once_they_have_proven_good(q3):
    path, tokens, want = q3
    probe, _ = load_streaming(path)
    model = with_slots(path, 4, tuning=CacheTuning(staging_bytes=4 * per_slot(probe)))
    cache = model.expert_streaming.cache
    got = decode(model, tokens, steps=0)
    stats = cache.prefetch_stats
    # the prompt's guesses were scored (one call cannot lift a precision from 0 to 0.5), none read
    assert stats.predicted > 0
    assert stats.staged["lookahead"] == 0
    assert all(b.ahead_precision < cache.tuning.lookahead_min_precision for b in cache.banks)
    # the stats line scores them though nothing was read in the background
    assert cache.summary()["lookahead_precision"] >= 0
    for bank in cache.banks:
        bank.ahead_precision = 1.0  # as after good guesses
    got += decode(model, tokens)[1:]  # a fresh prompt, then the decode steps
    assert stats.staged["lookahead"] > 0
    assert same(want, got)


def test_staged_reads_are_exact(q3, monkeypatch):
    """Without direct reads: a call loads its experts through staging buffers, then computes in one
    kernel call, or in waves when it needs more experts than the bank has slots."""
    from mlx_lm_streaming.runtime.decode import schedules

    path, tokens, want = q3
    model = with_slots(path, 4, direct_reads=False)
    ran = []
    real = schedules.choose

    def choose(*args):
        schedule = real(*args)
        if isinstance(schedule, schedules.PerLayer):
            ran.append(type(schedule).__name__)
        return schedule

    monkeypatch.setattr(schedules, "choose", choose)
    assert same(want, decode(model, tokens, steps=10))
    assert {"OneCall", "Waves"} == set(ran)


def test_more_rows_than_slots_but_experts_that_fit_run_as_one_wave(q3, monkeypatch):
    """Without direct reads, ``choose`` picks ``Waves`` for a call with more rows than slots (it
    cannot know the call's distinct experts before the host sync); where they fit after all, the
    call is one wave, over all rows: stock's bits."""
    from mlx_lm_streaming.runtime.decode.schedules import Waves

    path, tokens, want = q3
    model = with_slots(path, 3, direct_reads=False)
    k = model.args.num_experts_per_tok
    assert tokens.shape[0] * k > 3  # a batch-2 decode call has more rows than slots
    waves = []  # (distinct experts, slots) of each Waves call
    real = Waves.compute

    def compute(self, idx, experts, ahead):
        waves.append((len(experts), self.bank.slots))
        return real(self, idx, experts, ahead)

    monkeypatch.setattr(Waves, "compute", compute)
    assert same(want, decode(model, tokens, steps=10))
    assert any(n <= slots for n, slots in waves), waves  # one wave
    assert any(n > slots for n, slots in waves), waves  # several
    model.expert_streaming.close()


def test_lookahead_off_is_exact(q3):
    path, tokens, want = q3
    model = with_slots(path, 4, tuning=CacheTuning(lookahead=False))
    cache = model.expert_streaming.cache
    assert same(want, decode(model, tokens))
    assert cache.prefetch_stats.staged["lookahead"] == 0


def test_a_fill_whose_staged_reads_were_dropped_runs_again(q3):
    """A call that cannot install staged reads drops them (``discard_staged``: a Direct schedule's
    later wave, layer-major prefill); an identity bank's fill then runs again, so the bank still
    completes. (Before, the fill stayed marked as asked for: the dropped experts were read only
    if a call used them, and a bank whose calls did not use all never completed, so its calls
    never skipped the host sync. Seen as a flaky test_complete_banks_skip_the_host_sync.)"""
    from mlx_lm_streaming.runtime.reads.prefetch import FILL

    path, tokens, want = q3
    model, _ = load_streaming(path)  # default budget: every expert here
    cache = model.expert_streaming.cache
    cache.ensure_planned()
    bank = cache.banks[0]
    assert bank.identity and not bank.complete
    bank.fill_requested = True  # as if the fill had run: its reads staged...
    assert bank.stage(np.arange(bank.num_experts), "fill", FILL) == bank.num_experts
    with bank.lock:
        bank.discard_staged()  # ...then dropped by a call that could not install them
    assert not bank.staged and not bank.fill_requested
    assert same(want, decode(model, tokens))
    deadline = time.time() + 60
    while not bank.complete and time.time() < deadline:
        decode(model, tokens[:, :2], steps=0)  # the same few experts: a fill must read the rest
        time.sleep(0.01)
    assert bank.complete
    model.expert_streaming.close()


def test_complete_banks_skip_the_host_sync(q3):
    path, tokens, want = q3
    model, _ = load_streaming(path)  # default budget: every expert here
    cache = model.expert_streaming.cache
    assert same(want, decode(model, tokens))
    deadline = time.time() + 90  # (the fill's threads: slow where other suites share the CPU)
    while not all(b.complete for b in cache.banks) and time.time() < deadline:
        decode(model, tokens[:, :2], steps=0)  # loads install what the fill staged
        time.sleep(0.01)
    assert all(b.complete and b.identity for b in cache.banks)
    assert model.expert_streaming.stats()["evictions"] == 0  # (the last verified step's work done)
    loads = []
    for bank in cache.banks:
        bank.load = lambda experts, bank=bank: loads.append(bank.path)
    real = np.array
    syncs = []

    def counting_array(obj, *a, **k):
        if isinstance(obj, mx.array):
            syncs.append(obj.shape)
        return real(obj, *a, **k)

    np.array = counting_array
    try:
        got = decode(model, tokens)
    finally:
        np.array = real
        for bank in cache.banks:
            del bank.load
    assert not loads and not syncs
    assert same(want, got)


def test_failed_background_reads_fall_back_to_demand_reads(q3):
    path, tokens, want = q3
    model = read_every_guess(path)
    store = model.expert_streaming.store
    real = store.read_many
    main = threading.main_thread()

    def flaky(jobs):
        if threading.current_thread().name.startswith("mlx-lm-streaming-prefetch"):
            raise OSError("injected background read failure")
        return real(jobs)

    store.read_many = flaky
    assert same(want, decode(model, tokens))
    assert threading.current_thread() is main
    assert model.expert_streaming.cache.prefetch_stats.staged["lookahead"] > 0
    # counted, not dropped without a trace
    stats = model.expert_streaming.stats()
    assert stats["failed_background_reads"] > 0
    assert stats["first_background_error"] == "OSError: injected background read failure"
    line = model.expert_streaming.stats_line()
    assert f"background reads of {stats['failed_background_reads']} experts failed" in line
    assert "first: OSError: injected background read failure" in line


def test_demand_read_failing_after_a_background_read_names_both(q3):
    path, tokens, _ = q3
    model = read_every_guess(path)
    store = model.expert_streaming.store
    real = store.read_many
    failed = set()  # (file, offset) of every range a background read failed on

    def flaky(jobs):
        keys = {(ref.file, ref.offset) for ref, _ in jobs}
        if threading.current_thread().name.startswith("mlx-lm-streaming-prefetch"):
            failed.update(keys)
            raise OSError("injected background read failure")
        if keys & failed:
            raise ExpertIOError("injected demand read failure")
        return real(jobs)

    store.read_many = flaky
    with pytest.raises(ExpertIOError) as info:
        decode(model, tokens)
    msg = str(info.value)
    assert msg.startswith("injected demand read failure (the background read of expert ")
    assert msg.endswith("had failed first: OSError: injected background read failure)")
    assert model.expert_streaming.stats()["failed_background_reads"] > 0
    # and the model is freed once dropped (its threads end, its files close): asking a failed
    # background read again must not pile the asking frames, which hold the model, onto the stored
    # error's traceback (it kept every such model alive, its idle threads ending 30 s later in
    # some other test)
    gone = weakref.ref(model)
    del model, store, real, flaky, info
    gc.collect()
    assert gone() is None


def test_staged_bytes_stay_within_the_bound(q3):
    path, tokens, want = q3
    probe, _ = load_streaming(path)
    one = max(b.layer.expert_nbytes for b in probe.expert_streaming.cache.banks)
    # every guess is read: the bound is what stops them
    tuning = CacheTuning(staging_bytes=3 * one, lookahead_min_precision=0.0)
    model = with_slots(path, 4, tuning=tuning)
    cache = model.expert_streaming.cache
    prefetcher = cache.prefetcher
    assert prefetcher.max_bytes == 3 * one
    seen = []
    real = prefetcher.reserve

    def reserve(nbytes, block):
        ok = real(nbytes, block)
        seen.append(prefetcher.staged_bytes)
        return ok

    prefetcher.reserve = reserve
    assert same(want, decode(model, tokens))
    assert seen and max(seen) <= 3 * one


def test_close_stops_background_threads(q3):
    path, tokens, _ = q3
    before = {t.ident for t in threading.enumerate()}
    model, _ = load_streaming(path)
    decode(model, tokens)
    model.expert_streaming.close()
    left = [
        t.name
        for t in threading.enumerate()
        if t.ident not in before and t.name.startswith("mlx-lm-streaming")
    ]
    assert not left


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"])
def test_routers_are_found(checkpoint, arch):
    model, _ = load_streaming(checkpoint(arch, "affine4"))
    banks = model.expert_streaming.cache.banks
    assert banks and all(b.router is not None for b in banks)
    x = mx.zeros((1, 2, model.args.hidden_size))
    for b in banks:
        assert b.router(x).shape[-1] == b.num_experts


def test_find_router_ignores_modules_without_one():
    import mlx.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 5)

    assert find_router(Block(), 4) is None
    assert find_router(None, 4) is None


def test_a_staging_buffer_is_zeroed_mlx_memory_that_its_view_writes():
    # ``host_views.staging_buffer``: an MLX array made from host memory (no evaluation on the
    # stream the model's work is queued on) and a numpy view of that array's own memory
    from mlx_lm_streaming.runtime.reads.host_views import staging_buffer

    arr, view = staging_buffer(3, 64)
    assert arr is not None and arr.dtype == mx.uint8 and view.shape == (3, 64) and not view.any()
    view[1, 5] = 7
    assert arr[1, 5].item() == 7 and int(arr.sum().item()) == 7
