"""Layer-major prefill at small expert counts (issue 40): what a long prompt and the steps after it
read, against what they must read, and their bits against stock's.

The case: a 97-token prompt, its first 96 tokens prefilled in 6 chunks of 16, 4 experts of each
layer cached, the cache empty at the start. The prefill must read each expert of every layer at
most once over layer sets (issue 47: every routed expert's bytes), each expert its chunks use once
in waves through the slots;
the last prompt token's own step (stock's, with the logits) and each decode step after it must read
the experts they use that the banks lack then, and nothing else, whether steps are chosen as on
the CPU (per layer after misses) or as on a GPU (verified steps whatever the misses). Bytes are
counted by the store.
"""

import sys
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from support import load_stock, load_streaming

from mlx_lm_streaming.runtime.decode import share_limits
from mlx_lm_streaming.runtime.decode.runner import StepRunner
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from mlx_lm_streaming.tools.parity import budget_of_slots, difference
from synthetic import build_checkpoint

CASES = {
    "qwen3_moe": {"experts": 16, "top_k": 4},
    "mixtral": {},  # 8 experts, top-2
    "deepseek_v3": {},  # 8 routed experts, top-2, a shared one; layer 0 dense
}
LAYERS = 4
SLOTS = 4
STEP = 16
DECODE = 4  # decode steps after the prompt's
# two prompts of 97 tokens: where the banks lack experts the last token's step uses in most
# layers, and in few
PROMPTS = [
    [(7 * seed + 13 * i * i + 5 * i) % 512 for i in range(6 * STEP + 1)] for seed in (3, 4)
]


@pytest.fixture(scope="module")
def small_experts(tmp_path_factory):
    built = {}

    def get(arch):
        if arch not in built:
            path = tmp_path_factory.mktemp("lm") / arch
            built[arch] = build_checkpoint(path, arch, num_layers=LAYERS, overrides=CASES[arch])
        return built[arch]

    return get


class Used:
    """A routing recorder: the distinct experts each bank was asked for since ``start``."""

    def __init__(self):
        self.start()

    def start(self):
        self.used = {}

    def record(self, bank, ids):
        self.used.setdefault(id(bank), set()).update(np.asarray(ids).reshape(-1).tolist())

    def close(self):
        pass


def _resident(banks):
    return {id(b): set(np.nonzero(b.slot_of >= 0)[0].tolist()) for b in banks}


def _lacking(banks, used, resident) -> int:
    """Bytes of the experts in ``used`` that ``resident`` did not hold."""
    return sum(len(used.get(id(b), set()) - resident[id(b)]) * b.layer.expert_nbytes for b in banks)


