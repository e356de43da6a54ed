"""Routing traces, the eviction policy and their replay (``routing_trace``, ``policy``, ``replay``).

The replay of the real traces in ``tests/data/routing`` reproduces the reference LRU and Belady figures
of their README, and the default policy beats LRU on both; a slot table never gives up a slot that the
call or ``keep`` pins, whatever the policy; ``plan --routing-trace`` prints what the same slot tables
give at the model's slots, and refuses a trace of another model in one line.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache
from support import load_stock, load_streaming

from mlx_lm_streaming.option_table import GB
from mlx_lm_streaming.errors import CheckpointError, ConfigurationError
from mlx_lm_streaming.runtime.policy import (
    DEFAULT_POLICY,
    POLICIES,
    EvictionPolicy,
    PolicyRows,
    SlotTable,
)
from mlx_lm_streaming.runtime.sizes import decimal_gb
from mlx_lm_streaming.tools.replay import belady, replay
from mlx_lm_streaming.files.routing_trace import TraceError, TraceWriter, read_trace

DATA = Path(__file__).parent / "data" / "routing"
QWEN = DATA / "qwen3-30b-a3b.jsonl"
GEMMA = DATA / "gemma-4-26b-a4b.jsonl"

# the traces' README: (trace, slots per layer) -> (LRU, Belady) decode hit rates, to 3 decimals
REFERENCE = {
    (QWEN, 16): (0.612, 0.758),
    (QWEN, 32): (0.817, 0.912),
    (QWEN, 64): (0.958, 0.969),
    (GEMMA, 16): (0.613, 0.752),
    (GEMMA, 32): (0.796, 0.900),
    (GEMMA, 64): (0.951, 0.963),
}


def rounds_to(value: float, figure: float) -> bool:
    return abs(value - figure) <= 0.0005 + 1e-12


# --- the policy ---------------------------------------------------------------------------------


def admit(table, experts, keep=()):
    missing, slots, evicted = table.admit(np.array(experts, dtype=np.int64), keep)
    table.place(missing, slots)
    return missing.tolist(), evicted


def test_lru_evicts_the_least_recently_used_in_rank_order():
    table = SlotTable(8, "lru")
    table.reset(3)
    admit(table, [5, 1, 2])  # rank order: 5 counts as used first
    admit(table, [1])
    assert admit(table, [7]) == ([7], 1)
    assert table.slot_of[5] < 0 and (table.slot_of[[1, 2, 7]] >= 0).all()


def test_decay_keeps_a_frequent_expert_through_a_burst_that_lru_lets_evict_it():
    lru, decay = SlotTable(16, "lru"), SlotTable(16, "decay")
    for table in (lru, decay):
        table.reset(2)
        for _ in range(6):
            admit(table, [0])  # 0: used again and again
        for e in range(1, 5):
            admit(table, [e])  # then one-offs
    assert lru.slot_of[0] < 0
    assert decay.slot_of[0] >= 0


def test_scores_age_by_half_each_half_life():
    policy = EvictionPolicy(4, "decay", half_life=2.0)
    policy.use(np.array([1]))
    policy.use(np.array([2]))
    policy.use(np.array([2]))
    assert policy.scores(np.array([1]))[0] == pytest.approx(0.5)
    assert policy.scores(np.array([2]))[0] == pytest.approx(1 + 0.5**0.5)


def test_free_slots_go_before_any_eviction():
    table = SlotTable(8, DEFAULT_POLICY)
    table.reset(4)
    admit(table, [0, 1])
    assert admit(table, [2, 3]) == ([2, 3], 0)
    assert sorted(table.expert_of.tolist()) == [0, 1, 2, 3]


def test_too_few_unpinned_slots_is_an_error():
    table = SlotTable(8, DEFAULT_POLICY)
    table.reset(3)
    admit(table, [0, 1, 2])
    with pytest.raises(ValueError, match="fewer slots are free of pinned and kept"):
        table.admit(np.array([3, 4]), keep=[0, 1])
    with pytest.raises(ValueError, match="only 3 slots"):
        table.admit(np.array([3, 4, 5, 6]))


def test_a_policy_choosing_a_pinned_expert_is_caught():
    class Greedy(EvictionPolicy):
        def victims(self, candidates, count):
            return np.arange(count)  # experts 0..count-1, resident or not, pinned or not

    table = SlotTable(8, "lru")
    table.reset(2)
    table.policy = Greedy(8, "lru")
    admit(table, [0, 1])
    with pytest.raises(RuntimeError, match="invalid victims"):
        table.admit(np.array([0, 2]))


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ConfigurationError, match="decay, decay_next, lru"):
        EvictionPolicy(8, "fifo")


@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    slots=st.integers(1, 10),
    calls=st.lists(
        st.tuples(
            st.lists(st.integers(0, 11), min_size=1, max_size=10, unique=True),
            st.lists(st.integers(0, 11), max_size=4, unique=True),
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_a_slot_table_never_gives_up_a_pinned_slot(policy, slots, calls):
    table = SlotTable(12, policy)
    table.reset(slots)
    for experts, keep in calls:
        experts = experts[:slots]
        keep = [e for e in keep if e not in experts]
        pinned = {e: int(table.slot_of[e]) for e in experts + keep if table.slot_of[e] >= 0}
        fits = len(experts) + sum(e in pinned for e in keep) <= slots
        if not fits:
            with pytest.raises(ValueError):
                table.admit(np.array(experts), keep)
            continue
        admit(table, experts, keep)
        for e, slot in pinned.items():
            assert table.slot_of[e] == slot, f"{policy}: pinned expert {e} moved or was evicted"
        assert (table.slot_of[experts] >= 0).all()
        resident = np.nonzero(table.slot_of >= 0)[0]
        assert len(resident) <= slots
        assert (table.expert_of[table.slot_of[resident]] == resident).all()


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


# --- traces -------------------------------------------------------------------------------------


def test_the_real_traces_read_and_validate():
    for path, layers, prefill in ((QWEN, 48, 28), (GEMMA, 30, 29)):
        trace = read_trace(path)
        assert (trace.num_layers, trace.num_experts, trace.top_k) == (layers, 128, 6)
        assert sum(r.phase == "prefill" for r in trace.rows) == prefill
        assert sum(r.phase == "decode" for r in trace.rows) == 128


def write_lines(path, *values):
    path.write_text("".join((v if isinstance(v, str) else json.dumps(v)) + "\n" for v in values))
    return path


HEADER = {
    "format": "moe-routing-trace",
    "version": 1,
    "num_layers": 2,
    "num_experts": 8,
    "top_k": 2,
}


@pytest.mark.parametrize(
    "lines, where, message",
    [
        ([HEADER, "{not json"], ":2", "not valid JSON"),
        ([{**HEADER, "format": "csv"}], ":1", "not a routing trace"),
        ([{**HEADER, "version": 2}], ":1", "version 2 is not supported"),
        ([{**HEADER, "num_layers": 0}], ":1", "'num_layers' must be a positive integer"),
        ([HEADER, {"seq": 0, "phase": "decode", "experts": [[1, 2]]}], ":2", "must list 2 MoE"),
        ([HEADER, {"seq": 0, "phase": "decode", "experts": [[1], [8]]}], ":2", "ids in 0..7"),
        ([HEADER, {"seq": 0, "phase": "decode", "experts": [[1, 1], []]}], ":2", "expert twice"),
        ([HEADER, {"seq": 0, "phase": "warmup", "experts": [[], []]}], ":2", "'phase' must be"),
        ([HEADER, {"seq": -1, "phase": "decode", "experts": [[], []]}], ":2", "'seq' must be"),
    ],
)
def test_a_bad_trace_names_the_file_and_line(tmp_path, lines, where, message):
    path = write_lines(tmp_path / "t.jsonl", *lines)
    with pytest.raises(TraceError, match=re.escape(f"{path}{where}: ") + ".*" + re.escape(message)):
        read_trace(path)


def test_an_empty_or_missing_trace_is_an_error(tmp_path):
    with pytest.raises(TraceError, match="empty file"):
        read_trace(write_lines(tmp_path / "e.jsonl"))
    with pytest.raises(CheckpointError, match="cannot read"):
        read_trace(tmp_path / "absent.jsonl")


def test_the_writer_leaves_a_valid_prefix_at_every_token(tmp_path):
    path = tmp_path / "run.jsonl"
    writer = TraceWriter(path, 2, 8, 2, model="m")
    tokens = [
        ("prefill", [[1, 2], [3, 4]]),
        ("prefill", [[0, 7], []]),
        ("decode", [[5, 6], [1, 0]]),
    ]
    for n, (phase, experts) in enumerate(tokens, 1):
        writer.token(0, phase, [np.array(e) for e in experts])
        # read while the run still goes (nothing closed): every token so far is there
        trace = read_trace(path)
        assert [(r.phase, r.experts) for r in trace.rows] == tokens[:n]
    writer.close()
    assert trace.header["model"] == "m" and trace.top_k == 2


def test_an_unwritable_trace_is_a_configuration_error(tmp_path):
    with pytest.raises(ConfigurationError, match="cannot write the routing trace"):
        TraceWriter(tmp_path / "no" / "dir" / "t.jsonl", 2, 8, 2)


# --- replay -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, slots", sorted(REFERENCE, key=str))
def test_replay_reproduces_the_reference_figures(path, slots):
    trace = read_trace(path)
    lru_figure, belady_figure = REFERENCE[(path, slots)]
    assert rounds_to(replay(trace, slots, "lru").hit_rate("decode"), lru_figure)
    assert rounds_to(belady(trace, slots).hit_rate("decode"), belady_figure)


@pytest.mark.parametrize("path", [QWEN, GEMMA])
def test_the_default_policy_beats_lru_on_real_routing(path):
    trace = read_trace(path)
    for slots in (8, 16, 24, 32, 48, 64):
        lru = replay(trace, slots, "lru").hit_rate("decode")
        ours = replay(trace, slots, DEFAULT_POLICY).hit_rate("decode")
        best = belady(trace, slots).hit_rate("decode")
        assert lru < ours <= best, (slots, lru, ours, best)


def test_replay_goes_in_waves_where_a_token_needs_more_experts_than_slots():
    trace = read_trace(QWEN)  # top 6
    result = replay(trace, 4)
    decode_lookups = sum(
        len(r.experts[i]) for r in trace.rows if r.phase == "decode" for i in range(48)
    )
    assert result.lookups["decode"] == decode_lookups
    assert 0 < result.hit_rate("decode") < replay(trace, 6).hit_rate("decode")


# --- the cache and plan -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_streams_the_stock_logits(checkpoint, policy):
    path = checkpoint("qwen3_moe")
    stock, _ = load_stock(path)
    probe, _ = load_streaming(path)
    per_slot = sum(b.layer.expert_nbytes for b in probe.expert_streaming.cache.banks)
    model, _ = load_streaming(path, expert_cache_gb=(3 * per_slot + 0.5) / GB, cache_policy=policy)
    cache = model.expert_streaming.cache
    assert cache.policy == policy
    outs = []
    for m in (stock, model):
        prompt_cache = make_prompt_cache(m)
        steps = [m(mx.array([[(7 * i + 3) % 512 for i in range(10)]]), cache=prompt_cache)]
        for i in range(8):
            steps.append(m(mx.array([[(37 * i + 11) % 512]]), cache=prompt_cache))
        mx.eval(steps)
        outs.append(steps)
    assert all(mx.array_equal(a, b).item() for a, b in zip(*outs))
    assert cache.stats.evictions > 0
    assert all(b.table.policy.name == policy for b in cache.banks)


def test_an_unknown_cache_policy_is_refused():
    from mlx_lm_streaming.runtime.options import StreamingOptions

    with pytest.raises(ConfigurationError, match="cache_policy 'fifo' is unknown"):
        StreamingOptions(cache_policy="fifo")
    # the error names the variable at fault
    named = "^MLX_LM_STREAMING_CACHE_POLICY='fifo': cache_policy"
    with pytest.raises(ConfigurationError, match=named):
        StreamingOptions.from_env(
            {"MLX_LM_STREAMING_EXPERTS": "1", "MLX_LM_STREAMING_CACHE_POLICY": "fifo"}
        )


def plan(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_LM_STREAMING")}
    return subprocess.run(
        [sys.executable, "-m", "mlx_lm_streaming", "plan", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def small_trace(path, layers=2, experts=8, tokens=40, seed=0):
    """Zipf-like routing, top 2, with a shift of favourites halfway."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, experts + 1)
    with TraceWriter(path, layers, experts, 2, model="synthetic") as writer:
        for t in range(tokens):
            shift = 0 if t < tokens // 2 else experts // 2
            rows = []
            for layer in range(layers):
                picked = rng.choice(experts, 2, replace=False, p=weights / weights.sum())
                rows.append((picked + shift + layer) % experts)
            writer.token(0, "prefill" if t < 8 else "decode", rows)
    return path


