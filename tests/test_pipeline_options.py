"""The I/O pipeline's tuning options (issue 14): ranges read in pieces (store option ``chunk_bytes``),
one compute call per layer once the reads landed (``CacheTuning.landings``) and lookahead guesses
from the co-activation of experts in consecutive layers (``CacheTuning.coactivation``). Each only
moves work: logits equal stock's bit for bit, and each option does what it says.
"""

from concurrent.futures import Future

import mlx.core as mx
import numpy as np
import pytest
from support import decode, load_stock, same, with_slots

from mlx_lm_streaming import bank_io
from mlx_lm_streaming import switch as switch_mod
from mlx_lm_streaming.errors import ConfigurationError
from mlx_lm_streaming.expert_cache import CacheTuning
from mlx_lm_streaming.mlx_compat import SORT_THRESHOLD
from mlx_lm_streaming.stores.safetensors import SafetensorsStore


def test_ranges_read_in_pieces_are_exact_and_are_pieces(q3, monkeypatch):
    path, tokens, want = q3
    model = with_slots(path, 3, store_options={"chunk_bytes": 512})
    store = model.expert_streaming.cache.store
    assert isinstance(store, SafetensorsStore) and store.chunk_bytes == 512
    pieces = []
    real = SafetensorsStore._read

    def read(self, ref, out, start=0, end=-1):
        pieces.append((ref.nbytes, start, end))
        return real(self, ref, out, start, end)

    monkeypatch.setattr(SafetensorsStore, "_read", read)
    assert same(want, decode(model, tokens))
    # a range longer than a piece was read as several, none longer than a piece
    assert any(n > 512 for n, _, _ in pieces)
    assert all(end - start <= 512 for _, start, end in pieces)
    assert any(start > 0 for _, start, _ in pieces)
    model.expert_streaming.close()


@pytest.mark.parametrize("bad", [100, -1, "big", 511])
def test_a_bad_piece_size_is_named(q3, bad):
    path, _, _ = q3
    with pytest.raises(ConfigurationError, match="chunk_bytes"):
        with_slots(path, 3, store_options={"chunk_bytes": bad})


@pytest.mark.parametrize("landings", ["once", "each"])
def test_one_call_per_layer_or_one_per_landing_is_exact(q3, landings, monkeypatch):
    path, tokens, want = q3
    model = with_slots(path, 4, tuning=CacheTuning(lookahead=False, landings=landings))
    reported = []
    real_direct = bank_io.read_direct

    def read_direct(bank, pairs, resident, *args):
        return real_direct(
            bank, pairs, lambda ids: (reported.append(len(ids)), resident(ids)), *args
        )

    monkeypatch.setattr(bank_io, "read_direct", read_direct)
    calls = []  # (rows of the call, rows computed at once)

    real_rows = switch_mod.StreamingSwitchGLU._rows

    def rows(self, x, idx, which):
        calls.append((idx.size, len(which)))
        return real_rows(self, x, idx, which)

    monkeypatch.setattr(switch_mod.StreamingSwitchGLU, "_rows", rows)
    assert same(want, decode(model, tokens))
    assert reported
    # calls of at most 4 rows use at most the 4 slots: one wave (more go in waves, a call each)
    decode_calls = [c for c in calls if c[0] <= 4]
    if landings == "once":
        # every such call computes all its rows at once
        assert decode_calls and all(n == size for size, n in decode_calls)
    else:
        assert any(n < size for size, n in decode_calls)
    model.expert_streaming.close()


def test_the_defaults_and_landings_checked():
    # off by default: neither was a measured gain (docs/benchmarks/gpu-pipeline.md)
    assert CacheTuning().landings == "each" and CacheTuning().coactivation is False
    with pytest.raises(ConfigurationError, match="landings"):
        CacheTuning(landings="sometimes")


def test_coactivation_lookahead_is_exact_and_learns_the_routing(q3, monkeypatch):
    path, tokens, want = q3
    tuning = CacheTuning(
        coactivation=True, coactivation_min_precision=0.0, coactivation_min_score=0.0
    )
    model = with_slots(path, 4, tuning=tuning)
    cache = model.expert_streaming.cache
    staged = []
    real_stage = switch_mod._stage_ahead

    def stage(bank, guess):
        staged.append((bank.path, np.asarray(guess).tolist()))
        return real_stage(bank, guess)

    monkeypatch.setattr(switch_mod, "_stage_ahead", stage)
    assert same(want, decode(model, tokens))
    pred = cache.coactivation
    assert pred is not None and pred.num_layers == len(cache.banks)
    # it learnt from the calls (pairs of consecutive layers counted) and its guesses were staged
    assert pred.pairs[0].sum() > 0
    assert staged and all(guess for _, guess in staged)
    # never a guess for the first layer (nothing comes before it)
    assert cache.banks[0].path not in {p for p, _ in staged}
    assert cache.prefetch_stats.predicted > 0
    model.expert_streaming.close()