def run(path, generate_step, prompt, monkeypatch, tuning=None):
    """The prompt and ``DECODE`` decode steps through ``generate_step`` over a streaming model with
    ``SLOTS`` experts per layer: per part (the prefill, then each model call after it), the bytes
    read and the bytes it must read; per model call the layers run again; the log-probabilities;
    every routed expert's bytes."""
    probe, _ = load_streaming(path)
    budget = budget_of_slots(probe, SLOTS)
    probe.expert_streaming.close()
    # each model call checked in itself (not one token late, checked_late.py): its reads are its own
    sets = tuning is None or tuning.layer_sets
    tuning = replace(tuning or CacheTuning(), checked_late=None)
    model, _ = load_streaming(path, expert_cache_gb=budget, tuning=tuning, layer_major_prefill=True)
    state = model.expert_streaming
    cache, store = state.cache, state.cache.store
    banks = cache.banks
    cache.recorder = used = Used()
    parts = []  # (bytes read, bytes it must read)
    again = []  # per model call after the prefill: the layers it ran again (verified steps)
    at = {"read": 0, "resident": _resident(banks)}

    def close_part():
        read = store.stats.bytes_read
        parts.append((read - at["read"], _lacking(banks, used.used, at["resident"])))
        at["read"], at["resident"] = read, _resident(banks)
        used.start()

    def progress(done, total):
        if done == total - 1 and not parts:  # the prefill's end (the last token is stock's)
            close_part()

    real = StepRunner.__call__

    def model_call(runner, call, args, kwargs):
        replays = runner.replays
        out = real(runner, call, args, kwargs)
        runner.flush()  # (a verified step's routing record: at its host work)
        close_part()
        again.append(runner.replays - replays)
        return out

    monkeypatch.setattr(StepRunner, "__call__", model_call)
    steps = generate_step(prompt, model, max_tokens=DECODE, prefill_step_size=STEP,
                          prompt_progress_callback=progress)  # fmt: skip
    out = [lp for _, lp in steps]
    mx.eval(out)
    monkeypatch.undo()
    assert (state.prefill.prompts, state.prefill.fallbacks) == (1, 0)
    if sets:  # every layer over its whole set, read once; the last one's output is not
        # computed (stock's prefill evaluates only the cache entries): no set
        assert state.prefill.waves_why is None, state.prefill.waves_why
        assert state.prefill.set_experts_read == sum(b.num_experts for b in banks[:-1])
    else:
        assert state.prefill.set_experts_read == 0 and "turned off" in state.prefill.waves_why
    every = cache.total_expert_bytes
    state.close()
    return parts, again, out, every


@pytest.mark.parametrize("sets", [True, False], ids=["layer_sets", "waves"])
@pytest.mark.parametrize("limits", ["cpu", "gpu"])
@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
@pytest.mark.parametrize("arch", list(CASES))
def test_layer_major_prefill_reads_each_uncached_expert_once(small_experts, arch, prompt, limits,
                                                             sets, monkeypatch):
    import mlx_lm.generate  # noqa: F401 (mlx_lm's __init__ shadows the name with a function)

    generate = sys.modules["mlx_lm.generate"]
    if limits == "gpu":  # a GPU's choice of steps: verified whatever the misses (read together)
        monkeypatch.setattr(share_limits, "MAX_MISSED_SHARE", {})
        monkeypatch.setattr(share_limits, "CLEAN_TOKEN_RETRIES", {})
    path = small_experts(arch)
    prompt = mx.array(PROMPTS[prompt])
    tuning = None if sets else replace(CacheTuning(), layer_sets=False)
    parts, again, out, every = run(path, generate.generate_step, prompt, monkeypatch, tuning)
    every = every if sets else None
    (prefill_read, must), (last_read, last_lacks), *decode = parts
    assert must > 0 and last_lacks + sum(lacks for _, lacks in decode) > 0, parts
    # the prefill: each expert of every layer once at most (each layer over its whole set: the
    # experts the cache held copied from its banks, not read), or where the layers go in waves
    # through the slots each expert the chunks use once
    if every is None:
        assert prefill_read <= 1.05 * must, (arch, prefill_read / must)
    else:
        assert prefill_read <= every, (arch, prefill_read / every)
        must = every
    # the last prompt token's step and the decode steps: the experts they lack, no more (a
    # verified step's guesses made on a wrong input are not read while they score badly)
    assert all(read == lacks for read, lacks in parts[1:]), parts
    # the last token's step, whose banks keep only the prompt's last waves, runs per layer: one
    # forward, no layer run again after a miss
    assert again[0] == 0, again
    total = prefill_read + last_read
    assert total <= 1.05 * must + last_lacks, (arch, total / must)
    stock, _ = load_stock(path)
    ref = [lp for _, lp in generate.generate_step.stock(prompt, stock, max_tokens=DECODE,
                                                        prefill_step_size=STEP)]  # fmt: skip
    assert difference(ref, out) is None, (arch, difference(ref, out))


def _with_slots(path, **options):
    """A streamed model of ``path`` whose budget holds ``SLOTS`` experts a layer."""
    probe, _ = load_streaming(path)
    budget = budget_of_slots(probe, SLOTS)
    probe.expert_streaming.close()
    return load_streaming(path, expert_cache_gb=budget, **options)[0]


