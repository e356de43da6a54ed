"""The I/O pipeline's schedule (issue 14): each read expert computed as it lands, the router's
lookahead one layer ahead. Each only moves work:
logits equal stock's bit for bit, and each does what it says.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from support import KernelPlugin, decode, load_stock, registered, same, with_slots

from mlx_lm_streaming.kernels.gather import GatherKernel
from mlx_lm_streaming.runtime.bank import LayerBank
from mlx_lm_streaming.runtime.decode.schedules import direct
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from mlx_lm_streaming.runtime.mlx_compat import SORT_THRESHOLD
from mlx_lm_streaming.runtime.reads import bank_reads
from mlx_lm_streaming.runtime.reads import lookahead


def test_one_call_per_landing_is_exact(q3, tmp_path):
    path, tokens, want = q3
    out = tmp_path / "timeline.json"
    model = with_slots(path, 4, tuning=CacheTuning(lookahead=False), trace=str(out))
    k = model.args.num_experts_per_tok
    assert same(want, decode(model, tokens))
    model.expert_streaming.close()
    events = [e for e in json.loads(out.read_text()) if e["ph"] == "X"]
    # reads straight into slots, reported as they landed (demand reads on the demand readers)
    model_thread = {e["tid"] for e in events if e["name"] == "layer"}
    assert any(
        e["name"] == "read" and e["args"]["kind"] == "demand" and e["tid"] not in model_thread
        for e in events
    )
    # calls of at most 4 rows use at most the 4 slots: one wave (more go in waves, a call each),
    # whose rows are computed in parts (hits, landings: a submit each) before the whole is submitted
    submits = []  # per such layer call with misses: the compute it submitted
    for call in events:
        args = call["args"]
        if call["name"] != "layer" or args["tokens"] * k > 4 or not args.get("misses"):
            continue
        start, end = call["ts"], call["ts"] + call["dur"]
        submits.append(
            sum(
                e["name"] == "submit" and e["args"]["layer"] == args["layer"]
                for e in events
                if e["tid"] == call["tid"] and start <= e["ts"] <= end
            )
        )
    assert submits and any(n > 2 for n in submits), submits


class ExpertsPerCall(GatherKernel):
    """The gather kernel, registered through the kernel plugin hook, noting how many experts each
    call computes."""

    name = "experts_per_call"

    def __init__(self):
        self.experts = []

    def __call__(self, x, slots, slots_np, bank):
        self.experts.append(len(np.unique(slots_np)))  # one slot per expert in a bank
        return super().__call__(x, slots, slots_np, bank)


@pytest.fixture
def experts_per_call():
    with registered(KernelPlugin(ExpertsPerCall()), "experts-per-call-test") as plugin:
        yield plugin.kernel


def test_cpu_prefill_computes_read_experts_as_they_land(q3, experts_per_call):
    # a call per wave on the CPU kept +5 points of peak RSS over the budget (docs/design.md): there,
    # prefill-sized calls compute each read expert as it lands
    path, _, _ = q3
    tokens = mx.array([[(7 * i + 1) % 512 for i in range(40)]])
    stock, _ = load_stock(path)
    want = stock(tokens)
    model = with_slots(path, 4, tuning=CacheTuning(lookahead=False), kernel=experts_per_call.name)
    k = model.args.num_experts_per_tok
    assert tokens.size * k >= SORT_THRESHOLD  # every layer call is prefill-sized
    assert same([want], [model(tokens)])
    assert experts_per_call.experts
    # the banks start empty: every kernel call is one read expert
    assert all(n == 1 for n in experts_per_call.experts), experts_per_call.experts
    model.expert_streaming.close()


def test_router_lookahead_is_exact_and_one_layer_ahead(q3, monkeypatch):
    # the router's guesses for the next MoE layer are staged once the calling layer's own reads
    # have landed, before its next layer loads
    path, tokens, want = q3
    tuning = CacheTuning(
        lookahead_min_precision=0.0,
        staging_bytes=1 << 24,  # room for every guess (the default is a share of the budget)
    )
    model = with_slots(path, 4, tuning=tuning)
    cache = model.expert_streaming.cache
    events = []  # ("stage", layer guessed for) and ("load", layer loading), in order
    real_stage = lookahead.stage

    def stage(bank, guess):
        events.append(("stage", cache.layer_number(bank)))
        return real_stage(bank, guess)

    real_reads = type(cache.banks[0]).reads  # (a bank's loads start with it)

    def reads(self, experts, *args, **kwargs):
        events.append(("load", cache.layer_number(self)))
        return real_reads(self, experts, *args, **kwargs)

    copied = []  # staged experts written into slots through the host views (direct reads)
    real_copy = bank_reads.copy_in

    def copy_in(bank, groups):
        copied.extend(len(rows) for _, rows, _ in groups)
        return real_copy(bank, groups)

    monkeypatch.setattr(lookahead, "stage", stage)
    monkeypatch.setattr(type(cache.banks[0]), "reads", reads)
    monkeypatch.setattr(bank_reads, "copy_in", copy_in)
    assert same(want, decode(model, tokens))
    assert sum(copied) == cache.prefetch_stats.used["lookahead"] > 0
    # how many layers before the guessed one the next load is: staged after the calling layer's
    # loads, so the next load is the guessed layer's own
    gaps = set()
    for i, (what, layer) in enumerate(events):
        if what == "stage":
            nxt = next(lay for w, lay in events[i + 1 :] if w == "load")
            gaps.add(layer - nxt)
    assert gaps == {0}
    guessed = {layer for what, layer in events if what == "stage"}
    assert guessed == set(range(1, len(cache.banks)))  # every layer but the first is guessed
    assert cache.prefetch_stats.staged["lookahead"] > 0
    model.expert_streaming.close()


def test_a_guess_read_ahead_counts_once(q3, tmp_path):
    # a guess the call uses is one miss of that call: every expert a call asks for is counted once
    # (a staged one was once counted a miss and then a hit). The timeline's layer events give the
    # distinct experts each call asked for
    path, tokens, want = q3
    tuning = CacheTuning(
        verified_steps=False,  # the lookahead is the per-layer schedule's
        lookahead_min_precision=0.0,
        staging_bytes=1 << 24,
    )
    out = tmp_path / "timeline.json"
    model = with_slots(path, 8, tuning=tuning, trace=str(out))
    cache = model.expert_streaming.cache
    assert same(want, decode(model, tokens))
    assert cache.prefetch_stats.used["lookahead"] > 0
    counted = cache.stats.hits + cache.stats.misses
    model.expert_streaming.close()
    calls = [e["args"] for e in json.loads(out.read_text()) if e.get("name") == "layer"]
    assert calls and all("experts" in c for c in calls)
    assert counted == sum(c["experts"] for c in calls)


def test_the_hits_rows_follow_the_reads_issue(q3, monkeypatch):
    # a decode call hands its reads to the demand threads before it computes the rows of its
    # resident experts, so that their submission does not delay every read; and it submits those
    # rows before it takes the first landing. Logged in program order on the model's thread: each
    # wave's reads asked for (with hits and misses), the demand reads handed to the threads, the
    # rows submitted (mx.async_eval), the landings taken
    path, tokens, want = q3
    model = with_slots(path, 4, tuning=CacheTuning(lookahead=False))
    log = []
    real_reads, real_submit, real_compute = LayerBank.reads, mx.async_eval, direct.Direct.compute
    pool = model.expert_streaming.cache.demand_pool
    real_issue = pool.submit

    def compute(schedule, *args, **kwargs):
        log.append("call")
        try:
            return real_compute(schedule, *args, **kwargs)
        finally:
            log.append("end")

    def reads(bank, wave, *args, **kwargs):
        resident = bank.slot_of[wave] >= 0
        log.append(("wave", bool(resident.any() and not resident.all())))
        return _Landings(real_reads(bank, wave, *args, **kwargs), log)

    def issue(*args, **kwargs):
        log.append("issue")
        return real_issue(*args, **kwargs)

    def submit(*arrays):  # (``mx.async_eval``: the schedule submits through it, inline or not)
        log.append("submit")
        return real_submit(*arrays)

    monkeypatch.setattr(direct.Direct, "compute", compute)
    monkeypatch.setattr(LayerBank, "reads", reads)
    monkeypatch.setattr(mx, "async_eval", submit)
    monkeypatch.setattr(pool, "submit", issue)
    assert same(want, decode(model, tokens))
    model.expert_streaming.close()
    waves, inside = [], False  # the events of each wave with hits and misses of a layer call
    for event in log:
        if event in ("call", "end"):
            inside = event == "call"
            waves.append(None)
        elif isinstance(event, tuple):
            waves.append([] if inside and event[1] else None)
        elif waves and waves[-1] is not None:
            waves[-1].append(event)
    waves = [w for w in waves if w is not None]
    assert waves
    for events in waves:
        assert "issue" in events and "landing" in events, events
        first_submit = events.index("submit")
        assert events.index("issue") < first_submit < events.index("landing"), events


class _Landings:
    """A landings generator as ``LayerBank.reads`` returns it, each landing taken logged."""

    def __init__(self, gen, log):
        self.gen, self.log = gen, log

    def __iter__(self):
        return self

    def __next__(self):
        landing = next(self.gen)
        self.log.append("landing")
        return landing

    def close(self):
        self.gen.close()
