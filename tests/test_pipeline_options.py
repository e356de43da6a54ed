"""The I/O pipeline's schedule (issue 14): each read expert computed as it lands, the router's
lookahead one layer ahead. Each only moves work:
logits equal stock's bit for bit, and each does what it says.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from support import KernelPlugin, decode, load_stock, registered, same, with_slots

from mlx_lm_streaming.runtime.bank import reads as bank_reads
from mlx_lm_streaming.runtime import lookahead
from mlx_lm_streaming.runtime.expert_cache import CacheTuning
from mlx_lm_streaming.kernels.gather import GatherKernel
from mlx_lm_streaming.runtime.mlx_compat import SORT_THRESHOLD


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


def test_the_hits_rows_follow_the_reads_issue(q3, tmp_path):
    # a decode call hands its reads to the demand threads before it computes the rows of its
    # resident experts, so that their submission does not delay every read. On the timeline: in a
    # call with hits and misses, the hits' compute is the first "submit" before the first "wait
    # read"; reads issued before it can start while it is submitted (mx.async_eval lets go of the
    # GIL), reads issued after it cannot. The demand threads are not always scheduled in that
    # window, so some call, not every call, shows it
    path, tokens, want = q3
    out = tmp_path / "timeline.json"
    model = with_slots(path, 4, tuning=CacheTuning(lookahead=False), trace=str(out))
    assert same(want, decode(model, tokens))
    model.expert_streaming.close()
    events = [e for e in json.loads(out.read_text()) if e["ph"] == "X"]
    # per call with hits and misses: whether a read started before the hits' submit ended
    reads_during_hits = []
    for call in events:
        args = call["args"]
        if call["name"] != "layer" or not 0 < args.get("misses", 0) < args.get("experts", 0):
            continue
        start, end = call["ts"], call["ts"] + call["dur"]
        ours = [e for e in events if e["args"].get("layer") == args["layer"]]
        inside = sorted((e for e in ours if start <= e["ts"] <= end), key=lambda e: e["ts"])
        names = [e["name"] for e in inside]
        first_wait = names.index("wait read")
        assert "submit" in names[:first_wait], names  # the hits' rows, before any read is awaited
        hits = inside[names.index("submit")]
        reads = [e for e in inside if e["name"] == "read" and e["args"]["kind"] == "demand"]
        assert reads
        reads_during_hits.append(min(e["ts"] for e in reads) < hits["ts"] + hits["dur"])
    assert reads_during_hits
    assert any(reads_during_hits), reads_during_hits