def _stock_steps(path, prompt):
    import mlx_lm.generate  # noqa: F401

    generate = sys.modules["mlx_lm.generate"]
    stock, _ = load_stock(path)
    return [lp for _, lp in generate.generate_step.stock(prompt, stock, max_tokens=DECODE,
                                                          prefill_step_size=STEP)]  # fmt: skip


def _streamed_steps(model, prompt):
    import mlx_lm.generate  # noqa: F401

    generate = sys.modules["mlx_lm.generate"]
    out = [lp for _, lp in generate.generate_step(prompt, model, max_tokens=DECODE,
                                                  prefill_step_size=STEP)]  # fmt: skip
    mx.eval(out)
    return out


def test_layer_sets_are_said_at_load_counted_and_leave_the_slots_full(small_experts):
    # the load line says what two layers' sets take beside the budget; after the prompt each
    # slot bank holds the experts the prompt used most there (given from the set, not read), the
    # stats line says what the sets did, and the tokens are stock's
    from mlx_lm_streaming.runtime.memory import report
    from mlx_lm_streaming.runtime.sizes import decimal_gb

    path = small_experts("qwen3_moe")
    prompt = mx.array(PROMPTS[0])
    model = _with_slots(path, stats=True)  # (auto: on)
    state = model.expert_streaming
    cache = state.cache
    one_set = max(b.num_experts * b.layer.expert_nbytes for b in cache.banks)
    line = report.choice_line(state)
    assert f"long prompts a layer's whole expert set at a time, {decimal_gb(2 * one_set)}" in line
    used = Used()
    cache.recorder = used
    out = _streamed_steps(model, prompt)
    assert difference(_stock_steps(path, prompt), out) is None
    p = state.prefill
    assert (p.prompts, p.set_bytes, p.waves_why) == (1, 2 * one_set, None)
    # every layer's set but the last's (its MoE output is not computed, as in stock's prefill)
    sets = (LAYERS - 1) * CASES["qwen3_moe"]["experts"]
    assert p.set_experts_read + p.set_experts_copied == sets
    assert p.set_kept >= (LAYERS - 1) * SLOTS  # each such slot bank given its most used
    stats = report.stats_line(state)
    assert "each layer over its whole expert set" in stats and decimal_gb(2 * one_set) in stats
    state.close()


def test_a_layers_uses_are_counted_by_mlx_as_from_the_ids_on_the_host(small_experts, monkeypatch):
    # with no routing recorder a layer's uses per expert are counted by MLX (a scatter-add: the
    # host reads one small array a layer, not the ids, whose pages on mlx-cuda would move); the
    # counts each slot bank keeps by are those of the ids read on the host, as a recorder's are
    from mlx_lm_streaming.runtime.bank import LayerSets
    from mlx_lm_streaming.runtime.bank.layer_set import expert_counts

    ids = [mx.array(np.random.default_rng(7).integers(0, 16, (5, 3, 4)), dtype=mx.uint32)] * 2
    flat = np.concatenate([np.array(i).reshape(-1) for i in ids])
    assert np.array_equal(np.array(expert_counts(ids, 16)), np.bincount(flat, minlength=16))
    seen = []
    done = LayerSets.done
    def recorded(self, layer_set, uses):
        seen.append((layer_set.bank.path, uses.copy()))
        return done(self, layer_set, uses)

    monkeypatch.setattr(LayerSets, "done", recorded)
    path = small_experts("qwen3_moe")
    runs = []
    for recorder in (None, Used()):
        model = _with_slots(path)
        model.expert_streaming.cache.recorder = recorder
        seen.clear()
        _streamed_steps(model, mx.array(PROMPTS[0]))
        runs.append(list(seen))
        model.expert_streaming.close()
    assert len(runs[0]) == LAYERS - 1 and all(u.sum() > 0 for _, u in runs[0])
    assert [p for p, _ in runs[0]] == [p for p, _ in runs[1]]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(*runs))