def test_demand_threads_reading_their_own_ranges_is_exact(q3, monkeypatch):
    path, tokens, want = q3
    model = with_slots(path, 3, tuning=CacheTuning(ranges_in_parallel=False))
    store = model.expert_streaming.cache.store
    calls = {"serial": 0, "many": 0}
    real_serial, real_many = store.read_serial, store.read_many

    def serial(jobs):
        calls["serial"] += 1
        return real_serial(jobs)

    def many(jobs):
        calls["many"] += 1
        return real_many(jobs)

    monkeypatch.setattr(store, "read_serial", serial)
    monkeypatch.setattr(store, "read_many", many)
    pools = []
    real_pool = SafetensorsStore._reader_pool
    monkeypatch.setattr(SafetensorsStore, "_reader_pool", lambda s: pools.append(1) or real_pool(s))
    assert same(want, decode(model, tokens))
    # every demand read went through read_serial, and none of them used the reader pool
    assert calls["serial"] > 0
    assert not pools or calls["many"] > 0  # only background reads (read_many) may use it
    model.expert_streaming.close()


@pytest.mark.parametrize("landings", ["each", "once"])
def test_cpu_prefill_computes_read_experts_as_they_land(q3, landings, monkeypatch):
    # a call per wave on the CPU kept +5 points of peak RSS over the budget (docs/design.md): there,
    # prefill-sized calls compute each read expert as it lands unless landings="once"
    path, _, _ = q3
    tokens = mx.array([[(7 * i + 1) % 512 for i in range(40)]])
    stock, _ = load_stock(path)
    want = stock(tokens)
    model = with_slots(path, 4, tuning=CacheTuning(lookahead=False, landings=landings))
    experts_per_call = []  # (rows of the layer call, experts one kernel call computed)
    real_rows = switch_mod.StreamingSwitchGLU._rows

    def rows(self, x, idx, which):
        experts_per_call.append((idx.size, len(np.unique(idx.reshape(-1)[which]))))
        return real_rows(self, x, idx, which)

    monkeypatch.setattr(switch_mod.StreamingSwitchGLU, "_rows", rows)
    assert same([want], [model(tokens)])
    prefill = [n for size, n in experts_per_call if size >= SORT_THRESHOLD]
    assert prefill
    if landings == "each":
        assert all(n == 1 for n in prefill)  # the banks start empty: every call is one read expert
    else:
        assert max(prefill) > 1
    model.expert_streaming.close()


@pytest.mark.parametrize("early,depth", [(False, 1), (True, 1), (True, 2), (False, 3)])
def test_router_lookahead_early_and_deeper_is_exact(q3, early, depth, monkeypatch):
    # lookahead_early: decode-sized calls stage the router's guesses right after the host sync,
    # before the layer's own reads; lookahead_depth: guesses for that many layers ahead
    path, tokens, want = q3
    tuning = CacheTuning(
        lookahead_early=early,
        lookahead_depth=depth,
        lookahead_min_precision=0.0,
        staging_bytes=1 << 24,  # room for every guess (the default is a share of the budget)
    )
    model = with_slots(path, 4, tuning=tuning)
    cache = model.expert_streaming.cache
    events = []  # ("stage", layer guessed for) and ("load", layer loading), in order
    real_stage = switch_mod._stage_ahead

    def stage(bank, guess):
        events.append(("stage", cache.layer_number(bank)))
        return real_stage(bank, guess)

    real_load = type(cache.banks[0]).load

    def load(self, experts, *args, **kwargs):
        events.append(("load", cache.layer_number(self)))
        return real_load(self, experts, *args, **kwargs)

    copied = []  # staged experts written into slots through the host views (direct reads)
    real_copy = bank_io._copy_in

    def copy_in(bank, groups):
        copied.extend(len(rows) for _, rows, _ in groups)
        return real_copy(bank, groups)

    monkeypatch.setattr(switch_mod, "_stage_ahead", stage)
    monkeypatch.setattr(type(cache.banks[0]), "load", load)
    monkeypatch.setattr(bank_io, "_copy_in", copy_in)
    assert same(want, decode(model, tokens))
    assert sum(copied) == cache.prefetch_stats.used["lookahead"] > 0
    # how many layers before the guessed one the next load is: staged after the calling layer's
    # loads (0 .. reach - 1) or before them (1 .. reach)
    gaps = set()
    for i, (what, layer) in enumerate(events):
        if what == "stage":
            nxt = next(lay for w, lay in events[i + 1 :] if w == "load")
            gaps.add(layer - nxt)
    reach = min(depth, len(cache.banks) - 1)
    assert (min(gaps), max(gaps)) == ((1, reach) if early else (0, reach - 1))
    guessed = {layer for what, layer in events if what == "stage"}
    assert guessed == set(range(1, len(cache.banks)))  # every layer but the first is guessed
    assert cache.prefetch_stats.staged["lookahead"] > 0
    model.expert_streaming.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_a_bad_lookahead_depth_is_named(bad):
    with pytest.raises(ConfigurationError, match="lookahead_depth"):
        CacheTuning(lookahead_depth=bad)
    assert CacheTuning().lookahead_early is False and CacheTuning().lookahead_depth == 1


