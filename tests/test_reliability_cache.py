"""Memory bound and slot safety of the expert cache, driven by random routing (hypothesis).

``ExpertCache`` / ``LayerBank`` over a fake store whose bytes say which expert they belong to: after every
load the experts asked for are resident with their own bytes, the experts already resident when the call
began (pinned) keep their slots, the banks' arrays never hold more than the budget, and a read that fails
leaves the bank consistent. Then the real ``StreamingSwitchGLU``: waves never exceed the slots and the
logits stay exactly the stock ones.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import load_stock, load_streaming

from mlx_lm_streaming.errors import ConfigurationError, ExpertIOError
from mlx_lm_streaming.option_table import GB
from mlx_lm_streaming.runtime.bank import LayerBank
from mlx_lm_streaming.runtime.memory.expert_cache import ExpertCache
from mlx_lm_streaming.runtime.policy import DEFAULT_POLICY, POLICIES
from mlx_lm_streaming.runtime.reads.index import LayerExperts, PartSpec
from mlx_lm_streaming.runtime.reads.safetensors_header import TensorRef
from mlx_lm_streaming.stores.base import ExpertStore
from synthetic import build_checkpoint

PARTS = [("gate_proj", "weight", 6), ("up_proj", "weight", 6), ("down_proj", "scales", 3)]


def expected_bytes(layer_no: int, expert: int, part_no: int, n: int) -> np.ndarray:
    """What the fake checkpoint holds for one part of one expert: unique per (layer, expert, part)."""
    return ((np.arange(n) * 7 + layer_no * 101 + expert * 13 + part_no * 29) % 251).astype(np.uint8)


class PatternStore(ExpertStore):
    """Serves ``expected_bytes``; raises ``ExpertIOError`` for the next ``fail`` batches."""

    name = "pattern"

    def __init__(self):
        self.fail = 0
        self.batches = 0
        super().__init__(files=None)

    def read_many(self, jobs):
        self.batches += 1
        if self.fail:
            self.fail -= 1
            # part of the batch is written before the error, as a thread pool would
            for ref, out in jobs[: len(jobs) // 2]:
                out[:] = b"\xee" * len(out)
            raise ExpertIOError("/fake/model.safetensors: injected EIO")
        for ref, out in jobs:
            layer_no, expert, part_no = ref.offset
            out[:] = expected_bytes(layer_no, expert, part_no, ref.nbytes).tobytes()


def make_layer(layer_no: int, num_experts: int) -> LayerExperts:
    parts = [PartSpec(proj, part, "U8", (n,)) for proj, part, n in PARTS]
    refs = [
        [
            # the offset field carries (layer, expert, part) for the fake store
            TensorRef(Path("/fake/model.safetensors"), f"layers.{layer_no}.{proj}.{part}",
                      (layer_no, e, i), n, "U8", (n,))
            for e in range(num_experts)
        ]
        for i, (proj, part, n) in enumerate(PARTS)
    ]
    return LayerExperts(f"layers.{layer_no}", num_experts, parts, refs)


def make_cache(experts_per_layer, budget_bytes, policy=DEFAULT_POLICY):
    store = PatternStore()
    cache = ExpertCache(store, budget_bytes, policy=policy)
    banks = []
    for layer_no, num_experts in enumerate(experts_per_layer):
        glu = {proj: {} for proj, _, _ in PARTS}
        banks.append(cache.register(make_layer(layer_no, num_experts), glu))
    return cache, store, banks


def check_bank(bank: LayerBank, layer_no: int):
    """slot_of and expert_of agree, and every resident expert's slot holds that expert's bytes."""
    arrays = [np.array(bank.array(proj, part)) for proj, part, _ in PARTS]
    for slot, expert in enumerate(bank.expert_of.tolist()):
        if expert >= 0:
            assert bank.slot_of[expert] == slot, (layer_no, slot, expert)
    for expert in np.nonzero(bank.slot_of >= 0)[0].tolist():
        slot = int(bank.slot_of[expert])
        assert bank.expert_of[slot] == expert
        for part_no, (_, _, n) in enumerate(PARTS):
            assert np.array_equal(arrays[part_no][slot], expected_bytes(layer_no, expert, part_no, n))


def bank_bytes(banks) -> int:
    return sum(b.array(proj, part).nbytes for b in banks for proj, part, _ in PARTS)


EXPERT_BYTES = sum(n for _, _, n in PARTS)


@st.composite
def scenarios(draw):
    experts_per_layer = draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
    per_slot = EXPERT_BYTES * len(experts_per_layer)
    # budgets from one slot per layer to more than every expert
    budget = draw(st.integers(per_slot, per_slot * (max(experts_per_layer) + 2)))
    slots = min(budget // per_slot, max(experts_per_layer))
    calls = []
    for _ in range(draw(st.integers(1, 40))):
        layer_no = draw(st.integers(0, len(experts_per_layer) - 1))
        n = experts_per_layer[layer_no]
        k = draw(st.integers(1, min(slots, n)))
        experts = draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True))
        fail = draw(st.integers(0, 9)) == 0  # one read in ten fails
        calls.append((layer_no, experts, fail))
    return experts_per_layer, budget, calls, draw(st.sampled_from(sorted(POLICIES)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_routing_respects_budget_and_pins(scenario):
    experts_per_layer, budget, calls, policy = scenario
    cache, store, banks = make_cache(experts_per_layer, budget, policy)
    cache.ensure_planned()
    assert bank_bytes(banks) <= budget and cache.resident_bytes <= budget
    for layer_no, experts, fail in calls:
        bank = banks[layer_no]
        before = {e: int(bank.slot_of[e]) for e in experts if bank.slot_of[e] >= 0}
        ask = np.array(experts, dtype=np.int64)
        fail = fail and len(before) < len(experts)  # all resident: nothing is read
        store.fail = int(fail)
        if fail:
            with pytest.raises(ExpertIOError):
                bank.load(ask)
        else:
            bank.load(ask)
            # every expert asked for is resident; those resident before (pinned) did not move
            assert (bank.slot_of[ask] >= 0).all()
            assert len(set(bank.slot_of[ask].tolist())) == len(experts)
            for e, slot in before.items():
                assert bank.slot_of[e] == slot, f"pinned expert {e} was evicted"
        check_bank(bank, layer_no)
        assert bank_bytes(banks) <= budget
        assert cache.resident_bytes <= budget


def test_failed_read_leaves_no_stale_slot():
    """A read that fails after evicting must not leave slots naming the evicted experts: a later call
    would otherwise clear the mapping of an expert it pinned (slot id -1 handed to the kernel)."""
    cache, store, (bank,) = make_cache([6], 3 * EXPERT_BYTES)
    cache.ensure_planned()
    bank.load(np.array([0, 1]))  # slots 0, 1
    bank.load(np.array([2]))  # slot 2
    store.fail = 1
    with pytest.raises(ExpertIOError):
        bank.load(np.array([3, 4]))  # evicts 0 and 1, then the read fails
    bank.load(np.array([1]))  # into the least recently used slot
    bank.load(np.array([1, 5]))  # 1 is pinned; 5 takes a free or LRU slot
    assert (bank.slot_of[[1, 5]] >= 0).all()
    check_bank(bank, 0)


def test_budget_below_one_slot_is_refused():
    cache, _, _ = make_cache([4, 4], 2 * EXPERT_BYTES - 1)
    with pytest.raises(ConfigurationError, match="below the minimum"):
        cache.ensure_planned()


def test_more_experts_than_slots_in_one_load_is_refused():
    cache, _, (bank,) = make_cache([8], 2 * EXPERT_BYTES)
    with pytest.raises(ValueError, match="2 slots"):
        bank.load(np.array([0, 1, 2]))


# --- the real StreamingSwitchGLU: waves ---------------------------------------------------------


@pytest.fixture(scope="module")
def wave_checkpoint(tmp_path_factory):
    """A 16-expert checkpoint, its stock model and vocabulary, and the bytes of a slot per layer."""
    path = build_checkpoint(
        tmp_path_factory.mktemp("waves") / "q3", "qwen3_moe", "affine4", overrides={"experts": 16}
    )
    stock, config = load_stock(path)
    probe, _ = load_streaming(path)
    per_slot = sum(b.layer.expert_nbytes for b in probe.expert_streaming.cache.banks)
    return path, stock, config["vocab_size"], per_slot


def load_slots(path, per_slot: int, slots: int):
    """A streaming model of ``slots`` slots per layer."""
    model, _ = load_streaming(path, expert_cache_gb=(slots * per_slot + 0.5) / GB)
    model.expert_streaming.cache.ensure_planned()
    assert all(b.slots == slots for b in model.expert_streaming.cache.banks)
    return model


@pytest.fixture(scope="module")
def wave_models(wave_checkpoint):
    """Stock model, and streaming models of 1..16 slots per layer, of a 16-expert checkpoint."""
    path, stock, vocab, per_slot = wave_checkpoint
    models = {slots: load_slots(path, per_slot, slots) for slots in (1, 2, 3, 5, 8, 16)}
    return stock, vocab, models


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    slots=st.sampled_from([1, 2, 3, 5, 8, 16]),
    tokens=st.lists(st.integers(0, 511), min_size=1, max_size=40),
    batch=st.integers(1, 2),
)
def test_waves_never_exceed_slots_and_stay_exact(wave_models, slots, tokens, batch):
    stock, vocab, models = wave_models
    x = mx.array([tokens] * batch) if batch == 1 else mx.array([tokens, tokens[::-1]])
    check_call(models[slots], stock, x)


def check_call(model, stock, x) -> list:
    """One call of ``model`` on ``x``: no load asks for more experts than the bank has slots, pinned
    and kept experts keep their slots, the logits are stock's and the banks stay within the budget.
    Returns the loads' (experts, slots)."""
    sizes = []
    banks = model.expert_streaming.cache.banks
    steps = model.expert_streaming.cache.steps
    verified, again = steps.verified, steps.replays + steps.recomputed
    loads = {}
    for bank in banks:  # every load starts with ``reads`` (``load`` too); its landings end it
        loads[bank] = bank.reads

        def recording(experts, keep=(), bank=bank, **kw):
            sizes.append((len(experts), bank.slots))
            pinned = list(experts.tolist()) + [int(e) for e in keep]
            before = {e: int(bank.slot_of[e]) for e in pinned if bank.slot_of[e] >= 0}
            landings = loads[bank](experts, keep, **kw)

            def checked():
                yield from landings
                for e, slot in before.items():
                    assert bank.slot_of[e] == slot, "pinned or kept expert moved"
                assert (bank.slot_of[experts] >= 0).all()

            return checked()

        bank.reads = recording
    try:
        got = model(x)
    finally:
        for bank in banks:
            del bank.reads
    # a call loads nothing only where its layers skip the host sync: banks holding every expert
    # (complete), or a verified step that found every expert it used resident (no layer run again)
    clean_step = steps.verified > verified and steps.replays + steps.recomputed == again
    assert sizes or clean_step or all(b.complete for b in banks)
    assert all(n <= s for n, s in sizes), sizes
    assert mx.array_equal(got, stock(x)).item()
    cache = model.expert_streaming.cache
    assert cache.resident_bytes <= cache.budget_bytes
    return sizes


def test_a_verified_step_that_hits_everywhere_loads_nothing(wave_checkpoint):
    """The same token again and again: once the running share of layers that missed is low enough,
    the call is a verified step that finds its experts resident and loads nothing, while the banks
    are not complete. Which calls those are depends on the model's history (and, for identity
    banks, on how far the background fill got), so the property test above met this case only now
    and then, and its replay of the case passed: hypothesis' "Failed to reproduce"."""
    path, stock, vocab, per_slot = wave_checkpoint
    model = load_slots(path, per_slot, 5)
    loads = [check_call(model, stock, mx.array([[3]])) for _ in range(20)]
    assert loads[0] and not loads[-1]
    assert not any(b.complete for b in model.expert_streaming.cache.banks)
    # an identity bank (16 slots) while the background fill completes it
    model = load_slots(path, per_slot, 16)
    for _ in range(20):
        check_call(model, stock, mx.array([[3]]))
