"""Verified steps (verified_step.py): decode with no host sync per layer, checked once per call.

Exactness is checked through mlx-lm's own ``generate_step``, which builds step t+1's graph before
step t is evaluated: a device slot map or a slot that the host rewrote under a pending graph would
show here as a different token or log-probability.
"""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from support import (
    assert_same_steps,
    decode,
    generate_steps,
    load_stock,
    load_streaming,
    same,
    with_slots,
)

from mlx_lm_streaming.errors import ConfigurationError
from mlx_lm_streaming.runtime import mlx_shims
from mlx_lm_streaming.runtime.decode import share_limits, verified_step
from mlx_lm_streaming.runtime.decode.modes import PER_LAYER, Mode
from mlx_lm_streaming.runtime.decode.runner import StepRunner
from mlx_lm_streaming.runtime.memory import report
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from mlx_lm_streaming.runtime.policy import EvictionPolicy, PolicyRows

PROMPT = mx.array([3, 17, 42, 5, 9, 101, 7, 64])
STEPS = 24
# a verified step wherever one may run, whatever the share limits say (``share_limits.way``)
ALWAYS = CacheTuning(verify_choice="always")


def generated(model, steps=STEPS):
    """Tokens and log-probabilities of greedy decoding through mlx-lm's ``generate_step``."""
    return generate_steps(model, PROMPT, steps)


assert_same = assert_same_steps


@pytest.fixture(scope="module")
def expected(q3_path):
    stock, _ = load_stock(q3_path)
    return generated(stock)


def test_verified_steps_match_stock_through_generate_step(q3_path, expected):
    # one slot fewer than experts: most decode steps find everything resident, some find a miss
    # (its experts read, the forward run again from the decoder layer that missed)
    model = with_slots(q3_path, 15)
    assert_same(expected, generated(model))
    runner = model.expert_streaming.steps
    assert runner.verified > runner.replays > 0
    assert runner.recomputed == 0
    # a second generation over a warm cache
    assert_same(expected, generated(model))


def _every_call_verified(model):
    """Tokens and log-probabilities through ``generate_step`` with a verified step tried at every
    call, whatever the misses of the calls before (``verify_choice="always"``)."""
    runner = model.expert_streaming.steps
    assert runner.choice == "always"
    got = []
    runner.missed_share = 0.0
    for (token, logprobs), _ in zip(generate_step(PROMPT, model, max_tokens=STEPS), range(STEPS)):
        runner.missed_share = 0.0
        got.append((int(token), np.array(logprobs)))
    return got


def test_misses_in_many_layers_are_replayed_exactly(q3_path, expected):
    # few slots: nearly every verified step misses, often in several layers, each replayed
    model = with_slots(q3_path, 3, tuning=ALWAYS)
    assert_same(expected, _every_call_verified(model))
    runner = model.expert_streaming.steps
    assert runner.replays >= STEPS // 2
    assert runner.recomputed == 0


def test_a_miss_where_layers_cannot_be_replayed_runs_the_call_again(q3_path, expected):
    model = with_slots(q3_path, 3, tuning=ALWAYS)
    runner = model.expert_streaming.steps
    runner.layers = 0  # as for a model whose decoder layers could not be wrapped
    assert_same(expected, _every_call_verified(model))
    assert runner.recomputed >= STEPS // 4 and runner.replays == 0


def test_misses_in_most_layers_choose_the_per_layer_schedule(q3_path, expected):
    model = with_slots(q3_path, 1)
    assert_same(expected, generated(model))
    runner = model.expert_streaming.steps
    assert runner.missed_share > 0.25
    assert runner.verified < STEPS // 2


@pytest.mark.parametrize("retries", [True, False])
def test_a_token_that_missed_nowhere_tries_a_verified_step_on_gpus(q3_path, retries):
    # GPUs (``clean_retries``): after a per-layer token that missed in no layer, the next call is
    # a verified step whatever the misses before; the CPU keeps the running share (by the limits)
    model = with_slots(q3_path, 15, tuning=CacheTuning(verify_choice="limits"))
    runner = model.expert_streaming.steps
    runner.clean_retries = retries
    kv = make_prompt_cache(model)
    mx.eval(model(PROMPT[None], cache=kv))
    banks = model.expert_streaming.cache.banks
    clean = 0
    for token in range(40):
        runner.missed_share = 1.0  # as after a burst of misses: the per-layer schedule
        before = sum(b.misses for b in banks)
        mx.eval(model(mx.array([[token]]), cache=kv))
        if sum(b.misses for b in banks) == before:
            clean += 1
            assert (runner.missed_share <= runner.limit()) == retries
    assert clean > 0