def test_the_second_set_is_made_while_the_first_layers_fill_runs(small_experts, monkeypatch):
    # a prompt's first layer: the other set's memory is made before waiting for the first set's
    # fill (on the H200 the second set's allocation came after it: ~20 ms more to the first token)
    from mlx_lm_streaming.runtime.bank import LayerSets
    from mlx_lm_streaming.runtime.bank.layer_set import LayerSet, set_bytes

    events = []
    allocate, ready = LayerSet.allocate, LayerSet.ready
    monkeypatch.setattr(
        LayerSet, "allocate", lambda s, b: events.append(("allocate", s)) or allocate(s, b)
    )  # fmt: skip
    monkeypatch.setattr(
        LayerSet, "ready", lambda s: (events.append(("wait", s)) if s.future else None) or ready(s)
    )  # fmt: skip
    model = _with_slots(small_experts("qwen3_moe"))
    cache = model.expert_streaming.cache
    sets = LayerSets(cache, 2 * set_bytes(cache.banks[0]))
    first = sets.take(cache.banks[0], cache.banks[1])
    second = next(s for s in sets.sets if s is not first)
    assert events.index(("allocate", second)) < events.index(("wait", first)), events
    assert second.bank is cache.banks[1]
    sets.release()
    model.expert_streaming.close()


def test_layer_sets_that_do_not_fit_go_in_waves_said_at_load(small_experts, monkeypatch):
    # two layers' sets beyond this machine's memory beside the resident weights and the budget:
    # the load line says so and why, the prompt goes through the slots in waves, stock's tokens
    from mlx_lm_streaming.runtime.memory import machine as memory, report

    path = small_experts("mixtral")
    prompt = mx.array(PROMPTS[1])
    model = _with_slots(path)
    state = model.expert_streaming
    cache = state.cache
    slots = sum(n * b.layer.expert_nbytes for n, b in zip(cache.plan_slots(), cache.banks))
    one_set = max(b.num_experts * b.layer.expert_nbytes for b in cache.banks)
    # room for the weights, the slots and one set, not two
    room = state.resident_bytes + slots + one_set
    monkeypatch.setattr(memory, "budget_base", lambda: (room, 0.5, "memory"))
    line = report.choice_line(state)
    assert "long prompts layer by layer in waves through the slots (two layers' experts" in line
    out = _streamed_steps(model, prompt)
    assert difference(_stock_steps(path, prompt), out) is None
    p = state.prefill
    assert p.prompts == 1 and p.set_experts_read == 0 and "do not fit" in p.waves_why
    assert "in waves through the slots: two layers' experts" in report.stats_line(state)
    state.close()


@pytest.mark.parametrize("direct_reads", [True, False], ids=["host_copies", "mlx_copies"])
def test_layer_sets_copy_what_the_cache_holds(small_experts, direct_reads, monkeypatch):
    # a second prompt finds the slot banks holding the first one's most used experts: its sets
    # take them from the banks (through host views, or by an MLX update where the banks have none)
    # instead of reading them, and its tokens are still stock's; an MLX update that left the
    # sets' memory where it was remakes no host view (a view's check writes from the host: on
    # mlx-cuda, where the sets' held experts are copied so, a page migrated out and back)
    from mlx_lm_streaming.runtime.bank import layer_set

    checked = []
    real = layer_set.host_bytes
    monkeypatch.setattr(layer_set, "host_bytes", lambda *a: checked.append(1) or real(*a))
    path = small_experts("qwen3_moe")
    model = _with_slots(path, direct_reads=direct_reads)
    state = model.expert_streaming
    _streamed_steps(model, mx.array(PROMPTS[0]))
    p = state.prefill
    read, copied = p.set_experts_read, p.set_experts_copied
    assert copied == 0  # (the cache started empty)
    second = mx.array(PROMPTS[1])
    checked.clear()
    out = _streamed_steps(model, second)
    assert difference(_stock_steps(path, second), out) is None
    parts = len(state.cache.banks[0].layer.parts)
    assert len(checked) == 2 * parts, checked  # each set's views made once, at its allocation
    sets = (LAYERS - 1) * CASES["qwen3_moe"]["experts"]
    assert p.set_experts_copied >= (LAYERS - 1) * SLOTS
    assert p.set_experts_read - read == sets - p.set_experts_copied
    state.close()


