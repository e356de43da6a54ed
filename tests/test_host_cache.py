"""A host cache between the device's slots and disk (runtime/memory/host_cache.py, issue 39 item 4), on
the CPU: set up as on mlx-cuda (backend "cuda" passed in, a placer that records what it was
asked, as tests/test_tiers.py does), the banks, copies, policy and counters the package's own."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from support import PlacementRecorder as Recorder
from support import decode, load_stock, load_streaming, per_slot, same

from mlx_lm_streaming.errors import ConfigurationError
from mlx_lm_streaming.runtime.memory import host_split, report, tiers
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from mlx_lm_streaming.runtime.reads.prefetch import LOOKAHEAD
from mlx_lm_streaming.runtime.sizes import decimal_gb

GB = 10**9
ROOT = Path(__file__).resolve().parent.parent


def cached(path, device_experts, host_experts, placer=None, **options):
    """A streaming model whose device budget holds ``device_experts`` experts per layer, with a
    host cache of ``host_experts`` per layer set up as on mlx-cuda."""
    probe, _ = load_streaming(path)
    per = per_slot(probe)
    probe.expert_streaming.close()
    model, _ = load_streaming(path, expert_cache_gb=(device_experts * per + 0.5) / GB, **options)
    cache = model.expert_streaming.cache
    given = (host_experts * per + 0.5) / GB
    tiers.set_up(cache, given, "cuda", placer=placer or Recorder(), available=1000 * GB)
    return model, cache


def test_only_where_given_below_the_rest(q3_path):
    model, _ = load_streaming(q3_path)
    cache = model.expert_streaming.cache
    per = per_slot(model)
    cache.budget_bytes = 4 * per  # 4 of 16 experts a layer on the device: the rest is 12
    # not given: the default, two tiers where host RAM holds the rest, else neither
    tiers.set_up(cache, None, "cuda", placer=Recorder(), available=1)
    assert cache.tiers is None and cache.host_cache is None
    for given in (0.0, None):
        tiers.set_up(cache, given, "cuda", placer=Recorder(), available=1000 * GB)
        assert cache.host_cache is None
    cache.tiers = None
    # given the rest or more: two tiers, identity banks, as without a host cache
    tiers.set_up(cache, 12 * per / GB, "cuda", placer=Recorder(), available=1000 * GB)
    assert cache.tiers is not None and cache.host_cache is None
    cache.tiers, cache.host_bytes = None, 0
    # given below the rest: today's slot banks, a host cache behind them
    tiers.set_up(cache, 6 * per / GB, "cuda", placer=Recorder(), available=1000 * GB)
    assert cache.tiers is None and cache.host_bytes == 0
    assert cache.host_cache.host_bytes == int(6 * per / GB * GB)
    # more than the host can spare: refused in one line naming the option
    with pytest.raises(ConfigurationError) as e:
        tiers.set_up(cache, 6 * per / GB, "cuda", placer=Recorder(), available=per)
    assert "--expert-host-gb" in str(e.value) and "\n" not in str(e.value)
    # off CUDA: refused in one line, as every host budget is
    with pytest.raises(ConfigurationError, match="mlx-cuda only") as e:
        tiers.set_up(cache, 6 * per / GB, "cpu")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("direct", [True, False], ids=["direct-reads", "staged"])
def test_exact_with_a_host_cache(q3, direct):
    path, tokens, want = q3
    placer = Recorder()
    model, cache = cached(path, 4, 6, placer, direct_reads=direct)
    assert same(want, decode(model, tokens))
    s = cache.summary()
    assert s["host_cache_hits"] > 0 and s["host_cache_kept"] > 0
    # 6 host slots a layer, each part's array placed whole on the host, none on the device
    hosts = cache.host_cache.banks.values()
    assert [h.table.slots for h in hosts] == [6] * len(cache.banks)
    arrays = [a for h in hosts for a in h.arrays]
    assert len(placer.placed) >= len(arrays) and not any(on for *_, on in placer.placed)
    assert {n for _, n, _ in placer.placed} == {a.nbytes for a in arrays}


def store_reads(cache, bank):
    """The experts of ``bank`` read from the store, in order, as the store is asked for them."""
    owner = {(r.file, r.offset): e for e in range(bank.num_experts) for r in bank.layer.refs(e)}
    read = []
    store = cache.store
    for name in ("read_many", "read_on_this_thread"):
        inner = getattr(store, name)

        def wrapped(jobs, inner=inner):
            experts = {owner.get((ref.file, ref.offset)) for ref, _ in jobs} - {None}
            read.extend(sorted(experts))
            return inner(jobs)

        setattr(store, name, wrapped)
    return read


def test_misses_the_host_holds_are_copied_not_read(q3_path):
    stock, _ = load_stock(q3_path)
    weights = dict(tree_flatten(stock.parameters()))
    model, cache = cached(q3_path, 4, 6, tuning=CacheTuning(lookahead=False))
    cache.ensure_planned()
    bank = cache.banks[0]
    host = cache.host_cache.banks[id(bank)]
    read = store_reads(cache, bank)

    def load(experts):
        del read[:]
        bank.load(np.array(experts, dtype=np.int64))
        return sorted(set(read))

    def held():
        return sorted(np.flatnonzero(host.table.slot_of >= 0).tolist())

    assert load([0, 1, 2, 3]) == [0, 1, 2, 3]
    assert load([4, 5, 6, 7]) == [4, 5, 6, 7]  # 0-3 evicted: kept on the host
    assert held() == [0, 1, 2, 3]
    assert load([0, 1, 2, 3]) == []  # all four held by the host: none read from disk
    assert cache.host_cache.hits == 4
    # exclusive: 0-3 left the host bank; of 4-7 (evicted now), as many as it had room for
    # besides 0-3 (its 2 free slots: the served ones' slots are free only after they are served)
    kept = held()
    assert len(kept) == 2 and set(kept) <= {4, 5, 6, 7}
    assert load([8, 9, 10, 11]) == [8, 9, 10, 11]  # misses in both: from disk
    assert held() == sorted([0, 1, 2, 3] + kept)  # 0-3 evicted again, all kept
    # nor read ahead (a guess of the next layer's): copied from the host when used
    del read[:]
    assert bank.stage(np.array(kept + [12]), "lookahead", LOOKAHEAD, block=True) == 1
    assert set(bank.staged) == {12} and bank.staged[12].ok(wait=True) and read == [12]
    # the bytes copied back from the host are the checkpoint's
    assert load(kept) == [] and cache.host_cache.hits == 6
    for e in kept:
        slot = bank.slot_of[e]
        for spec in bank.layer.parts:
            got = bank.array(spec.proj, spec.part)[slot]
            assert mx.array_equal(got, weights[f"{bank.path}.{spec.proj}.{spec.part}"][e]).item()


def test_stats_say_what_the_host_served(q3):
    path, tokens, _ = q3
    model, cache = cached(path, 4, 6)
    decode(model, tokens)
    s = cache.summary()
    per = cache.banks[0].layer.expert_nbytes
    assert s["host_cache_gb"] == pytest.approx(6 * len(cache.banks) * per / GB)
    assert s["host_cache_served_gb"] == pytest.approx(s["host_cache_hits"] * per / GB)
    assert s["experts_read"] == s["misses"] - s["host_cache_hits"]
    assert s["gb_read"] == pytest.approx(s["experts_read"] * per / GB)
    assert s["host_cache_error"] is None
    line = report.stats_line(model.expert_streaming)
    assert f"{s['host_cache_hits']} of the {s['misses']} misses copied from it" in line
    assert "host cache" in report.choice_line(model.expert_streaming)


def test_plan_says_the_rest_a_host_cache_would_sit_below(q3_path, monkeypatch):
    model, cache = cached(q3_path, 4, 6)
    monkeypatch.setattr(host_split, "available_host_bytes", lambda: 1)  # host RAM holds nothing
    rest = cache.total_expert_bytes - cache.budget_bytes
    line = report.tiers_plan_line(cache, "cuda")
    assert f"cannot hold the rest, {decimal_gb(rest)}" in line and "host cache" in line


def test_the_replayed_policy_figures_are_the_docs():
    # docs/design.md and host_cache's docstring: replayed on the routing traces (device 25%, host
    # 50%), the exclusive host cache served 0.53-0.92 of the device's misses against 0.51-0.86
    # admitting what is read from disk, and at host 25% 0.50-0.68 against 0.34-0.53
    from mlx_lm_streaming.files.routing_trace import read_trace
    from mlx_lm_streaming.tools.replay import host_cache_served

    got = {}
    for name in ("qwen3-30b-a3b", "gemma-4-26b-a4b", "trained-qwen3moe-16x64"):
        trace = read_trace(ROOT / "tests" / "data" / "routing" / f"{name}.jsonl")
        e = trace.num_experts
        for host in (0.5, 0.25):
            for exclusive in (True, False):
                share = host_cache_served(trace, e // 4, int(host * e), exclusive=exclusive)
                got[name, host, exclusive] = round(share, 2)
    assert [got[n, 0.5, True] for n in ("qwen3-30b-a3b", "trained-qwen3moe-16x64")] == [0.53, 0.92]
    assert [got[n, 0.5, False] for n in ("qwen3-30b-a3b", "trained-qwen3moe-16x64")] == [0.51, 0.86]
    lo_hi = lambda host, ex: (min(v for k, v in got.items() if k[1:] == (host, ex)),  # noqa: E731
                              max(v for k, v in got.items() if k[1:] == (host, ex)))
    assert lo_hi(0.25, True) == (0.50, 0.68) and lo_hi(0.25, False) == (0.34, 0.53)