def test_plan_replays_a_trace_through_the_caches_policy(checkpoint, tmp_path):
    ckpt = checkpoint("qwen3_moe")  # 2 MoE layers x 8 experts
    trace_path = small_trace(tmp_path / "t.jsonl")
    probe, _ = load_streaming(ckpt)
    banks = probe.expert_streaming.cache.banks
    per_slot = sum(b.layer.expert_nbytes for b in banks)
    trace = read_trace(trace_path)
    for policy in sorted(POLICIES):
        done = plan(
            ckpt,
            "--routing-trace",
            trace_path,
            "--expert-cache-gb",
            (3 * per_slot + 1) / GB,
            "--cache-policy",
            policy,
        )
        assert done.returncode == 0, done.stderr
        lines = [line for line in done.stdout.splitlines() if "decode hit rate" in line]
        assert len(lines) == 1
        want = replay(trace, 3, policy)
        read = sum(m * b.layer.expert_nbytes for m, b in zip(want.decode_misses, banks)) / 32
        assert f"decode hit rate {want.hit_rate('decode'):.1%}" in lines[0]
        assert f"prefill hit rate {want.hit_rate('prefill'):.1%}" in lines[0]
        assert f"{decimal_gb(read)} read per decode token" in lines[0]
        assert f"policy {policy}" in lines[0]


