"""Direct reads: missed experts are read straight into their slots' memory and each expert's rows are
computed as soon as its bytes land (``LayerBank.direct``, ``schedules.AsTheyLand``).

Writing bank memory behind MLX's back must never change what is computed: logits equal stock mlx-lm's
bit for bit for every budget (waves of one slot up to decode-sized calls), a second calling thread
turns direct reads off, views follow a bank that MLX moved, and a failed read leaves no slot naming
bytes that did not land.
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from support import decode, load_stock, load_streaming, per_slot, registered, same, with_slots

from mlx_lm_streaming.errors import ExpertIOError
from mlx_lm_streaming.hookspecs import hookimpl
from mlx_lm_streaming.option_table import GB
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from mlx_lm_streaming.stores.safetensors import SafetensorsStore

NO_LOOKAHEAD = CacheTuning(lookahead=False)


class InjectingStore(SafetensorsStore):
    """The safetensors store, registered through the store plugin hook, whose ``read_many`` can be
    slowed (``delay`` seconds before each call) or made to fail (every ``fail_every``-th call)."""

    name = "injecting"

    def __init__(self, files, **options):
        super().__init__(files, **options)
        self.delay, self.fail_every, self.calls = 0.0, 0, 0

    def read_many(self, jobs):
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            raise ExpertIOError("injected: read failed")
        if self.delay:
            time.sleep(self.delay)
        return super().read_many(jobs)


class InjectingStorePlugin:
    @hookimpl
    def register_stores(self, register):
        register(InjectingStore.name, InjectingStore)


@pytest.fixture
def injecting_store():
    """The name of ``InjectingStore``, registered for the test."""
    with registered(InjectingStorePlugin(), "injecting-store-test"):
        yield InjectingStore.name


# slots per layer: 1 (waves of one, no overlap), 2 and 3 (waves of one next to the one computing),
# 5 (waves of two), 16 (every expert: identity banks, filled in the background)
@pytest.mark.parametrize("slots", [1, 2, 3, 5, 16])
def test_direct_reads_are_exact_at_every_budget(q3, slots, tmp_path):
    path, tokens, want = q3
    out = tmp_path / "timeline.json"
    model = with_slots(path, slots, tuning=NO_LOOKAHEAD, trace=str(out))
    cache = model.expert_streaming.cache
    cache.ensure_planned()
    assert all(b.slots == slots and b.direct for b in cache.banks)
    assert same(want, decode(model, tokens))
    # nothing went through staging buffers
    assert cache.stats.install_seconds == 0 or slots == 16
    assert cache.resident_bytes <= slots * per_slot(model)
    model.expert_streaming.close()
    # the timeline: demand reads ran on the demand readers, each into its slot, none on the
    # thread that runs the model (where reads through staging buffers run)
    events = [e for e in json.loads(out.read_text()) if e["ph"] == "X"]
    model_thread = {e["tid"] for e in events if e["name"] == "layer"}
    demand = [e for e in events if e["name"] == "read" and e["args"]["kind"] == "demand"]
    assert demand
    assert all(e["tid"] not in model_thread and "slot" in e["args"] for e in demand)


def test_experts_are_computed_as_they_land(q3, injecting_store, tmp_path):
    """Each read expert's rows are computed when it lands, before the next lands: on the timeline,
    every ``wait read`` of the calling thread is followed by the ``submit`` of what landed before
    the next ``wait read`` (not one ``submit`` for the whole load)."""
    path, tokens, want = q3
    out = tmp_path / "timeline.json"
    model = with_slots(path, 8, tuning=NO_LOOKAHEAD, store=injecting_store, trace=str(out))
    cache = model.expert_streaming.cache
    cache._demand_pool = ThreadPoolExecutor(1)  # one expert at a time
    cache.store.delay = 0.01  # the layer is done with the expert before the next one lands
    assert same(want, decode(model, tokens))
    model.expert_streaming.close()
    events = [e for e in json.loads(out.read_text()) if e["ph"] == "X"]
    several = 0  # layer calls that read two experts or more
    for call in events:
        if call["name"] != "layer" or call["args"].get("misses", 0) < 2:
            continue
        several += 1
        start, end, layer = call["ts"], call["ts"] + call["dur"], call["args"]["layer"]
        ours = [e for e in events if e["tid"] == call["tid"] and e["args"].get("layer") == layer]
        inside = [e for e in ours if start <= e["ts"] <= end]
        names = [e["name"] for e in sorted(inside, key=lambda e: e["ts"])]
        order = [n for n in names if n in ("wait read", "submit")]
        assert order.count("wait read") == call["args"]["misses"], names
        assert all(nxt == "submit" for n, nxt in zip(order, order[1:]) if n == "wait read"), names
    assert several


def test_a_second_thread_turns_direct_reads_off(q3):
    path, tokens, want = q3
    model = with_slots(path, 4)
    cache = model.expert_streaming.cache
    assert same(want, decode(model, tokens))
    assert all(b.direct for b in cache.banks)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("got", decode(model, tokens)))
    t.start()
    t.join()
    assert same(want, out["got"])
    assert cache.shared and not any(b.direct for b in cache.banks)
    assert same(want, decode(model, tokens))
    model.expert_streaming.close()


def test_views_follow_a_bank_moved_by_mlx(q3):
    path, _, _ = q3
    model = with_slots(path, 2)
    cache = model.expert_streaming.cache
    cache.ensure_planned()
    bank = cache.banks[0]
    spec = bank.layer.parts[0]
    before = bank.view_addresses[0]
    # a new array for the bank, as an update that could not be done in place leaves it
    bank.glu[spec.proj][spec.part] = mx.array(np.array(bank.array(spec.proj, spec.part)))
    mx.eval(bank.array(spec.proj, spec.part))
    bank.refresh_views()
    assert bank.view_addresses[0] != before
    bank.views[0][1, :4] = 7
    seen = np.array(bank.array(spec.proj, spec.part)[1].view(mx.uint8)).reshape(-1)[:4]
    assert (seen == 7).all()
    model.expert_streaming.close()


def test_a_failed_direct_read_maps_no_slot_to_it(q3, injecting_store):
    path, tokens, want = q3
    model = with_slots(path, 4, tuning=NO_LOOKAHEAD, store=injecting_store)
    cache = model.expert_streaming.cache
    store = cache.store
    assert isinstance(store, InjectingStore)
    store.fail_every = 3
    with pytest.raises(ExpertIOError, match="injected"):
        decode(model, tokens)
    for bank in cache.banks:
        mapped = np.nonzero(bank.slot_of >= 0)[0]
        assert (bank.expert_of[bank.slot_of[mapped]] == mapped).all()
    # every mapped slot holds its expert's bytes: with reads working again, logits are stock's
    store.fail_every = 0
    assert same(want, decode(model, tokens))
    model.expert_streaming.close()


def test_partial_calls_are_padded_where_row_counts_matter(q3, padded_gather):
    """A kernel whose per-row bits depend on the row count (gather_qmm on CUDA) always gets the whole
    call's row count: partial calls (hits, landings, waves) are padded, and the result is unchanged.
    """
    path, tokens, want = q3
    counts = padded_gather.counts
    for slots in (3, 8):
        model = with_slots(path, slots, tuning=NO_LOOKAHEAD, kernel=padded_gather.name)
        counts.clear()
        assert same(want, decode(model, tokens))
        k = model.args.num_experts_per_tok
        # prompt: 2 x 12 tokens x top-k rows; decode: 2 x top-k rows
        assert counts and set(counts) == {tokens.size * k, tokens.shape[0] * k}, set(counts)
        # beyond decode sizes, read experts are computed once per wave (each padded call costs
        # as much as the whole one), still at the whole call's row count
        long = mx.concatenate([tokens] * 4, axis=1)
        stock, _ = load_stock(path)
        counts.clear()
        assert mx.array_equal(model(long), stock(long)).item()
        assert set(counts) == {long.size * k}
        model.expert_streaming.close()


def test_the_option_turns_direct_reads_on_and_off(q3, monkeypatch):
    from mlx_lm_streaming.errors import ConfigurationError
    from mlx_lm_streaming.runtime.options import StreamingOptions

    path, tokens, want = q3
    for value, direct in ((None, True), (False, False), ("0", False), ("auto", True), (True, True)):
        opts = {} if value is None else {"direct_reads": value}
        model, _ = load_streaming(path, expert_cache_gb=0.01, **opts)
        cache = model.expert_streaming.cache
        cache.ensure_planned()
        assert all(b.direct == direct for b in cache.banks), value
        assert same(want, decode(model, tokens))
        model.expert_streaming.close()
    # auto: only where verified (the CPU backend, and CUDA on the H200)
    assert StreamingOptions().use_direct_reads("cuda")
    assert not StreamingOptions().use_direct_reads("metal")
    assert StreamingOptions(direct_reads=True).use_direct_reads("metal")
    monkeypatch.setenv("MLX_LM_STREAMING_EXPERTS", "1")
    monkeypatch.setenv("MLX_LM_STREAMING_DIRECT_READS", "0")
    assert StreamingOptions.from_env().direct_reads is False
    with pytest.raises(ConfigurationError, match="direct_reads"):
        StreamingOptions(direct_reads="sometimes")


def test_what_the_budget_leaves_gives_layers_one_more_slot(q3):
    path, tokens, want = q3
    probe, _ = load_streaming(path)
    banks = probe.expert_streaming.cache.banks
    one = banks[0].layer.expert_nbytes
    # three slots per layer, and room for two more experts: the first two layers get a fourth
    model, _ = load_streaming(path, expert_cache_gb=(3 * per_slot(probe) + 2 * one + 0.5) / GB)
    cache = model.expert_streaming.cache
    cache.ensure_planned()
    assert [b.slots for b in cache.banks] == [4, 4] + [3] * (len(banks) - 2)
    assert cache.resident_bytes <= cache.budget_bytes
    assert same(want, decode(model, tokens))
    model.expert_streaming.close()


@pytest.mark.parametrize("slots", [2, 3, 16])
def test_projections_computed_as_they_land_are_exact(q3, slots, tmp_path):
    """Big experts are read a projection at a time and each projection's rows computed as it lands
    (phase_min_bytes lowered so that the test's small experts qualify): same bits as stock."""
    path, tokens, want = q3
    out = tmp_path / "timeline.json"
    tuning = CacheTuning(lookahead=False, phase_min_bytes=0)
    model = with_slots(path, slots, tuning=tuning, trace=str(out))
    cache = model.expert_streaming.cache
    assert same(want, decode(model, tokens))
    assert all(b.direct for b in cache.banks)
    model.expert_streaming.close()
    # gate and up are reported as they land (a "wait read" for the projection, then its
    # submit); down lands with the expert
    events = [e for e in json.loads(out.read_text()) if e["ph"] == "X"]
    on_model_thread = sorted(
        (e for e in events if e["tid"] in {c["tid"] for c in events if c["name"] == "layer"}),
        key=lambda e: e["ts"],
    )
    landed = [e["args"].get("part") for e in on_model_thread if e["name"] == "wait read"]
    landed = [p for p in landed if p is not None]
    assert landed and set(landed) == {"gate_proj", "up_proj"}
    assert landed.count("gate_proj") == landed.count("up_proj")
    names = [e["name"] for e in on_model_thread if e["name"] in ("wait read", "submit")]
    parts = [i for i, e in enumerate(on_model_thread) if e["args"].get("part")]
    assert all(
        next(e["name"] for e in on_model_thread[i + 1 :] if e["name"] in ("wait read", "submit"))
        == "submit"
        for i in parts
    ), names


def test_a_cancelled_read_is_an_error_not_a_hang(q3):
    """A read its pool never ran (shut down with cancel_futures) is reported, so the layer raises."""
    from concurrent.futures import Future

    class Cancelling:
        def submit(self, fn, *args):
            future = Future()
            future.cancel()
            return future

    path, tokens, _ = q3
    model = with_slots(path, 2, tuning=NO_LOOKAHEAD)
    cache = model.expert_streaming.cache
    cache.ensure_planned()
    cache._demand_pool = Cancelling()
    with pytest.raises(ExpertIOError, match="cancelled"):
        decode(model, tokens)
    cache._demand_pool = None


class CountingStore(SafetensorsStore):
    """The safetensors store counting how loads read: ranges spread over its readers, or one
    expert's ranges on the calling thread alone."""

    name = "counting"

    def __init__(self, files, **options):
        super().__init__(files, **options)
        self.spread = self.alone = 0

    def _read_jobs(self, jobs, spread):
        if spread:
            self.spread += 1
        else:
            self.alone += 1
        return super()._read_jobs(jobs, spread)


class CountingStorePlugin:
    @hookimpl
    def register_stores(self, register):
        register(CountingStore.name, CountingStore)


@pytest.mark.parametrize("upto", [1, None])
def test_a_load_of_several_experts_reads_each_on_its_own_thread(q3, upto):
    # ``spread_reads_upto``: a load of one expert spreads its ranges over the store's readers;
    # of more, each expert is read whole by its demand thread (None: always spread); exact either way
    path, tokens, want = q3
    with registered(CountingStorePlugin(), "counting-store-test"):
        tuning = CacheTuning(lookahead=False, spread_reads_upto=upto, verified_steps=False)
        model = with_slots(path, 5, tuning=tuning, store=CountingStore.name)
        assert same(want, decode(model, tokens))
        store = model.expert_streaming.cache.store
        assert store.spread > 0
        assert (store.alone > 0) == (upto is not None)
        model.expert_streaming.close()


def test_a_load_beside_other_banks_never_spreads(q3):
    # a lone expert's ranges are spread over the store's readers; the same load on a bank thread of
    # a verified step's misses read together (``load_together``: ``LayerBank.load(...,
    # alone=True)``) reads it on its demand thread alone
    from mlx_lm_streaming.runtime.decode.verified_step import load_together

    path, tokens, want = q3
    with registered(CountingStorePlugin(), "counting-store-test"):
        model = with_slots(path, 5, tuning=NO_LOOKAHEAD, store=CountingStore.name)
        cache = model.expert_streaming.cache
        cache.ensure_planned()
        store = cache.store
        first, second = cache.banks[0], cache.banks[1]
        first.load(np.array([0]))
        assert (store.spread, store.alone) == (1, 0)
        load_together([(first, np.array([1]), {}), (second, np.array([0]), {})])
        assert (store.spread, store.alone) == (1, 2)
        assert first.slot_of[0] >= 0 and first.slot_of[1] >= 0 and second.slot_of[0] >= 0
        model.expert_streaming.close()
