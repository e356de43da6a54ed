"""bench/page_cache_split.py: the expert cache's misses through a page-cache model, on traces whose
counts are known by hand, and its expert cache against ``replay.replay`` on a real trace."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_lm_streaming.tools.replay import replay
from mlx_lm_streaming.files.routing_trace import RoutingTrace, TraceRow, read_trace

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "page_cache_split.py"
TRACE = ROOT / "tests" / "data" / "routing" / "qwen3-30b-a3b.jsonl"


@pytest.fixture(scope="module")
def pcs():
    spec = importlib.util.spec_from_file_location("page_cache_split", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cycling(layers: int, experts: int, cycle: int, prefill: int, decode: int) -> RoutingTrace:
    """Top-1 routing: token t uses expert t % cycle in every layer."""
    header = {"num_layers": layers, "num_experts": experts, "top_k": 1}
    rows = [
        TraceRow(0, "prefill" if t < prefill else "decode", [[t % cycle]] * layers)
        for t in range(prefill + decode)
    ]
    return RoutingTrace(header, rows)


def test_the_second_copy_needs_room_for_the_whole_cycle(pcs):
    """5 experts in turn, 2 LRU slots: every call misses, and every miss is an expert the page cache
    fed to the expert cache 5 reads ago. A page cache of 5 holds it (all 10 decode misses are page
    hits, and the 5 of the prefill's second turn are not counted); one of 4 (E + P = 6 > 5, but the
    2 just read are in both) hits never under LRU, and Belady's MIN misses once every 4 reads after
    the first 4 (reads 4, 8, 12, 16): 8 hits and 2 disk reads in decode (reads 10-19)."""
    trace = cycling(layers=1, experts=8, cycle=5, prefill=10, decode=10)
    result, keys, decode = pcs.miss_stream(trace, slots=2, policy="lru")
    assert result.hits == {"prefill": 0, "decode": 0}
    assert keys == [t % 5 for t in range(20)]
    assert decode == [False] * 10 + [True] * 10
    assert pcs.page_cache_reads(keys, decode, 5) == (10, 0)
    assert pcs.page_cache_reads(keys, decode, 4) == (0, 10)
    assert pcs.page_cache_reads(keys, decode, 0) == (0, 10)
    assert pcs.page_cache_oracle(keys, decode, 5) == (10, 0)
    assert pcs.page_cache_oracle(keys, decode, 4) == (8, 2)


def test_a_page_hit_moves_the_expert_to_the_front(pcs):
    """Reads 0, 1, 0, 2, 0 through 2 places: the second 0 is a hit and makes 1 the oldest, so 2
    evicts 1 and the last 0 hits too (a FIFO would evict 0 there and miss it)."""
    keys, decode = [0, 1, 0, 2, 0], [True] * 5
    assert pcs.page_cache_reads(keys, decode, 2) == (2, 3)


def test_the_page_cache_is_one_lru_over_layers(pcs):
    """Two layers use the same expert ids, one slot each: their misses alternate, 6 distinct
    (layer, expert) over a cycle. A page cache of 6 holds them all, one of 5 none (keys that
    ignored the layer would make 3 suffice)."""
    trace = cycling(layers=2, experts=4, cycle=3, prefill=3, decode=6)
    result, keys, decode = pcs.miss_stream(trace, slots=1, policy="lru")
    assert keys[:6] == [0, 4, 1, 5, 2, 6]
    assert result.decode_misses == [6, 6]
    assert pcs.page_cache_reads(keys, decode, 6) == (12, 0)
    assert pcs.page_cache_reads(keys, decode, 5) == (0, 12)


def test_sweep_splits_the_memory(pcs):
    """10 experts in one layer: M = 0.7 holds 7; s = 0.3 gives floor(2.1) = 2 slots and the page
    cache the other 5 (every decode miss a copy); M = 0.6, s = 0.4: 2 slots, a page cache of 4
    (every decode miss a disk read)."""
    trace = cycling(layers=1, experts=10, cycle=5, prefill=5, decode=10)
    (a,) = pcs.sweep(trace, memories=(0.7,), shares=(0.3,), policy="lru")
    (b,) = pcs.sweep(trace, memories=(0.6,), shares=(0.4,), policy="lru")
    assert (a.slots, a.page_cache, b.slots, b.page_cache) == (2, 5, 2, 4)
    assert (a.hit_rate, a.misses, a.page_hits, a.disk_reads) == (0.0, 1.0, 1.0, 0.0)
    assert (b.misses, b.page_hits, b.disk_reads, b.oracle_page_hits) == (1.0, 0.0, 1.0, 0.8)
    assert a.ms(t_disk=3.0, t_ram=1.0) == 1.0 and b.ms(t_disk=3.0, t_ram=1.0) == 3.0
    assert b.ms(t_disk=3.0, t_ram=1.0, oracle=True) == pytest.approx(0.8 + 0.2 * 3.0)


def test_the_expert_cache_is_replays(pcs):
    """The script's expert cache is ``replay.replay``'s, and the misses it hands on are the ones
    that replay counts (default policy, a real trace)."""
    trace = read_trace(TRACE)
    for slots in (9, 32):
        ours, _, decode = pcs.miss_stream(trace, slots)
        theirs = replay(trace, slots)
        assert (ours.hits, ours.lookups) == (theirs.hits, theirs.lookups)
        assert ours.decode_misses == theirs.decode_misses
        assert sum(ours.decode_misses) == sum(decode)


def test_quick_run_writes_the_figures(tmp_path):
    out = tmp_path / "split.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())["traces"]["qwen3-30b-a3b"]
    assert [(p["memory"], p["cache_share"], p["slots"]) for p in figures["grid"]] == [
        (0.25, 0.5, 16),
        (0.25, 1.0, 32),
    ]
    best = {(b["cost"], b["page_cache"]): b for b in figures["best"]}
    assert set(best) == {(c, p) for c in ("h200", "cpu-box", "mac-like") for p in ("lru", "oracle")}
    assert all(b["default_vs_best_pct"] >= 0 for b in best.values())
