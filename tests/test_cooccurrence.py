"""Reading ahead on a guess: the co-activation predictor, prefetched experts' probation, and the
replay's lookahead mode (``cooccurrence``, ``policy``, ``replay``).

The predictor learns a routing where each layer's experts decide the next layer's and predicts it;
it guesses nothing it has not seen, respects its limit and exclusions, and costs tens of
microseconds a call. A prefetched expert nobody used is evicted before a used one. The replay with
lookahead hits at least as often as without where layer L decides layer L + 1, counts its reads,
and never reads ahead an expert that is resident.
"""

import time
from pathlib import Path

import numpy as np
import pytest

from mlx_lm_streaming import replay as replay_module
from mlx_lm_streaming.cooccurrence import CoactivationPredictor
from mlx_lm_streaming.policy import SlotTable
from mlx_lm_streaming.replay import Lookahead, replay
from mlx_lm_streaming.routing_trace import RoutingTrace, TraceRow, read_trace

QWEN = Path(__file__).parent / "data" / "routing" / "qwen3-30b-a3b.jsonl"


def topics(layers=6, experts=128, top_k=6, count=8, prefill=16, decode=64, seed=0):
    """Each token follows one of ``count`` topics, and a topic uses its own experts at each layer
    (disjoint from the other topics'): a layer's experts decide the next layer's."""
    rng = np.random.default_rng(seed)
    sets = [rng.permutation(experts)[: count * top_k].reshape(count, top_k) for _ in range(layers)]
    rows = []
    for t in range(prefill + decode):
        g = t % count if t < prefill else int(rng.integers(count))
        phase = "prefill" if t < prefill else "decode"
        rows.append(TraceRow(0, phase, [sets[layer][g].tolist() for layer in range(layers)]))
    header = {"format": "moe-routing-trace", "version": 1, "model": "topics (synthetic)"}
    header.update(num_layers=layers, num_experts=experts, top_k=top_k)
    return RoutingTrace(header, rows), sets


# --- the predictor ------------------------------------------------------------------------------


def test_the_predictor_learns_which_experts_follow_and_predicts_them():
    trace, sets = topics()
    p = CoactivationPredictor(trace.num_layers, trace.num_experts)
    for row in trace.rows[:16]:  # each topic twice
        for layer, ids in enumerate(row.experts):
            p.observe(layer, np.array(ids))
    for g in range(8):
        p.observe(0, sets[0][g])
        got = p.predict(0, sets[0][g], limit=6)
        assert sorted(got.tolist()) == sorted(sets[1][g].tolist())
        assert sorted(p.predict(0, sets[0][g], limit=6, ahead=2).tolist()) == sorted(
            sets[2][g].tolist()
        )
        # with layer 0 seen in this step, layer 1's guess adds the evidence from two layers back
        p.observe(1, sets[1][g])
        assert sorted(p.predict(1, sets[1][g], limit=6).tolist()) == sorted(sets[2][g].tolist())


def test_unseen_experts_give_no_guess_and_the_last_layer_none():
    p = CoactivationPredictor(4, 16)
    assert p.predict(0, np.array([1, 2]), limit=4).tolist() == []
    p.observe(0, np.array([1, 2]))
    p.observe(1, np.array([3, 4]))
    assert p.predict(0, np.array([5, 6]), limit=4).tolist() == []
    assert p.predict(3, np.array([3, 4]), limit=4).tolist() == []
    assert p.predict(2, np.array([3, 4]), limit=4, ahead=2).tolist() == []


def test_limit_min_score_and_exclude_are_respected():
    p = CoactivationPredictor(2, 16)
    for t in range(10):
        p.observe(0, np.array([0]))
        p.observe(1, np.array([1, 2, 3] if t < 9 else [1, 2, 4]))
    assert p.predict(0, [0], limit=2).tolist() == [1, 2]
    assert p.predict(0, [0], limit=8).tolist() == [1, 2, 3, 4]
    assert p.predict(0, [0], limit=8, min_score=0.5).tolist() == [1, 2, 3]
    exclude = np.zeros(16, dtype=bool)
    exclude[[1, 3]] = True
    assert p.predict(0, [0], limit=8, exclude=exclude).tolist() == [2, 4]
    assert p.predict(0, [0], limit=0).tolist() == []
    assert 0 < p.scores(0, [0])[1] < 1  # a probability, smoothed


def test_a_token_boundary_is_a_new_call_of_a_lower_layer_or_next_token():
    p = CoactivationPredictor(3, 8)
    p.observe(0, [1])
    p.observe(2, [2])  # layer 1 did not run: 0 and 2 are two apart, not one
    assert p.uses[0].sum() == 0 and p.pairs[1][0, 1, 2] == 1
    p.observe(1, [3])  # a new step: nothing pairs with the 2 before
    assert p.uses[0].sum() == 0
    p.next_token()
    p.observe(2, [4])
    assert p.uses[0].sum() == 0 and p.uses[1].sum() == 1