@pytest.mark.parametrize("layers, experts", [(3, 8), (2, 16)])
def test_plan_refuses_a_trace_of_another_model_in_one_line(checkpoint, tmp_path, layers, experts):
    trace_path = small_trace(tmp_path / "other.jsonl", layers=layers, experts=experts, tokens=4)
    done = plan(checkpoint("qwen3_moe"), "--routing-trace", trace_path)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert str(trace_path) in line and f"{layers} MoE layers x {experts} experts" in line


def test_plan_names_the_line_of_a_bad_trace(checkpoint, tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", HEADER, {"seq": 0, "phase": "decode"})
    done = plan(checkpoint("qwen3_moe"), "--routing-trace", path)
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert f"{path}:2: " in line


# --- recording ----------------------------------------------------------------------------------


def stock_routing(model, steps, monkeypatch):
    """Run ``steps`` (token arrays) through a stock model; the expert ids each MoE layer picked,
    as trace rows ``(phase, experts per layer)``."""
    from mlx_lm.models.switch_layers import SwitchGLU

    seen = []
    real = SwitchGLU.__call__

    def spy(self, x, indices):
        seen.append(np.array(indices))
        return real(self, x, indices)

    monkeypatch.setattr(SwitchGLU, "__call__", spy)
    prompt_cache = make_prompt_cache(model)
    rows = []
    for tokens in steps:
        seen.clear()
        mx.eval(model(tokens, cache=prompt_cache))
        layers = [idx.reshape(-1, idx.shape[-1]) for idx in seen]
        phase = "prefill" if tokens.shape[1] > 1 else "decode"
        rows += [(phase, [layer[t].tolist() for layer in layers]) for t in range(tokens.shape[1])]
    monkeypatch.setattr(SwitchGLU, "__call__", real)
    return rows


def test_recording_writes_the_exact_routing_as_the_run_goes(checkpoint, tmp_path, monkeypatch):
    path = checkpoint("qwen3_moe")
    steps = [mx.array([[(7 * i + 3) % 512 for i in range(10)]])]
    steps += [mx.array([[(37 * i + 11) % 512]]) for i in range(6)]
    want = stock_routing(load_stock(path)[0], steps, monkeypatch)
    out = tmp_path / "run.jsonl"
    probe, _ = load_streaming(path)
    per_slot = sum(b.layer.expert_nbytes for b in probe.expert_streaming.cache.banks)
    for budget in (None, (3 * per_slot + 0.5) / GB):  # every expert resident (no sync to skip), 3
        model, _ = load_streaming(path, expert_cache_gb=budget, record_routing=str(out))
        prompt_cache = make_prompt_cache(model)
        done = 0
        for tokens in steps:
            mx.eval(model(tokens, cache=prompt_cache))
            done += tokens.shape[1]
            # the file is a valid trace after every call, with every token so far
            trace = read_trace(out)
            assert [(r.phase, r.experts) for r in trace.rows] == want[:done]
        assert (trace.num_layers, trace.num_experts, trace.top_k) == (2, 8, 2)
        assert {r.seq for r in trace.rows} == {0}
        model.expert_streaming.close()


def test_a_prefill_after_decoding_starts_a_new_sequence(checkpoint, tmp_path):
    out = tmp_path / "two.jsonl"
    model, _ = load_streaming(checkpoint("qwen3_moe"), record_routing=str(out))
    for _ in range(2):
        prompt_cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[1, 2, 3]]), cache=prompt_cache))
        mx.eval(model(mx.array([[4]]), cache=prompt_cache))
    model.expert_streaming.close()
    assert [(r.seq, r.phase) for r in read_trace(out).rows] == [
        (0, "prefill"), (0, "prefill"), (0, "prefill"), (0, "decode"),
        (1, "prefill"), (1, "prefill"), (1, "prefill"), (1, "decode"),
    ]  # fmt: skip