@pytest.mark.parametrize("choice, words", [("costs", "is retired: the measured-cost chooser"),
                                           ("sometimes", "is none of limits, always")])
def test_a_retired_or_unknown_decode_choice_is_refused_by_name(q3_path, choice, words):
    # (issue 46: the measured-cost chooser left the package; its value is named, not a traceback)
    with pytest.raises(ConfigurationError, match=f"verify_choice '{choice}' {words}"):
        with_slots(q3_path, 15, tuning=CacheTuning(verify_choice=choice))


def test_the_stats_say_how_decode_calls_chose(q3_path):
    for choice, how in (("limits", "by share limits"), ("always", "by verified wherever possible")):
        model = with_slots(q3_path, 4, tuning=CacheTuning(verify_choice=choice))
        decode(model, PROMPT[None], steps=6)
        state = model.expert_streaming
        stats = state.stats()
        assert stats["decode_choice"] == choice and "decode_costs" not in stats
        verified, per_layer = stats["verified_steps"], stats["per_layer_decodes"]
        assert verified + per_layer == 6
        line = f"decode calls: {verified} verified steps, {per_layer} per layer ({how})"
        assert line in report.layers_table(state)
        state.close()


def test_verified_hits_are_counted_and_told_to_the_policy(q3_path):
    model = with_slots(q3_path, 15, tuning=ALWAYS)
    cache = model.expert_streaming.cache
    mx.eval(model(PROMPT[None], cache=(kv := make_prompt_cache(model))))
    bank = cache.banks[0]
    before = (cache.stats.hits, bank.hits, bank.table.policy.__dict__.copy())
    runner = model.expert_streaming.steps
    while True:  # until a call is verified with nothing missing
        done = (runner.verified, runner.replays)
        runner.missed_share = 0.0
        mx.eval(model(mx.array([[11]]), cache=kv))
        if runner.verified > done[0] and runner.replays == done[1]:
            break
    stats = model.expert_streaming.stats()  # the step's host work is done by then
    assert stats["verified_steps"] == runner.verified > 0
    assert stats["verified_replays"] == runner.replays
    assert stats["hits"] > before[0] and bank.hits > before[1]
    assert stats["hits"] + stats["misses"] == sum(b.hits + b.misses for b in cache.banks)
    changed = [k for k, v in bank.table.policy.__dict__.items() if not np.array_equal(v, before[2][k])]
    assert changed  # the policy saw the uses


def test_a_steps_uses_are_recorded_for_every_layer_at_once_as_one_by_one(q3_path, monkeypatch):
    # the commit records every layer's use in one ``PolicyRows.use``: each layer's policy ends as
    # its own ``use`` would have left it (a copy of each, told the same use, bit for bit)
    names = ("last", "probation", "score", "stamp", "follows", "after", "clock", "order")
    at_once, compared = PolicyRows.use, []

    def use(rows, policies, experts):
        copies = [copy.copy(p) for p in policies]
        for c in copies:
            c.__dict__.update({n: np.copy(getattr(c, n)) for n in names[:6]})
        at_once(rows, policies, experts)
        for c, p, used in zip(copies, policies, experts):
            EvictionPolicy.use(c, used)
            compared.extend(np.array_equal(getattr(c, n), getattr(p, n)) for n in names)

    monkeypatch.setattr(PolicyRows, "use", use)
    model = with_slots(q3_path, 15, tuning=ALWAYS)
    cache, runner = model.expert_streaming.cache, model.expert_streaming.steps
    mx.eval(model(PROMPT[None], cache=(kv := make_prompt_cache(model))))
    for token in range(12):
        runner.missed_share = 0.0
        mx.eval(model(mx.array([[11 + token % 3]]), cache=kv))
    model.expert_streaming.stats()  # (the last step's host work)
    rows = cache.banks[0].table.policy.rows
    assert rows is not None and all(b.table.policy.rows is rows for b in cache.banks)
    assert len(compared) >= 8 * len(cache.banks) * 4 and all(compared)


