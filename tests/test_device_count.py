"""A held step's misses counted on the device, its ids read a window at a time
(``CacheTuning.count_on_device``, decode/device_count.py): the text stock's, greedy and sampled,
across misses; the cache's state (counters, every policy's arrays) the one the check that reads
the ids every token leaves; one host read of ids per window of steps found complete."""

import numpy as np
import pytest
from support import load_stock, with_slots
from test_checked_late import ARCHS, arch_paths, assert_same, generated, prompt_of  # noqa: F401

from mlx_lm_streaming.runtime.decode import device_count
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

STEPS = 40


def tuning(on: bool, **more) -> CacheTuning:
    return CacheTuning(verify_choice="always", checked_late=1.0, count_on_device=on, **more)


@pytest.fixture(scope="module")
def stock_q3(q3_path):
    return load_stock(q3_path)[0]


def state(model) -> dict:
    """The cache's counters and each bank's policy arrays and slot table, flushed first."""
    streaming = model.expert_streaming
    streaming.steps.flush()
    cache = streaming.cache
    out = {"hits": cache.stats.hits, "misses": cache.stats.misses}
    for i, bank in enumerate(cache.banks):
        policy = bank.table.policy
        for name in ("last", "score", "stamp", "follows", "after", "probation"):
            value = getattr(policy, name, None)
            if value is not None:
                out[f"{i}.{name}"] = np.array(value)
        out[f"{i}.slot_of"] = np.array(bank.table.slot_of)
    return out


@pytest.mark.parametrize("slots", [8, 15])
@pytest.mark.parametrize("seed", [None, 0])
def test_device_counts_are_stock_and_leave_the_caches_state_as_host_counts_do(
    q3_path, stock_q3, slots, seed
):
    # 8 and 15 of 16 experts a layer: held steps hit and miss; the text and log-probabilities are
    # stock's, the path taken (steps checked late, next tokens taken back, layers run again) and
    # the cache's state are those of the check that reads the ids every token
    prompt = prompt_of(2)
    expected = generated(stock_q3, prompt, seed, steps=STEPS)
    seen = []
    for on in (False, True):
        model = with_slots(q3_path, slots, tuning=tuning(on))
        assert_same(expected, generated(model, prompt, seed, steps=STEPS))
        runner = model.expert_streaming.steps
        seen.append(((runner.checked_late, runner.dropped, runner.replays), state(model)))
        model.expert_streaming.close()
    (path_off, off), (path_on, on) = seen
    assert path_on == path_off and path_on[0] > 0
    assert off.keys() == on.keys() and off["hits"] > 0
    for key in off:
        assert np.array_equal(off[key], on[key]), key


def test_a_window_of_steps_found_complete_reads_its_ids_once(q3_path, stock_q3, monkeypatch):
    # 15 slots of 16: after the first tokens most steps find every expert resident; their ids
    # come back a window at a time (one host read for several steps), and the steps a flush
    # finds outside a computed window read theirs alone
    from mlx_lm_streaming.runtime.decode.verified_step import VerifiedStep

    windows, committed = [], []
    host_ids, commit = device_count.host_ids, VerifiedStep.commit

    def counted_read(array):
        windows.append(array.size)
        return host_ids(array)

    def counted_commit(step, cache, flat=None):
        committed.append(flat is not None)
        return commit(step, cache, flat)

    monkeypatch.setattr(device_count, "host_ids", counted_read)
    monkeypatch.setattr(VerifiedStep, "commit", counted_commit)
    prompt = prompt_of(1)
    expected = generated(stock_q3, prompt, None, steps=2 * STEPS)
    model = with_slots(q3_path, 15, tuning=tuning(True))
    runner = model.expert_streaming.steps
    assert_same(expected, generated(model, prompt, None, steps=2 * STEPS))
    runner.flush()
    in_windows = sum(committed)
    assert windows and in_windows >= 2 * len(windows)
    assert in_windows > len(committed) - in_windows
    assert all(size % device_count.WINDOW == 0 for size in windows)
    model.expert_streaming.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_device_counts_are_stock_across_architectures(arch_paths, arch):
    # hybrids among them (linear attention, Mamba-2 layers), gemma-4's tuple layers, kimi_k3's
    # blocks: 12 slots of 16, held steps hit and miss, sampled, the text stock's and the count used
    path = arch_paths[arch]
    stock, _ = load_stock(path)
    prompt = prompt_of(4)
    expected = generated(stock, prompt, 3, steps=24)
    model = with_slots(path, 12, tuning=tuning(True))
    assert_same(expected, generated(model, prompt, 3, steps=24))
    runner = model.expert_streaming.steps
    assert runner.checked_late > 0 and runner.count_maps is not None
    model.expert_streaming.close()


def test_the_device_count_is_off_unless_said(q3_path):
    model = with_slots(q3_path, 8, tuning=CacheTuning(verify_choice="always", checked_late=1.0))
    runner = model.expert_streaming.steps
    generated(model, prompt_of(2), None, steps=8)
    assert runner.count_on_device is False and not runner.count_window and runner.count_maps is None
    model.expert_streaming.close()


def test_a_routing_recorder_keeps_each_steps_ids_read_at_its_check(q3_path, stock_q3):
    # with a recorder the routing record holds every token once its check ends: no count, no
    # window, the record the default's
    from mlx_lm_streaming.runtime.decode.runner import StepRunner

    prompt = prompt_of(2)
    model = with_slots(q3_path, 15, tuning=tuning(True))
    runner: StepRunner = model.expert_streaming.steps
    model.expert_streaming.cache.recorder = _Recorder()
    assert_same(generated(stock_q3, prompt, None, steps=12), generated(model, prompt, None, 12))
    assert runner.count_maps is None and not runner.count_window and not runner.deferred
    assert model.expert_streaming.cache.recorder.calls > 0
    model.expert_streaming.cache.recorder = None
    model.expert_streaming.close()


class _Recorder:
    calls = 0

    def record(self, bank, ids):
        self.calls += 1