@pytest.mark.parametrize("depth,parallel", [(1, True), (2, True), (2, False)])
def test_guesses_read_straight_into_slots_are_exact(q3, depth, parallel, monkeypatch):
    # lookahead_into_slots: decode-sized guesses are read into the guessed layer's slots (on
    # probation) rather than staged; that layer's next call waits for them first
    path, tokens, want = q3
    tuning = CacheTuning(
        verified_steps=False,  # the lookahead is the per-layer schedule's
        lookahead_early=True,
        lookahead_depth=depth,
        lookahead_into_slots=True,
        lookahead_min_precision=0.0,
        ranges_in_parallel=parallel,
    )
    model = with_slots(path, 8, tuning=tuning)
    cache = model.expert_streaming.cache
    store = cache.store
    serial = []  # ranges_in_parallel=False: reads ahead, like demand reads, read_serial
    real_serial = store.read_serial
    monkeypatch.setattr(store, "read_serial", lambda jobs: serial.append(1) or real_serial(jobs))
    bank_type = type(cache.banks[0])
    ahead, settled = [], []
    real_ahead, real_settle = bank_type.read_ahead, bank_type.settle_ahead

    def read_ahead(self, experts):
        n = real_ahead(self, experts)
        ahead.append((cache.layer_number(self), n))
        return n

    def settle(self, experts):
        # nothing of this bank is being read ahead once its call has settled
        real_settle(self, experts)
        assert not self.ahead_reads
        settled.append(self.path)

    monkeypatch.setattr(bank_type, "read_ahead", read_ahead)
    monkeypatch.setattr(bank_type, "settle_ahead", settle)
    assert same(want, decode(model, tokens))
    assert sum(n for _, n in ahead) > 0 and 0 not in {layer for layer, _ in ahead}
    st = cache.prefetch_stats
    # (prefill-sized guesses, more than half the slots, are still staged)
    assert st.staged["lookahead"] >= sum(n for _, n in ahead) and st.used["lookahead"] > 0
    assert bool(serial) == (not parallel)
    # each read ahead is a miss of the call that used it (or of none): hits + misses = asked
    asked = sum(b.hits + b.misses for b in cache.banks)
    assert asked == cache.stats.hits + cache.stats.misses
    model.expert_streaming.close()


def test_a_failed_read_ahead_leaves_its_slot_free(q3, monkeypatch):
    # a guess whose read fails is unmapped when its layer's call settles: read on demand instead
    path, tokens, want = q3
    tuning = CacheTuning(
        verified_steps=False,  # the lookahead is the per-layer schedule's
        lookahead_early=True, lookahead_into_slots=True, lookahead_min_precision=0.0
    )
    model = with_slots(path, 8, tuning=tuning)
    cache = model.expert_streaming.cache
    bank_type = type(cache.banks[0])
    real_ahead = bank_type.read_ahead
    failed = []

    def read_ahead(self, experts):
        n = real_ahead(self, experts)
        for e, (slot, future) in list(self.ahead_reads.items()):
            future.result()  # the real read has ended: nothing writes the slot any more
            bad = Future()
            bad.set_exception(OSError("disk gone"))
            self.ahead_reads[e] = (slot, bad)
            failed.append((self, e, slot))
        return n

    monkeypatch.setattr(bank_type, "read_ahead", read_ahead)
    assert same(want, decode(model, tokens))
    assert failed and cache.prefetch_stats.failed == len(failed)
    assert "disk gone" in cache.prefetch_stats.first_error
    model.expert_streaming.close()