@pytest.mark.parametrize("made, unchecked", [("ab", "ab"), ("aab", "aab"), ("abb", "bb")])
def test_the_commits_ids_are_each_kept_calls_in_order(made, unchecked):
    # the check's stacked ids stand for the commit's only where the unchecked calls are the kept
    # ones in order ("ab"); a bank called twice takes its latest call's ids, also where the
    # unchecked calls are as many as the kept banks ("bb": "a" checked before)
    step = verified_step.VerifiedStep.__new__(verified_step.VerifiedStep)
    step.calls, step.kept, banks = [], {}, {}
    for n, name in enumerate(made):
        bank, ids = banks.setdefault(name, object()), mx.array([[[n, 10 + n]]])
        step.calls.append((n, bank, ids, np.arange(16) == 10 + n))  # (its second id missing)
        step.kept[id(bank)] = (bank, ids, ids.size)
    step.calls = step.calls[len(made) - len(unchecked) :]
    ids, rows = verified_step.call_ids(step.calls)
    want = [n for n, name in enumerate(made) if name not in made[n + 1 :]]
    assert np.array(step.flat_ids(rows)).tolist() == sum(([n, 10 + n] for n in want), [])
    assert verified_step.host_counts(step.calls, ids)[1].tolist() == [1] * len(unchecked)


def test_the_checks_host_counts_are_each_calls_misses_in_either_layout():
    # ids of one shape (stacked, a row each) or of several (flattened one after another): each
    # call's count of the ids its own host map marks missing, as the device's gather and sum did
    maps = [np.arange(8) % 2 == 1, np.arange(8) >= 6, np.zeros(8, bool)]
    for shapes in ([(1, 1, 3)] * 3, [(1, 1, 3), (1, 2, 3), (1, 1, 3)]):
        rng = np.random.default_rng(len(shapes[1]))
        calls = [(j, None, mx.array(rng.choice(8, s).astype(np.uint32)), m)
                 for j, (s, m) in enumerate(zip(shapes, maps))]
        ids, rows = verified_step.call_ids(calls)
        assert (rows is None) == (shapes[1] != shapes[0])
        want = [int(m[np.array(i).reshape(-1)].sum()) for _, _, i, m in calls]
        assert verified_step.host_counts(calls, ids)[1].tolist() == want
    assert verified_step.host_counts([], None)[1].tolist() == []


@pytest.mark.parametrize("sizes", [[2] * 16, [8] * 3, [1] * 4, [2, 4, 2], [6, 6, 3]])
def test_each_calls_distinct_experts_are_np_uniques(sizes):
    # top-k ids (distinct in a call) and ids of several tokens (repeats), one size or several
    rng = np.random.default_rng(len(sizes))
    for repeats in (False, True):
        calls = [rng.choice(16, n, replace=repeats).astype(np.int64) for n in sizes]
        found = verified_step.distinct_per_call(np.concatenate(calls), sizes)
        assert len(found) == len(calls)
        for got, ids in zip(found, calls):
            assert got.dtype == np.int64 and got.tolist() == np.unique(ids).tolist()


def test_off_means_a_host_sync_in_every_layer(q3_path, expected):
    model = with_slots(q3_path, 15, tuning=CacheTuning(verified_steps=False))
    assert_same(expected, generated(model))
    assert model.expert_streaming.steps.verified == 0


class _Foreign(Mode):
    """A mode another thread's model call holds: it keeps state, and takes its layers' calls."""

    wraps = True

    def __init__(self):
        self.owner = -1  # no thread of this process
        self.joined = 0

    def moe_call(self, layer, x, indices):
        self.joined += 1
        raise AssertionError("a MoE call joined another thread's mode")

    def layer_call(self, i, call, args, kwargs):
        self.joined += 1
        raise AssertionError("a decoder layer call joined another thread's mode")