def test_layer_sets_wait_for_compute_once_a_layer(small_experts, monkeypatch):
    # a layer's chunks are submitted one after another (mx.async_eval) and waited for once, at
    # the layer's end: no host sync between a layer's chunks that leaves the device idle while
    # the host builds the next chunk's graph; the tokens are stock's
    from mlx_lm_streaming.runtime.prefill import set_pass

    calls = {"eval": 0, "async_eval": 0}

    class CountingMx:
        def __getattr__(self, name):
            if name in calls:
                calls[name] += 1
            return getattr(mx, name)

    path = small_experts("qwen3_moe")
    prompt = mx.array(PROMPTS[0])
    model = _with_slots(path)
    monkeypatch.setattr(set_pass, "mx", CountingMx())
    out = _streamed_steps(model, prompt)
    monkeypatch.undo()
    assert difference(_stock_steps(path, prompt), out) is None
    p = model.expert_streaming.prefill
    assert (p.prompts, p.groups, p.waves_why) == (1, 1, None)
    assert calls == {"eval": LAYERS, "async_eval": LAYERS * p.chunks}, (calls, p.chunks)
    model.expert_streaming.close()


class HostCopier:
    """``cuda_copy.SlotCopier``'s contract on the host (the CPU backend, whose arrays' memory is
    the host's): each call's ranges read into buffers of its own, then copied to their addresses."""

    def __init__(self):
        self.calls = 0

    def read(self, read_ranges, pieces):
        import ctypes

        buffers = [np.empty(ref.nbytes, dtype=np.uint8) for ref, _ in pieces]
        read_ranges([(ref, memoryview(b)) for (ref, _), b in zip(pieces, buffers)])
        for (ref, address), b in zip(pieces, buffers):
            ctypes.memmove(address, b.ctypes.data, ref.nbytes)
        self.calls += 1


def test_layer_sets_filled_the_way_of_device_copies(small_experts, monkeypatch):
    # the way mlx-cuda fills a set (each reader's page-locked buffer, then a device copy:
    # cuda_copy; the experts the slot banks hold copied by an MLX update), taken here by a host
    # copier with the same contract: every expert in its row, the tokens stock's
    from mlx_lm_streaming.runtime.bank import cuda_copy

    copier = HostCopier()
    monkeypatch.setattr(cuda_copy, "copier_for", lambda addresses: copier)
    path = small_experts("qwen3_moe")
    model = _with_slots(path)
    p = model.expert_streaming.prefill
    for prompt in PROMPTS:
        out = _streamed_steps(model, mx.array(prompt))
        assert difference(_stock_steps(path, mx.array(prompt)), out) is None
    assert p.set_experts_read > 0 and p.set_experts_copied > 0 and copier.calls > 0
    model.expert_streaming.close()


