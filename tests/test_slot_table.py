"""The slot table of one bank (slot_table.py): maps that agree, free slots before least recently used
ones, pinned slots never given up. Pure numpy: no model, no store."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_lm_streaming.slot_table import SlotTable


def table_with(slots, experts, num_experts=8, ticks=None):
    """A table of ``slots`` slots holding ``experts`` in slots 0, 1, ..., used at ``ticks``."""
    table = SlotTable(num_experts, "layers.3.mlp")
    table.reset(slots)
    for i, e in enumerate(experts):
        table.assign([e], [i], ticks[i] if ticks else i + 1)
    return table


def test_reset_empties_the_table():
    table = table_with(3, [5, 6, 7])
    table.reset(2)
    assert table.slots == 2
    assert (table.slot_of == -1).all() and (table.expert_of == -1).all()
    assert (table.last_used == -1).all()


def test_assign_and_free_keep_both_maps_in_step():
    table = table_with(4, [])
    table.assign([5, 2], [1, 3], tick=7)
    assert table.slot_of[[5, 2]].tolist() == [1, 3]
    assert table.expert_of.tolist() == [-1, 5, -1, 2]
    assert table.last_used.tolist() == [-1, 7, -1, 7]
    assert table.free(np.array([0, 1])) == 1  # slot 0 was free: one expert evicted
    assert table.slot_of[5] == -1 and table.expert_of[1] == -1 and table.last_used[1] == -1
    assert table.slot_of[2] == 3


def test_use_stamps_only_resident_experts():
    table = table_with(3, [4, 1], ticks=[1, 2])
    hit = table.use(np.array([1, 6]), tick=9)
    assert hit.tolist() == [True, False]
    assert table.last_used.tolist() == [1, 9, -1]


def test_victims_are_free_slots_first_in_slot_order():
    table = table_with(5, [0, 1, 2])  # slots 3 and 4 free
    assert table.victims(2).tolist() == [3, 4]
    # then the least recently used
    assert table.victims(3).tolist() == [3, 4, 0]


def test_victims_are_least_recently_used_lowest_slot_among_equals():
    table = table_with(4, [0, 1, 2, 3], ticks=[5, 2, 2, 9])
    assert table.victims(1).tolist() == [1]
    assert table.victims(3).tolist() == [1, 2, 0]


def test_pinned_experts_keep_their_slots():
    table = table_with(4, [0, 1, 2, 3], ticks=[1, 2, 3, 4])
    assert table.victims(2, pinned=[0, 2, 7]).tolist() == [1, 3]  # 7 is not resident: no effect


def test_too_few_unpinned_slots_is_an_error_naming_the_layer():
    table = table_with(3, [0, 1, 2])
    with pytest.raises(ValueError, match="layers.3.mlp: 2 experts to read but fewer slots"):
        table.victims(2, pinned=[0, 1])
    assert table.expert_of.tolist() == [0, 1, 2]  # nothing freed


calls = st.lists(
    st.tuples(
        st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True),  # experts of a call
        st.lists(st.integers(0, 11), max_size=3, unique=True),  # kept
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(slots=st.integers(4, 8), calls=calls)
def test_a_run_of_calls_keeps_the_table_consistent(slots, calls):
    """Calls as ``LayerBank.load`` makes them: resident experts are used, missing ones take the
    victims; pinned (the call's and kept) experts never move; victims are free slots while there
    are any, else the least recently used of the others; the maps always agree."""
    table = SlotTable(12)
    table.reset(slots)
    for tick, (experts, keep) in enumerate(calls, start=1):
        experts = np.array(experts, dtype=np.int64)
        before = table.slot_of.copy()
        used_before = table.last_used.copy()
        hit = table.use(experts, tick)
        missing = experts[~hit]
        pinned = np.concatenate([experts, np.array(keep, dtype=np.int64)])
        held = {int(before[e]) for e in pinned if before[e] >= 0}
        if len(missing) > slots - len(held):
            with pytest.raises(ValueError):
                table.victims(len(missing), pinned)
            continue
        victims = table.victims(len(missing), pinned)
        assert len(set(victims.tolist())) == len(missing)
        assert not held & set(victims.tolist())
        free = [s for s in range(slots) if table.expert_of[s] < 0]
        if len(free) >= len(missing):
            assert victims.tolist() == free[: len(missing)]
        else:
            taken = [s for s in victims.tolist() if table.expert_of[s] >= 0]
            others = [
                s
                for s in range(slots)
                if table.expert_of[s] >= 0 and s not in held and s not in victims.tolist()
            ]
            assert max(used_before[taken]) <= min(used_before[others], default=tick)
        resident = int((table.slot_of >= 0).sum())
        evicted = table.free(victims)
        assert evicted == resident - int((table.slot_of >= 0).sum())
        assert (table.expert_of[victims] == -1).all() and (table.last_used[victims] == -1).all()
        table.assign(missing, victims, tick)
        for e in pinned.tolist():
            if before[e] >= 0:
                assert table.slot_of[e] == before[e]
        assert (table.slot_of[experts] >= 0).all()
        for s, e in enumerate(table.expert_of.tolist()):
            assert e < 0 or table.slot_of[e] == s
        for e in np.nonzero(table.slot_of >= 0)[0].tolist():
            assert table.expert_of[table.slot_of[e]] == e