def test_no_call_joins_another_threads_mode(q3, expected):
    # while another thread's model call holds the cache's mode, this thread's calls can install
    # none of their own and run per layer, exact, none of them through that mode (modes.py: an
    # owner instead of thread-locals)
    path, tokens, want = q3
    model = with_slots(path, 15, tuning=ALWAYS)
    cache, runner = model.expert_streaming.cache, model.expert_streaming.steps
    assert cache.mode is PER_LAYER
    foreign = _Foreign()
    assert cache.install(foreign)
    assert not cache.install(_Foreign())  # one mode at a time
    with cache.running(_Foreign()) as installed:
        assert not installed
    try:
        runner.missed_share = 0.0
        assert same(want, decode(model, tokens))
        assert_same(expected, generated(model))
        assert foreign.joined == 0 and cache.mode is foreign
        assert runner.verified == 0  # (no verified step could take the cache)
    finally:
        cache.mode = PER_LAYER
    assert_same(expected, generated(model))
    assert runner.verified > 0 and cache.mode is PER_LAYER  # each step's mode given back


def test_rewindable_caches():
    assert mlx_shims.rewindable(None, 1)
    assert mlx_shims.rewindable([KVCache(), KVCache()], 4)
    rotating = RotatingKVCache(max_size=8)
    assert mlx_shims.rewindable([rotating], 4)
    rotating.offset = 6
    assert not mlx_shims.rewindable([rotating], 4)  # the write would wrap over kept entries

    class Other:
        offset = 0

    assert not mlx_shims.rewindable([KVCache(), Other()], 1)


def test_a_cache_that_cannot_be_rewound_runs_per_layer(q3_path):
    model = with_slots(q3_path, 15, tuning=ALWAYS)
    runner = model.expert_streaming.steps
    cache = make_prompt_cache(model)
    mx.eval(model(PROMPT[None], cache=cache))
    runner.missed_share = 0.0
    verified = runner.verified
    mx.eval(model(mx.array([[5]]), cache=cache))  # plain KVCaches: a verified step
    assert runner.verified == verified + 1
    rotating = [RotatingKVCache(max_size=4) for _ in cache]
    for token in (1, 2, 3):
        mx.eval(model(mx.array([[token]]), cache=rotating))
    runner.missed_share = 0.0
    verified = runner.verified
    mx.eval(model(mx.array([[5]]), cache=rotating))  # offset 3 + 1 reaches the window
    assert runner.verified == verified


def _misses_exact_and_counted(q3_path, expected, **tuning):
    """A model of 4 slots a layer (``tuning``: more ``CacheTuning``), a verified step tried at
    every call, every guess read: its steps are stock's bits, run again from the layer that
    missed (never whole), and every expert a call used counted once, as a hit or a miss;
    ``(model, runner, cache, stats)``."""
    tuning = CacheTuning(lookahead_min_precision=0.0, verify_choice="always", **tuning)
    model = with_slots(q3_path, 4, tuning=tuning)
    assert_same(expected, _every_call_verified(model))
    runner = model.expert_streaming.steps
    cache = model.expert_streaming.cache
    stats = model.expert_streaming.stats()
    assert runner.recomputed == 0 and runner.replays > 0
    assert stats["hits"] + stats["misses"] == sum(b.hits + b.misses for b in cache.banks)
    return model, runner, cache, stats


def test_a_miss_takes_its_calls_ids_from_the_checks_one_read(q3_path, expected, monkeypatch):
    # the missed call's ids and the guessed calls' come from the rows the check read back, not
    # from each call's own array again (on mlx-cuda each such read costs the device a migration
    # of the page it wrote: docs/benchmarks/tiers.md); the steps stay stock's bits
    from mlx_lm_streaming.runtime.decode.verified_step import VerifiedStep

    fell_back, real = [], VerifiedStep.call_row

    def call_row(step, j, indices):
        row = real(step, j, indices)
        fell_back.append(step.rows is None or not np.shares_memory(row, step.rows))
        assert np.array_equal(row.reshape(-1), np.array(indices).reshape(-1))
        return row

    monkeypatch.setattr(VerifiedStep, "call_row", call_row)
    model, runner, _, _ = _misses_exact_and_counted(q3_path, expected)
    assert len(fell_back) >= runner.replays and not any(fell_back)
    model.expert_streaming.close()


@pytest.mark.parametrize("together", [True, False])
def test_a_tokens_misses_read_together_stay_exact_and_counted(q3_path, expected, together):
    # few slots, a verified step at every call: a miss reads the experts the pass beyond it named
    # too (several banks at once), as guesses; the pass run again is stock's bits, and every
    # expert a call used is counted once, as a hit or a miss
    # (every guess read, good or not: ``StepRunner.guess_precision``)
    model, runner, cache, stats = _misses_exact_and_counted(
        q3_path, expected, read_misses_together=together
    )
    if together:
        assert runner.every() == len(cache.banks)  # one check, after the forward
        assert stats["verified_named"] > 0 and 0 <= stats["verified_named_used"] <= stats["verified_named"]
    else:
        assert stats["verified_named"] == 0