@pytest.mark.parametrize("kind", ["device", "host"])
def test_layer_sets_filled_through_a_stage(small_experts, monkeypatch, kind):
    # CacheTuning.set_stage: the readers' copies go into a stage ("device": device memory outside
    # MLX, cudaMalloc; "host": page-locked host memory the readers read into, cudaHostAlloc; both
    # host memory here) while the layer before computes, and the experts read are moved into the
    # set, a copy per part and run of experts, when the set's layer starts: the tokens stock's,
    # the stage one set's bytes, freed with the sets at the prompt's end
    from test_cuda_copy import HostRuntime, Managed

    from mlx_lm_streaming.runtime.bank import cuda_copy
    from mlx_lm_streaming.runtime.bank.layer_set import set_bytes
    from mlx_lm_streaming.runtime.memory import machine

    runtime = HostRuntime()
    copier = Managed(runtime, buffer_bytes=20_000)
    monkeypatch.setattr(cuda_copy, "copier_for", lambda addresses: copier)
    monkeypatch.setattr(machine, "staged_sets", lambda c: c.tuning.set_stage == "device")
    moved = []
    move = cuda_copy.DeviceStage.move
    monkeypatch.setattr(cuda_copy.DeviceStage, "move", lambda s, c: (moved.append(c), move(s, c)))
    path = small_experts("qwen3_moe")
    model = _with_slots(path, tuning=CacheTuning(set_stage=kind))
    cache, p = model.expert_streaming.cache, model.expert_streaming.prefill
    for prompt in PROMPTS:
        out = _streamed_steps(model, mx.array(prompt))
        assert difference(_stock_steps(path, mx.array(prompt)), out) is None
        _slots_hold_their_experts(cache)
    assert p.set_experts_read > 0 and moved
    assert p.set_kept >= (LAYERS - 1) * SLOTS  # (each slot's bytes checked above)
    stage_bytes = set_bytes(cache.banks[0])
    if kind == "device":
        assert [n for _, n in runtime.device] == [stage_bytes] * len(PROMPTS)
        assert runtime.device_freed == len(PROMPTS)
    else:  # (the copier's own buffers are 20,000 bytes)
        stages = [at for at, b in runtime.held.items() if len(b) == stage_bytes]
        assert len(stages) == len(PROMPTS) and runtime.device == []
        assert set(stages) <= set(runtime.freed_pointers)
    # each move's copies: a part's run of experts, inside the stage
    parts = len(cache.banks[0].layer.parts)
    for copies in moved:
        assert len(copies) % parts == 0
        assert all(0 <= at and at + n <= stage_bytes for _, at, n in copies)
    model.expert_streaming.close()


def _slots_hold_their_experts(cache):
    """Each slot that names an expert holds the checkpoint's bytes of it, part by part."""
    for bank in cache.banks:
        for e in np.nonzero(bank.slot_of >= 0)[0].tolist():
            slot = int(bank.slot_of[e])
            for part, ref in zip(bank.layer.parts, bank.layer.refs(e)):
                want = bytearray(ref.nbytes)
                cache.store.read_many([(ref, memoryview(want))])
                got = bank.array(part.proj, part.part)[slot]
                assert np.array(got.view(mx.uint8)).tobytes() == bytes(want), (bank.path, e)


def test_a_stage_of_another_kind_is_refused_in_one_line():
    from mlx_lm_streaming.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"set_stage='gpu': one of None, 'device', 'host'"):
        CacheTuning(set_stage="gpu")


def test_the_memory_check_counts_the_stage_with_the_sets(small_experts, monkeypatch):
    # where a stage is made (set_stage on mlx-cuda), the bytes a long prompt takes beside the
    # budget are three sets', not two, and the load line says so; off, or where it does not
    # apply (the CPU), two
    from mlx_lm_streaming.runtime.bank.layer_set import LayerSets, set_bytes
    from mlx_lm_streaming.runtime.memory import machine, report
    from mlx_lm_streaming.runtime.sizes import decimal_gb

    model = _with_slots(small_experts("qwen3_moe"), tuning=CacheTuning(set_stage="device"))
    state = model.expert_streaming
    cache = state.cache
    one = set_bytes(cache.banks[0])
    assert machine.layer_sets_fit(cache, state.resident_bytes) == (2 * one, None)
    monkeypatch.setattr(machine, "staged_sets", lambda c: c.tuning.set_stage == "device")
    assert machine.layer_sets_fit(cache, state.resident_bytes) == (3 * one, None)
    assert (
        f"set at a time, {decimal_gb(3 * one)} for two and a stage on the device beside the budget"
        in report.choice_line(state)
    )
    # where three sets do not fit and two do: two, and the prompt's sets make no stage
    slots = sum(n * b.layer.expert_nbytes for n, b in zip(cache.plan_slots(), cache.banks))
    total = state.resident_bytes + slots + 2 * one
    monkeypatch.setattr(machine, "budget_base", lambda: (total, 0, "the test's device"))
    assert machine.layer_sets_fit(cache, state.resident_bytes) == (2 * one, None)
    assert not LayerSets(cache, 2 * one).staged and LayerSets(cache, 3 * one).staged
    monkeypatch.setattr(machine, "budget_base", lambda: (total - 1, 0, "the test's device"))
    assert machine.layer_sets_fit(cache, state.resident_bytes)[1].startswith("two layers'")
    state.close()