def test_the_record_routing_flag_and_env_var(checkpoint, tmp_path):
    ckpt = checkpoint("qwen3_moe")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_LM_STREAMING")}
    generate = [sys.executable, "-m", "mlx_lm", "generate", "--model", str(ckpt)]
    generate += ["--prompt", "hello there", "--max-tokens", "4", "--temp", "0"]
    flag, var = tmp_path / "flag.jsonl", tmp_path / "env.jsonl"
    runs = [
        (generate + ["--streaming-experts", "--record-routing", str(flag)], env),
        (
            generate,
            {**env, "MLX_LM_STREAMING_EXPERTS": "1", "MLX_LM_STREAMING_RECORD_ROUTING": str(var)},
        ),
    ]
    for cmd, run_env in runs:
        done = subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=120)
        assert done.returncode == 0, done.stderr
    a, b = read_trace(flag), read_trace(var)
    assert [r.experts for r in a.rows] == [r.experts for r in b.rows]
    assert {"prefill", "decode"} <= {r.phase for r in a.rows}
    assert a.header["model"] == ckpt.name
    # replayed by plan
    done = plan(ckpt, "--routing-trace", flag)
    assert done.returncode == 0 and "decode hit rate" in done.stdout, done.stderr
    # an unwritable file is refused at parse time, naming the flag and the file
    bad = tmp_path / "missing-dir" / "t.jsonl"
    done = subprocess.run(
        generate + ["--streaming-experts", "--record-routing", str(bad)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"argument --record-routing: {bad}: cannot write" in done.stderr.splitlines()[-1]


def test_decay_next_keeps_the_expert_that_follows_what_this_call_uses():
    # 1 followed 0 the one time 0 was used; when a call with 0 misses and must give up 1 or 4
    # (1 used less recently), decay evicts 1 and decay_next keeps it
    decay, nxt = SlotTable(6, "decay"), SlotTable(6, "decay_next")
    for table in (decay, nxt):
        table.reset(3)
        for call in ([3], [2], [0], [1], [4]):
            admit(table, call)
        assert sorted(table.expert_of.tolist()) == [0, 1, 4]
        assert admit(table, [0, 5]) == ([5], 1)
    assert decay.slot_of[1] < 0 and decay.slot_of[4] >= 0
    assert nxt.slot_of[1] >= 0 and nxt.slot_of[4] < 0


def test_decay_next_learns_only_from_what_followed():
    table = SlotTable(4, "decay_next")
    table.reset(2)
    admit(table, [0])
    admit(table, [1])
    admit(table, [2])  # a call that must choose a victim learns as one with a free slot does
    policy = table.policy
    assert policy.follows[0, 1] == 1 and policy.follows[1, 2] == 1
    assert policy.follows.sum() == 2 and policy.after[[0, 1]].tolist() == [1, 1]


def _layers_replayed(policy, joined, seed, layers=4, experts=16, slots=6, calls=240):
    """One token after another over ``layers`` slot tables: each layer's experts (1-3 of them,
    mostly 2: a token's layers alike), now and then a guess read ahead or a table made anew; the
    layers that hit recorded by their own ``use``, or (``joined``) all at once by ``PolicyRows``.
    Returns every eviction (call, layer, victims) and the policies' state."""
    rng = np.random.default_rng(seed)
    tables, rows, evicted = (
        [SlotTable(experts, policy) for _ in range(layers)],
        None,
        [],
    )
    for table in tables:
        table.reset(slots)
    for call in range(calls):
        width = int(rng.integers(1, 4)) if rng.random() < 0.3 else 2
        uses = [rng.choice(experts, width, replace=False).astype(np.int64) for _ in tables]
        layer = int(rng.integers(layers))
        if rng.random() < 0.1:  # a guess read ahead (its victims chosen on the joined rows)
            missing, at, need = tables[layer].prefetch(rng.choice(experts, 2, replace=False))
            tables[layer].place(missing, at)
            if need:
                evicted.append((call, layer, tables[layer].evicted[0].tolist()))
        if call == calls // 2:  # a policy made anew (``LayerBank.reset``): joined again
            tables[layer].reset(slots)
        hits = [l for l, t in enumerate(tables) if joined and (t.slot_of[uses[l]] >= 0).all()]
        if hits:
            policies = [tables[l].policy for l in hits]
            if rows is None or any(p.rows is not rows for p in policies):
                rows = PolicyRows([t.policy for t in tables])
            rows.use(policies, [uses[l] for l in hits])
        for l, table in enumerate(tables):
            if l not in hits:
                missing, at, need = table.admit(uses[l])
                table.place(missing, at)
                if need:
                    evicted.append((call, l, table.evicted[0].tolist()))
    names = ("last", "probation", "score", "stamp", "follows", "after")
    arrays = [[getattr(t.policy, n) for n in names] for t in tables]
    state = [
        (t.policy.clock, t.policy.order, *(None if a is None else a.tobytes() for a in row))
        for t, row in zip(tables, arrays)
    ]
    return evicted, state


@pytest.mark.parametrize("policy", POLICIES)
def test_the_layers_uses_recorded_at_once_choose_the_victims_one_by_one_does(policy):
    # a verified step's commit records every layer's use at once (``PolicyRows.use``): the same
    # victims, and the same state bit for bit (scores included: each element's arithmetic is the
    # per-layer ``use``'s), as each layer's own ``use`` in turn
    for seed in range(4):
        by_layer = _layers_replayed(policy, False, seed)
        at_once = _layers_replayed(policy, True, seed)
        assert len(by_layer[0]) > 50  # (evictions enough to tell them apart)
        assert at_once[0] == by_layer[0]
        assert at_once[1] == by_layer[1]


def test_policies_of_several_kinds_are_not_joined():
    lru, decay = EvictionPolicy(8, "lru"), EvictionPolicy(8, "decay")
    assert not PolicyRows.joinable([lru, decay])
    assert not PolicyRows.joinable([EvictionPolicy(8), EvictionPolicy(4)])
    assert PolicyRows.joinable([EvictionPolicy(8), EvictionPolicy(8)])