def _lock_free(bank) -> bool:
    """Whether another thread can take ``bank``'s lock now (an RLock: its owner always could)."""
    import threading

    got = []

    def try_lock():
        ok = bank.lock.acquire(blocking=False)
        if ok:
            bank.lock.release()
        got.append(ok)

    t = threading.Thread(target=try_lock)
    t.start()
    t.join()
    return got[0]


def test_landings_taken_as_the_layers_run_again_stay_exact(q3_path, expected, monkeypatch):
    # ``replay_as_landed``: a miss's reads (the missed layer's and those the pass named) are
    # issued together and each bank's landings taken by its own MoE call as the forward runs
    # again, each layer evaluated as it is built: the steps are stock's bits, some banks were
    # taken while later banks' reads were still pending, and every lock is free afterwards
    from mlx_lm_streaming.runtime.bank.later_landings import LaterLandings

    taken = []
    real_take = LaterLandings.take

    def take(self, bank):
        if id(bank) in self.pending:
            taken.append(len(self.pending) - 1)  # banks still pending once it is taken
        real_take(self, bank)

    monkeypatch.setattr(LaterLandings, "take", take)
    model, _, cache, _ = _misses_exact_and_counted(q3_path, expected, replay_as_landed=True)
    assert taken and max(taken) > 0, taken  # taken while later banks' reads were pending
    assert all(_lock_free(b) for b in cache.banks)
    model.expert_streaming.close()


@pytest.mark.parametrize("as_landed", [True, False])
def test_reads_issued_as_the_pass_names_them_stay_exact(q3_path, expected, monkeypatch, as_landed):
    # ``reads_in_pass``: the check reads each MoE call's ids back in turn and issues a miss's
    # reads (the first missed call's, then the guesses) as they are named, while the pass's later
    # layers may still compute: the steps are stock's bits, checks issued reads before the whole
    # pass's ids were read, and every lock is free afterwards
    from mlx_lm_streaming.runtime.decode import named_reads, verified_step

    issued = []
    real = named_reads.count_as_named

    def count(step):
        counts = real(step)
        issued.append(len(step.early.pending) if step.early is not None else 0)
        return counts

    monkeypatch.setattr(verified_step, "count_as_named", count)
    model, runner, cache, stats = _misses_exact_and_counted(
        q3_path, expected, reads_in_pass=True, replay_as_landed=as_landed
    )
    assert issued and max(issued) > 1, issued  # the first miss's bank and guesses', in the pass
    assert stats["verified_named"] > 0 and stats["verified_read_in_pass"] == runner.read_in_pass > 0
    assert all(_lock_free(b) for b in cache.banks)
    model.expert_streaming.close()


@pytest.mark.parametrize("in_pass", [False, True])
@pytest.mark.parametrize("as_landed", [True, False])
def test_a_first_calls_reads_issued_as_it_is_built_stay_exact(
    q3_path, expected, monkeypatch, as_landed, in_pass
):
    # ``first_call_reads``: once a quarter of steps' first MoE call missed (here: every step, the
    # share set to 0), a step reads that call's ids back as soon as it is built and issues its misses'
    # reads before the next MoE call is built (the check then issues the guesses beyond, or, with
    # ``reads_in_pass``, names them): the steps are stock's bits, reads went so, and every lock
    # is free afterwards
    from mlx_lm_streaming.runtime.decode import named_reads, verified_step

    issued = []  # per look: (MoE calls built then, banks whose reads it issued)
    real = named_reads.look_first

    def look(step, bank, indices, missing):
        real(step, bank, indices, missing)
        issued.append((len(step.calls), len(step.early.pending) if step.early else 0))

    monkeypatch.setattr(verified_step, "look_first", look)
    monkeypatch.setattr(verified_step, "LOOK_SHARE", 0.0)
    model, runner, cache, stats = _misses_exact_and_counted(
        q3_path, expected, first_call_reads=True, replay_as_landed=as_landed, reads_in_pass=in_pass
    )
    assert (1, 1) in issued and all(built == 1 for built, _ in issued), issued
    assert stats["verified_first_call_reads"] == runner.first_call_reads > 0
    assert stats["verified_named"] > 0 and 0 < runner.first_missed < 1
    if in_pass:  # (the check took the first call's reads on and issued the guesses as named)
        assert stats["verified_read_in_pass"] > 0
    assert all(_lock_free(b) for b in cache.banks)
    model.expert_streaming.close()
    # off (the default off mlx-cuda): no step looks
    assert not with_slots(q3_path, 4, tuning=ALWAYS).expert_streaming.steps.look_first