@pytest.mark.parametrize("together", [True, False])
def test_experts_that_land_together_are_computed_together(q3, together, monkeypatch):
    # batch_landings: experts whose reads ended while the calling thread was busy are reported
    # (and computed) in one call; off: one call each
    import time

    path, tokens, want = q3
    tuning = CacheTuning(lookahead=False, batch_landings=together)
    model = with_slots(path, 8, tuning=tuning)
    reported = []
    real_direct = bank_io.read_direct

    def read_direct(bank, pairs, resident, *args):
        return real_direct(
            bank, pairs, lambda ids: (reported.append(len(ids)), resident(ids)), *args
        )

    real_rows = switch_mod.StreamingSwitchGLU._rows

    def slow_rows(self, x, idx, which):
        time.sleep(0.01)  # busy: the other reads of the call land meanwhile
        return real_rows(self, x, idx, which)

    monkeypatch.setattr(bank_io, "read_direct", read_direct)
    monkeypatch.setattr(switch_mod.StreamingSwitchGLU, "_rows", slow_rows)
    assert same(want, decode(model, tokens))
    assert reported
    if together:
        assert max(reported) > 1
    else:
        assert set(reported) == {1}
    assert CacheTuning().batch_landings is False  # within noise on the H200: an option
    model.expert_streaming.close()


@pytest.mark.parametrize("into", [False, True])
def test_a_guess_read_ahead_counts_once(q3, into, monkeypatch):
    # a guess the call uses is one miss of that call, staged or read into its slot: every expert a
    # call asks for is counted once (a staged one was once counted a miss and then a hit)
    path, tokens, want = q3
    tuning = CacheTuning(
        verified_steps=False,  # the lookahead is the per-layer schedule's
        lookahead_early=True,
        lookahead_into_slots=into,
        lookahead_min_precision=0.0,
        staging_bytes=1 << 24,
    )
    model = with_slots(path, 8, tuning=tuning)
    cache = model.expert_streaming.cache
    asked = []
    real_call = switch_mod.StreamingSwitchGLU.__call__

    def call(self, x, indices):
        asked.append(len(np.unique(np.array(indices))))
        return real_call(self, x, indices)

    monkeypatch.setattr(switch_mod.StreamingSwitchGLU, "__call__", call)
    assert same(want, decode(model, tokens))
    assert cache.prefetch_stats.used["lookahead"] > 0
    assert cache.stats.hits + cache.stats.misses == sum(asked)
    model.expert_streaming.close()


@pytest.mark.parametrize("reads_first", [True, False])
def test_the_hits_rows_follow_the_reads_issue(q3, reads_first, monkeypatch):
    # reads_first: a decode call hands its reads to the demand threads before it computes the rows
    # of its resident experts, so that their submission no longer delays every read; off: before
    import threading
    from concurrent.futures import ThreadPoolExecutor

    path, tokens, want = q3
    model = with_slots(path, 4, tuning=CacheTuning(lookahead=False, reads_first=reads_first))
    events = []  # on the thread that calls the model: "call", "rows" (a kernel call), "read"
    main = threading.current_thread()
    real_call = switch_mod.StreamingSwitchGLU.__call__
    real_rows = switch_mod.StreamingSwitchGLU._rows
    real_submit = ThreadPoolExecutor.submit

    def call(self, x, indices):
        events.append("call")
        return real_call(self, x, indices)

    def rows(self, x, idx, which):
        events.append("rows")
        return real_rows(self, x, idx, which)

    def submit(self, fn, *args, **kwargs):
        if threading.current_thread() is main:
            events.append("read")  # a demand read handed to its thread
        return real_submit(self, fn, *args, **kwargs)

    monkeypatch.setattr(switch_mod.StreamingSwitchGLU, "__call__", call)
    monkeypatch.setattr(switch_mod.StreamingSwitchGLU, "_rows", rows)
    monkeypatch.setattr(ThreadPoolExecutor, "submit", submit)
    assert same(want, decode(model, tokens))
    calls = " ".join(events).split("call")
    # calls that computed rows before their first read was issued: those of the hits
    mixed = [c.split() for c in calls if "read" in c.split() and "rows" in c.split()]
    rows_first = [c for c in mixed if c.index("rows") < c.index("read")]
    assert mixed
    if reads_first:
        assert not rows_first
    else:
        assert rows_first
    assert CacheTuning().reads_first is True
    model.expert_streaming.close()