def test_batched_rows_pair_token_by_token():
    p = CoactivationPredictor(2, 8)
    p.observe(0, np.array([[0, 1], [2, 3]]))
    p.observe(1, np.array([[4, 5], [6, 7]]))
    assert p.pairs[0][0, 0, [4, 5, 6, 7]].tolist() == [1, 1, 0, 0]
    assert p.pairs[0][0, 3, [4, 5, 6, 7]].tolist() == [0, 0, 1, 1]
    assert p.uses[0][0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert sorted(p.predict(0, np.array([[0, 1]]), limit=4).tolist()) == [4, 5]


def test_a_decode_call_costs_tens_of_microseconds():
    trace = read_trace(QWEN)
    p = CoactivationPredictor(trace.num_layers, trace.num_experts)
    rows = [np.array(r.experts[:-1], dtype=np.int64) for r in trace.rows[:60]]
    # this thread's CPU time, not the wall clock: on a busy machine the wall clock counts the wait
    # for a core too (measured: 300 us a call with both cores of this box busy, 45 us of CPU)
    start = time.thread_time()
    for ids in rows:
        for layer in range(len(ids)):
            p.observe(layer, ids[layer][None, :])
            p.predict(layer, ids[layer][None, :], limit=2, min_score=0.25)
    per_call = (time.thread_time() - start) / (len(rows) * len(rows[0]))
    # observe + predict of one layer for one token (shared CI machines: a loose bound)
    assert per_call < 300e-6, f"{per_call * 1e6:.0f} us"


# --- probation ----------------------------------------------------------------------------------


def admit(table, experts):
    missing, slots, _ = table.admit(np.array(experts, dtype=np.int64))
    table.place(missing, slots)


def test_a_wrong_prefetch_is_evicted_before_a_used_expert():
    table = SlotTable(16, "decay")
    table.reset(2)
    for _ in range(10):
        admit(table, [5])  # 5: a high score
    admit(table, [0, 1])  # 5 evicted (the only candidate), keeps its score
    admit(table, [0])
    clock = table.policy.clock
    missing, slots, evicted = table.prefetch(np.array([5, 0]))
    assert missing.tolist() == [5] and evicted == 1  # 0 is resident: only 5 is read
    table.place(missing, slots)
    assert table.policy.clock == clock  # not a use
    assert table.slot_of[1] < 0  # the lowest score went
    admit(table, [2])  # decay alone would evict 0 (score ~2, 5's ~10): 5 is on probation
    assert table.slot_of[5] < 0 and table.slot_of[0] >= 0


def test_a_prefetched_expert_once_used_is_off_probation():
    table = SlotTable(16, "lru")
    table.reset(2)
    admit(table, [0])
    table.place(*table.prefetch(np.array([1]))[:2])
    admit(table, [1])  # used: now the most recent
    admit(table, [2])
    assert table.slot_of[0] < 0 and table.slot_of[1] >= 0


# --- the replay's lookahead ---------------------------------------------------------------------


class CheckedTable(SlotTable):
    def prefetch(self, experts):
        assert (self.slot_of[np.asarray(experts)] < 0).all(), "read ahead a resident expert"
        return super().prefetch(experts)


@pytest.mark.parametrize("policy", ["lru", "decay"])
def test_lookahead_hits_more_where_a_layer_decides_the_next(policy, monkeypatch):
    monkeypatch.setattr(replay_module, "SlotTable", CheckedTable)
    trace, _ = topics()
    without = replay(trace, 12, policy)
    ahead = replay(trace, 12, policy, Lookahead(limit=6, min_score=0.5, min_precision=0.0))
    assert ahead.hit_rate("decode") > without.hit_rate("decode") + 0.3
    assert ahead.precision == 1.0
    # layer 0 cannot be guessed: at most its misses remain
    assert ahead.decode_misses[1:] == [0] * 5
    misses = ahead.lookups["decode"] - ahead.hits["decode"]
    assert ahead.prefetched > 0
    want = (misses + ahead.prefetched) / ahead.decode_tokens
    assert ahead.reads_per_decode_token == pytest.approx(want)
    assert without.prefetched == 0 and without.precision != without.precision


def test_lookahead_on_real_routing_never_reads_ahead_a_resident_expert(monkeypatch):
    monkeypatch.setattr(replay_module, "SlotTable", CheckedTable)
    trace = read_trace(QWEN)
    result = replay(trace, 16, "decay", Lookahead())
    assert result.prefetched > 0 and 0 < result.precision < 1
    assert result.hit_rate("decode") > replay(trace, 16, "decay").hit_rate("decode")