@pytest.mark.parametrize(
    "in_pass,first", [(False, False), (True, False), (False, True), (True, True)]
)
def test_a_read_that_fails_while_the_layers_run_again_frees_every_bank(
    q3_path, monkeypatch, in_pass, first
):
    # a read error in a bank whose landings a layer run again takes (or the check issued: reads
    # in the pass; or the first MoE call issued as it was built): the call raises the store's
    # error by name, every bank's lock is free, and the model decodes again once reads work
    from mlx_lm_streaming.errors import ExpertIOError

    tuning = CacheTuning(
        replay_as_landed=True, lookahead_min_precision=0.0, verify_choice="always",
        reads_in_pass=in_pass, first_call_reads=first,
    )
    monkeypatch.setattr(verified_step, "LOOK_SHARE", 0.0)  # (every step looks, where on)
    model = with_slots(q3_path, 2, tuning=tuning)
    store = model.expert_streaming.cache.store
    real_read = store.read_on_this_thread
    state = {"fail": False}

    def read(jobs):
        if state["fail"]:
            raise ExpertIOError("model-00001.safetensors: read failed (injected)")
        return real_read(jobs)

    monkeypatch.setattr(store, "read_on_this_thread", read)
    runner = model.expert_streaming.steps
    kv = make_prompt_cache(model)
    mx.eval(model(PROMPT[None, :4], cache=kv))
    state["fail"] = True
    with pytest.raises(ExpertIOError, match="injected"):
        for token in (5, 9, 101, 7, 64, 3, 17, 42):
            runner.missed_share = 0.0
            mx.eval(model(mx.array([[token]]), cache=kv))
    assert (runner.first_call_reads > 0) == first  # (the failing read was one issued so)
    assert all(_lock_free(b) for b in model.expert_streaming.cache.banks)
    state["fail"] = False
    runner.missed_share = 0.0
    mx.eval(model(mx.array([[5]]), cache=make_prompt_cache(model)))
    model.expert_streaming.close()


@pytest.fixture(scope="module")
def varied(q3_path):
    """One prompt and stock's logits for 16 one-token calls with varied inputs (``support.decode``):
    with 2 slots of 16, most of those calls miss in most layers."""
    stock, _ = load_stock(q3_path)
    tokens = mx.array([[(5 * i + 3) % 512 for i in range(12)]])
    return tokens, decode(stock, tokens, steps=16)


@pytest.mark.parametrize(
    "together,given,verified",
    [(True, None, "all"), (False, None, "few"), (True, 0.0, "few")],
)
def test_reading_together_lets_gpus_verify_whatever_the_misses(
    q3_path, varied, monkeypatch, together, given, verified
):
    # a GPU's limits (the CPU's own taken out of the table), misses in most layers of most calls.
    # Read together, a token's misses cost about one more sync: every decode call stays a verified
    # step. Read layer by layer, the running share of layers that missed passes the GPU's limit
    # and calls fall back to the per-layer schedule; so do they, read together, under a limit of
    # 0. Exact every way
    monkeypatch.setattr(share_limits, "MAX_MISSED_SHARE", {})
    if given is not None:
        monkeypatch.setattr(share_limits, "MAX_MISSED_SHARE_TOGETHER_GPU", given)
    tokens, want = varied
    tuning = CacheTuning(read_misses_together=together, verify_choice="limits")
    model = with_slots(q3_path, 2, tuning=tuning)
    assert same(want, decode(model, tokens, steps=16))
    runner = model.expert_streaming.steps
    assert runner.replays > 0
    if verified == "all":
        assert runner.verified == 16
    else:
        assert runner.verified <= 4, runner.verified
    model.expert_streaming.close()