def test_layer_sets_without_room_for_a_stage_fill_straight_in(small_experts, monkeypatch):
    # set_stage where the device has no room for the stage (cudaMalloc fails): the prompt's
    # fills go into the sets as without it, the tokens stock's, nothing left to free
    from test_cuda_copy import HostRuntime, Managed

    from mlx_lm_streaming.runtime.bank import cuda_copy
    from mlx_lm_streaming.runtime.memory import machine

    runtime = HostRuntime()
    tried = []
    runtime.cudaMalloc = lambda pointer, nbytes: tried.append(nbytes) or 2  # out of memory
    runtime.cudaGetLastError = lambda: 0
    copier = Managed(runtime, buffer_bytes=20_000)
    monkeypatch.setattr(cuda_copy, "copier_for", lambda addresses: copier)
    monkeypatch.setattr(machine, "staged_sets", lambda c: True)
    path = small_experts("qwen3_moe")
    model = _with_slots(path)  # (the default stage: on the device)
    prompt = mx.array(PROMPTS[0])
    assert difference(_stock_steps(path, prompt), _streamed_steps(model, prompt)) is None
    assert model.expert_streaming.prefill.set_experts_read > 0 and runtime.copies
    assert tried and runtime.device_freed == 0
    model.expert_streaming.close()


def test_layer_set_readers_take_whole_experts():
    # each reader of a set's fill by device copies gets a run of consecutive whole experts
    # (their ranges of one tensor follow each other in the file, and in the set), part by part,
    # each part's experts in order, each range once, at its row of its array
    from mlx_lm_streaming.runtime.bank.layer_set import by_expert

    def refs(e):
        return [f"e{e}p{i}" for i in range(3)]

    dealt = by_expert(range(7), refs, [1000, 2000, 3000], [10, 20, 30], 3)
    assert len(dealt) == 3
    for experts, pieces in zip([[0, 1], [2, 3], [4, 5, 6]], dealt):
        assert pieces == [
            (f"e{e}p{i}", [1000, 2000, 3000][i] + e * [10, 20, 30][i])
            for i in range(3)
            for e in experts
        ]
    assert sorted(r for pieces in dealt for r, _ in pieces) == sorted(
        r for e in range(7) for r in refs(e)
    )


def test_a_readers_copies_join_the_ranges_that_follow_each_other():
    # a flush's ranges that follow each other in the buffer and at their addresses are one copy
    # (a set's consecutive experts of one part); a gap in either starts another
    from types import SimpleNamespace as NS

    from mlx_lm_streaming.runtime.bank.cuda_copy import _spans

    group = [(NS(nbytes=10), 1000, 0), (NS(nbytes=10), 1010, 10), (NS(nbytes=5), 1020, 20),
             (NS(nbytes=10), 2000, 25), (NS(nbytes=10), 2011, 35), (NS(nbytes=4), 2021, 50)]
    assert _spans(group) == [(1000, 0, 25), (2000, 25, 10), (2011, 35, 10), (2021, 50, 4)]