def test_a_tokens_misses_are_all_in_flight_at_once(q3_path, expected, monkeypatch):
    # a miss reads the experts of every layer the pass named at once: each bank's reads issued
    # before any is waited for, ``reads_in_flight`` of them on the demand threads, more than the
    # store's own 1 thread. Each read is held until the call's reads are all in flight (or a
    # timeout): one read waiting on another's turn would show as fewer in flight than asked
    import threading
    import time

    tuning = CacheTuning(
        lookahead=False, lookahead_min_precision=0.0, verify_choice="always", reads_in_flight=64
    )
    model = with_slots(q3_path, 2, tuning=tuning, store_options={"threads": 1})
    cache = model.expert_streaming.cache
    store = cache.store
    gauge = {"now": 0, "want": 0, "most": []}
    cv = threading.Condition()
    real_read = store.read_on_this_thread

    def read(jobs):
        with cv:
            gauge["now"] += 1
            cv.notify_all()
            end = time.monotonic() + 2.0
            while gauge["now"] < gauge["want"] and time.monotonic() < end:
                cv.wait(end - time.monotonic())
            if gauge["want"]:  # (inside a load_together call)
                gauge["most"][-1] = max(gauge["most"][-1], gauge["now"])
        try:
            return real_read(jobs)
        finally:
            with cv:
                gauge["now"] -= 1

    monkeypatch.setattr(store, "read_on_this_thread", read)
    calls = []
    real = verified_step.load_together

    def spy(loads, later=False):
        missing = sum(int((b.slot_of[np.asarray(e)] < 0).sum()) for b, e, _ in loads)
        with cv:
            gauge["want"], gauge["most"] = missing, gauge["most"] + [0]
        calls.append((len(loads), missing))
        real(loads, later)
        with cv:
            gauge["want"] = 0

    monkeypatch.setattr(verified_step, "load_together", spy)
    assert_same(expected, _every_call_verified(model))
    together = [i for i, (banks, missing) in enumerate(calls) if banks > 1 and missing > 2]
    assert together, calls  # several banks, more misses than the store has threads
    for i in together:
        assert gauge["most"][i] == calls[i][1], (calls[i], gauge["most"][i])
    assert cache.demand_pool._max_workers == 64
    model.expert_streaming.close()


@pytest.mark.parametrize("in_pass,first", [(False, False), (True, False), (False, True)])
def test_without_direct_reads_a_tokens_misses_after_the_first_bank_are_read_ahead(
    q3_path, expected, monkeypatch, in_pass, first
):
    # banks written through staging (Metal's way): the banks after the first are read in the
    # background while the first one's load reads its own, then installed by their own loads;
    # ``reads_in_pass``: the missed calls' experts (the first's too) staged as the check reads
    # each call's ids, then loaded after the check as before; ``first_call_reads`` (every step
    # looking): the first MoE call's experts staged as it is built: the same bits
    from mlx_lm_streaming.runtime.decode import named_reads, verified_step

    tuning = CacheTuning(lookahead=False, lookahead_min_precision=0.0, verify_choice="always",
                         reads_in_pass=in_pass, first_call_reads=first)  # fmt: skip
    model = with_slots(q3_path, 2, tuning=tuning, direct_reads=False)
    cache = model.expert_streaming.cache
    stats = cache.prefetch_stats
    in_check, in_look = [], []

    def count(step):
        before = stats.staged["together"]
        counts = named_reads.count_as_named(step)
        in_check.append(stats.staged["together"] - before)
        return counts

    def look(step, bank, indices, missing):
        before = stats.staged["together"]
        named_reads.look_first(step, bank, indices, missing)
        in_look.append(stats.staged["together"] - before)

    monkeypatch.setattr(verified_step, "count_as_named", count)
    monkeypatch.setattr(verified_step, "look_first", look)
    monkeypatch.setattr(verified_step, "LOOK_SHARE", 0.0)
    assert not any(b.direct for b in cache.banks)
    assert_same(expected, _every_call_verified(model))
    assert stats.used["together"] > 0 and stats.staged["together"] >= stats.used["together"]
    assert model.expert_streaming.steps.replays > 0
    assert model.expert_streaming.steps.read_in_pass == 0  # (no direct reads issued)
    assert (sum(in_check) > 0) == in_pass, in_check
    assert (sum(in_look) > 0) == first == (model.expert_streaming.steps.first_call_reads > 0)
    model.expert_streaming.close()


def test_guesses_beyond_a_miss_are_read_only_while_they_scored_well(q3_path, expected, monkeypatch):
    # what the pass beyond a miss names (on a wrong input) is scored at every check that finds
    # it, read or not, and read only while such guesses were mostly right: never at the start
    from mlx_lm_streaming.runtime.decode import verified_step

    model = with_slots(q3_path, 4, tuning=ALWAYS)
    runner = model.expert_streaming.steps
    assert runner.guess_precision == 0.0
    seen = []
    real = verified_step.load_together

    def spy(loads, later=False):
        seen.append((runner.guess_precision, len(loads) > 1))
        return real(loads, later)

    monkeypatch.setattr(verified_step, "load_together", spy)
    assert_same(expected, _every_call_verified(model))
    least = model.expert_streaming.cache.tuning.lookahead_min_precision
    assert not any(guessed for precision, guessed in seen if precision < least), seen
    assert len({precision for precision, _ in seen}) > 1, seen  # scored with nothing read
    assert runner.named == 0 or any(guessed for _, guessed in seen)


def test_a_pass_naming_more_experts_than_slots_guesses_nothing_there(q3_path, expected):
    # two slots, three experts a token: the pass beyond a miss names more experts than a bank holds;
    # those banks are not read ahead (their call runs in waves), and the result is stock's
    model = with_slots(q3_path, 2, tuning=ALWAYS)
    assert_same(expected, _every_call_verified(model))


def test_complete_banks_run_stocks_graph_whole(q3, monkeypatch):
    # every expert resident in its own slot: the model call skips the verified step and each layer
    # goes straight to stock's SwitchGLU over its bank, with stock's bits
    path, tokens, want = q3
    model, _ = load_streaming(path, expert_cache_gb=1e3)
    state = model.expert_streaming
    cache = state.cache
    cache.ensure_planned()
    for bank in cache.banks:
        bank.load(np.arange(bank.num_experts))
    assert cache.all_complete
    assert same(want, decode(model, tokens))
    assert all(b.stock_call is b.glu_call for b in cache.banks)  # set by the first call's choice
    steps = []  # no verified step is even set up once every bank is complete
    run = StepRunner._verified
    monkeypatch.setattr(StepRunner, "_verified",
                        lambda self, *a: steps.append(1) or run(self, *a))
    assert same(want, decode(model, tokens)) and steps == []
    # a bank planned again is not complete until its experts are back: the mode ends with it
    cache.banks[0].allocate(cache.banks[0].num_experts)
    assert not cache.all_complete and cache.banks[0].stock_call is None
    assert same(want, decode(model, tokens))


def test_a_step_found_complete_commits_the_rows_its_check_read(q3, monkeypatch):
    # the ids a check read back (a row per MoE layer) are what a step found complete commits: no
    # second read of the same ids (on mlx-cuda a second host read of device memory); only a step
    # run again from the layer that missed reads its kept ids once more, flat. Decode is stock's
    path, tokens, want = q3
    model = with_slots(path, 8, tuning=CacheTuning(verify_choice="always"))
    runner, flat = model.expert_streaming.steps, []

    class Numpy:  # numpy as the module sees it, its reads of flat MLX arrays counted
        def __getattr__(self, name):
            return getattr(np, name)

        def array(self, a, *args, **kwargs):
            if isinstance(a, mx.array) and a.ndim == 1:
                flat.append(a.shape)
            return np.array(a, *args, **kwargs)

    monkeypatch.setattr(verified_step, "np", Numpy())
    commit, commits = verified_step.VerifiedStep.commit, []

    def counted(step, cache):  # (reads during the commit; whether it had the check's rows)
        before = len(flat)
        rows = step.rows is not None and step.ids_of is not None and step.ids_of is step.rows_of
        commit(step, cache)
        commits.append((len(flat) - before, rows))

    monkeypatch.setattr(verified_step.VerifiedStep, "commit", counted)
    assert same(want, decode(model, tokens))
    assert runner.verified > 0 and runner.replays + runner.recomputed > 0  # (8 of 16: misses)
    assert any(rows for _, rows in commits) and not all(rows for _, rows in commits), commits
    assert all(reads == (0 if rows else 1) for reads, rows in commits), commits
    model.expert_streaming.close()
