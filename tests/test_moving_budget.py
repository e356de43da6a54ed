"""The expert cache follows free memory (issue 48): the readers of free memory, each with the OS's
answers given, the budget's rule, and a decode through mlx-lm's ``generate_step`` (step t+1 built
before step t is evaluated) whose cache shrinks to one expert per layer and grows back while it
runs, token for token and bit for bit stock's."""

import ctypes
import time
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from support import assert_same_steps, generate_steps, load_stock, load_streaming, per_slot

from mlx_lm_streaming.option_table import GB
from mlx_lm_streaming.runtime.memory import free_memory, moving_budget, report
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from mlx_lm_streaming.runtime.memory.free_memory import CRITICAL, NORMAL, SHORT, Reading
from mlx_lm_streaming.runtime.memory.moving_budget import MovingBudget

PROMPT = mx.array([3, 17, 42, 5, 9, 101, 7, 64])
STEPS = 24
MB = 10**6

# -- the readers, with the OS's answers given -------------------------------------------------------

MEMINFO = """MemTotal:       24576000 kB
MemFree:         1000000 kB
MemAvailable:    3000000 kB
Buffers:           10000 kB
"""
PSI_CALM = """some avg10=0.00 avg60=0.00 avg300=0.00 total=0
full avg10=0.00 avg60=0.00 avg300=0.00 total=0
"""
PSI_SOME = """some avg10=23.50 avg60=4.00 avg300=1.00 total=912345
full avg10=2.00 avg60=0.50 avg300=0.10 total=12345
"""
PSI_FULL = """some avg10=60.00 avg60=30.00 avg300=9.00 total=9912345
full avg10=41.20 avg60=20.00 avg300=5.00 total=5512345
"""


def test_meminfo_fields_are_bytes():
    assert free_memory.meminfo_field(MEMINFO, "MemAvailable") == 3_000_000 * 1024
    assert free_memory.meminfo_field(MEMINFO, "MemTotal") == 24_576_000 * 1024
    assert free_memory.meminfo_field(MEMINFO, "SwapTotal") is None
    assert free_memory.meminfo_field("MemAvailable: junk kB\n", "MemAvailable") is None


def test_psi_says_short_from_some_and_critical_from_full():
    assert free_memory.psi_level(PSI_CALM) == NORMAL
    assert free_memory.psi_level(PSI_SOME) == SHORT
    assert free_memory.psi_level(PSI_FULL) == CRITICAL
    assert free_memory.psi_level("") == NORMAL


def test_cgroup_v2_limit_and_room():
    assert free_memory.cgroup_dir("0::/user.slice/app\n", "/cg") == "/cg/user.slice/app"
    assert free_memory.cgroup_dir("4:memory:/docker/x\n", "/cg") is None  # v1 only
    assert free_memory.cgroup_limit("max\n", "123\n") is None
    assert free_memory.cgroup_limit("8000000000\n", "6500000000\n") == (8 * GB, 1_500_000_000)
    assert free_memory.cgroup_limit("8000\n", "9000\n") == (8000, 0)  # over its limit: no room
    assert free_memory.cgroup_limit("eight\n", "1\n") is None


def _fake_linux(tmp_path, meminfo=MEMINFO, psi=PSI_CALM, limit=None, used=None):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "pressure").mkdir()
    (proc / "meminfo").write_text(meminfo)
    (proc / "pressure" / "memory").write_text(psi)
    (proc / "self" / "cgroup").write_text("0::/job\n")
    (root / "job").mkdir(parents=True)
    if limit is not None:
        (root / "job" / "memory.max").write_text(f"{limit}\n")
        (root / "job" / "memory.current").write_text(f"{used}\n")
    return str(proc), str(root)


def test_linux_reading_takes_the_tighter_of_memavailable_and_the_cgroup(tmp_path):
    proc, root = _fake_linux(tmp_path / "a")
    r = free_memory.read_linux(proc, root)
    assert (r.available, r.total, r.pressure) == (3_072_000_000, 24_576_000 * 1024, NORMAL)
    # a container's limit: 4 GB, 3.5 used -> 0.5 GB of room, less than MemAvailable
    proc, root = _fake_linux(tmp_path / "b", psi=PSI_SOME, limit=4 * GB, used=3_500_000_000)
    r = free_memory.read_linux(proc, root)
    assert (r.available, r.total, r.pressure) == (500_000_000, 4 * GB, SHORT)
    assert "cgroup" in r.source
    # a group without a limit: MemAvailable
    proc, root = _fake_linux(tmp_path / "c", limit="max", used=1)
    assert free_memory.read_linux(proc, root).available == 3_072_000_000
    assert free_memory.read_linux(str(tmp_path / "nowhere"), root) is None


def test_macos_vm_statistics64_is_the_kernels_layout():
    # mach/vm_statistics.h: 152 bytes, HOST_VM_INFO64_COUNT 38 integers
    assert ctypes.sizeof(free_memory.VmStatistics64) == 152
    assert free_memory.HOST_VM_INFO64_COUNT == 38
    assert free_memory.VmStatistics64.purgeable_count.offset == 88
    assert free_memory.VmStatistics64.compressor_page_count.offset == 128


class FakeLibc:
    """What libc's sysctlbyname, mach_host_self, host_statistics64 and host_page_size answer on
    a Mac (given), written through the pointers the reader passes."""

    def __init__(self, level=2, free=1000, inactive=3000, page=16384, fail=False):
        self.level, self.free, self.inactive, self.page, self.fail = (
            level,
            free,
            inactive,
            page,
            fail,
        )
        self.mach_host_self = lambda: 7

    def sysctlbyname(self, name, value, size, new, newlen):
        assert name == b"kern.memorystatus_vm_pressure_level"
        value._obj.value = self.level
        return 0

    def host_statistics64(self, host, flavor, stats, count):
        assert (host, flavor, count._obj.value) == (7, 4, 38)
        if self.fail:
            return 5  # KERN_FAILURE
        stats._obj.free_count, stats._obj.inactive_count = self.free, self.inactive
        stats._obj.active_count = 99999  # not free
        return 0

    def host_page_size(self, host, size):
        size._obj.value = self.page
        return 0


def test_macos_pressure_level_and_free_pages_given():
    assert [free_memory.macos_level(v) for v in (1, 2, 4, 3)] == [NORMAL, SHORT, CRITICAL, NORMAL]
    r = free_memory.read_macos(FakeLibc(level=4))
    assert r.available == (1000 + 3000) * 16384 and r.pressure == CRITICAL
    r = free_memory.read_macos(FakeLibc(level=1, fail=True))  # no page counts: the level alone
    assert r.available is None and r.pressure == NORMAL


def test_cuda_free_memory_given():
    class Runtime:
        def cudaMemGetInfo(self, free, total):
            free._obj.value, total._obj.value = 30 * GB, 80 * GB
            return 0

    class Failing:
        def cudaMemGetInfo(self, free, total):
            return 2  # cudaErrorMemoryAllocation

    r = free_memory.read_cuda(Runtime())
    assert (r.available, r.total, r.source) == (30 * GB, 80 * GB, "cudaMemGetInfo")
    assert free_memory.read_cuda(Failing()) is None


# -- the rule ---------------------------------------------------------------------------------------

TOTAL = 1000 * MB


def reading(free, pressure=NORMAL):
    return Reading(free, TOTAL, pressure)


def test_short_of_memory_gives_back_until_the_middle_is_free():
    rule = MovingBudget(ceiling=400 * MB, floor=10 * MB)
    # 100 MB free of 1000 (below 12.5%): give back 87.5 MB so that 18.75% is free again
    assert rule.target(400 * MB, reading(100 * MB), now=0) == 400 * MB - 87_500_000
    # far below: not under one expert per layer
    assert rule.target(50 * MB, reading(1 * MB), now=0) == 10 * MB
    # between the two shares: stays
    assert rule.target(300 * MB, reading(200 * MB), now=0) == 300 * MB
    # no reading: stays
    assert rule.target(300 * MB, None, now=0) == 300 * MB
    assert rule.target(300 * MB, Reading(None, TOTAL), now=0) == 300 * MB


def test_the_oss_pressure_gives_back_a_share_even_with_memory_free():
    rule = MovingBudget(ceiling=400 * MB, floor=10 * MB)
    assert rule.target(400 * MB, reading(200 * MB, SHORT), now=0) == 300 * MB
    assert rule.target(400 * MB, reading(200 * MB, CRITICAL), now=0) == 200 * MB
    # a step per span of the OS's average (PSI's avg10): the average does not fall at once
    rule.moved(400 * MB, 300 * MB, now=100.0)
    assert rule.target(300 * MB, reading(200 * MB, SHORT), now=105.0) == 300 * MB
    assert rule.target(300 * MB, reading(200 * MB, SHORT), now=110.0) == 225 * MB
    # nor does it grow while the OS reports pressure
    assert rule.target(300 * MB, reading(900 * MB, SHORT), now=105.0) == 300 * MB
    # short of memory itself: at once
    assert rule.target(300 * MB, reading(100 * MB, SHORT), now=105.0) == 212_500_000


def test_grows_with_free_memory_up_to_the_ceiling_not_right_after_a_shrink():
    rule = MovingBudget(ceiling=400 * MB, floor=10 * MB)
    rule.moved(400 * MB, 100 * MB, now=100.0)
    # 300 MB free (25% is 250): grow by 50, but not within GROW_AFTER_SECONDS of the shrink
    assert rule.target(100 * MB, reading(300 * MB), now=101.0) == 100 * MB
    later = 100.0 + moving_budget.GROW_AFTER_SECONDS
    assert rule.target(100 * MB, reading(300 * MB), now=later) == 150 * MB
    assert rule.target(100 * MB, reading(900 * MB), now=later) == 400 * MB  # the ceiling
    # a step below MIN_MOVE_SHARE of the ceiling is not worth remaking the banks
    assert rule.target(100 * MB, reading(255 * MB), now=later) == 100 * MB
    rule.moved(100 * MB, 400 * MB, now=later)
    s = rule.summary()
    assert (s["budget_low_gb"], s["budget_high_gb"]) == (0.1, 0.4)
    assert (s["budget_shrinks"], s["budget_grows"]) == (1, 1)


def test_it_starts_where_free_memory_allows_before_anything_is_allocated():
    rule = MovingBudget(ceiling=800 * MB, floor=10 * MB)
    assert rule.start(None) == 800 * MB
    assert rule.start(reading(1000 * MB)) == 800 * MB
    # 300 MB free: the cache may take what leaves 18.75% (187.5 MB) free
    assert rule.start(reading(300 * MB)) == 112_500_000
    assert rule.start(reading(100 * MB)) == 10 * MB
    assert rule.start(reading(1000 * MB, SHORT)) == 500 * MB  # under pressure: half what is free
    assert (rule.low, rule.high) == (500 * MB, 500 * MB)


def test_mlxs_buffer_cache_counts_as_free(monkeypatch):
    # freed buffers MLX keeps for reuse are given back with the cache's own (``mx.clear_cache``):
    # counted as used, a cache would shrink for them, then grow again once they were cleared
    cache = SimpleNamespace(budget_bytes=400 * MB, budget_due=None)
    watch = moving_budget.BudgetWatch(cache, MovingBudget(400 * MB, 10 * MB), lambda: reading(0))
    monkeypatch.setattr(moving_budget.mx, "get_cache_memory", lambda: 300 * MB)
    watch.check()
    assert cache.budget_due is None  # 300 MB of 1000 free: no move
    monkeypatch.setattr(moving_budget.mx, "get_cache_memory", lambda: 0)
    watch.check()
    assert cache.budget_due == 212_500_000  # nothing free: give back until 18.75% is


# -- the cache, while a decode runs ------------------------------------------------------------------


class GivenMemory:
    """A reader of free memory whose answer the test sets."""

    def __init__(self):
        self.now = None

    def __call__(self):
        return self.now


def generated(model, steps=STEPS, between=None):
    return generate_steps(model, PROMPT, steps, between)


assert_same = assert_same_steps


@pytest.fixture(scope="module")
def expected(q3_path):
    stock, _ = load_stock(q3_path)
    return generated(stock)


def bank_bytes(cache):
    """The bytes the banks' arrays hold now (what the cache really takes)."""
    return sum(b.array(s.proj, s.part).nbytes for b in cache.banks for s in b.layer.parts)


# no thread: the test takes each reading itself, at the moments it chooses
BY_HAND = CacheTuning(budget_check_seconds=None)


def _following(q3_path, monkeypatch, given=None, **options):
    # (no host tier: on mlx-cuda two tiers keep a fixed budget; 0 is what the CPU takes anyway)
    given = given or GivenMemory()  # the reader from the load on: the banks are planned there
    monkeypatch.setattr(free_memory, "read_host", given)
    monkeypatch.setattr(free_memory, "read_device", given)
    model, _ = load_streaming(q3_path, tuning=BY_HAND, expert_host_gb=0, **options)
    cache = model.expert_streaming.cache
    cache.memory_reader = given
    return model, cache, given


def cache_limit() -> int:
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    return limit


def test_a_decode_gives_memory_back_under_pressure_and_grows_again_exactly(
    q3_path, expected, monkeypatch
):
    model, cache, given = _following(q3_path, monkeypatch)
    one_per_layer = per_slot(model)
    total_experts = cache.total_expert_bytes
    seen, limits, limit = [], [], cache_limit()

    def between(i):
        watch = cache.budget_watch
        if i == 6:  # the cache has grown to every expert; another program takes nearly all
            assert cache.resident_bytes == total_experts
            given.now = Reading(0, 100 * total_experts)
        elif i == 14:  # it has gone: memory is free again (past the wait after a shrink)
            given.now = Reading(90 * total_experts, 100 * total_experts)
            watch.clock = lambda: 1e9
        else:
            given.now = None  # no answer: the budget holds
        watch.check()
        seen.append(cache.budget_due)
        limits.append(cache_limit())

    got = generated(model, between=between)
    assert_same(expected, got)
    s = model.expert_streaming.stats()
    # it shrank to one expert per layer while the decode ran, then grew back to every expert
    assert s["budget_low_gb"] == one_per_layer / GB
    assert s["budget_high_gb"] == total_experts / GB
    assert (s["budget_shrinks"], s["budget_grows"]) == (1, 1)
    assert seen[6] == one_per_layer and seen[14] == total_experts
    # MLX keeps no more than one expert per layer of freed buffers while the budget is below its
    # ceiling (applied at the call after the check), and its own limit again once back
    assert limits[7] == one_per_layer and limits[-1] == limit
    assert cache.budget_bytes == total_experts
    assert bank_bytes(cache) == total_experts
    assert "budget" in model.expert_streaming.stats_line()


def test_the_banks_really_shrink_and_keep_the_most_used_experts(q3_path, expected, monkeypatch):
    model, cache, given = _following(q3_path, monkeypatch)
    generated(model, steps=8)
    # the banks' background fill ended and installed (as a call would), and what it left (an
    # expert staged when it began, by a read that was dropped, it never reads) loaded: every bank
    # complete and none of its experts landing after ``before`` (a slow disk's fill did, at the
    # budget's check; a fill that left one never completed the banks: both seen on a loaded CPU)
    for _ in range(2000):
        for b in cache.banks:
            with b.lock:
                b.install_finished()
        if not any(t.is_alive() for t in cache._fills.started) and not any(
            b.staged for b in cache.banks
        ):
            break
        time.sleep(0.005)
    for b in cache.banks:
        missing = np.flatnonzero(b.slot_of < 0)
        if len(missing):
            b.load(missing)
    assert all((b.slot_of >= 0).all() for b in cache.banks)
    bank = cache.banks[0]
    uses = bank.table.policy
    before = {int(e) for e in np.nonzero(bank.slot_of >= 0)[0]}
    # half the experts' bytes must go: each bank keeps the 8 its policy ranks highest
    given.now = Reading(0, 100 * cache.total_expert_bytes)
    cache.budget_watch.rule.floor = 8 * per_slot(model)
    cache.budget_watch.check()
    resident = np.nonzero(bank.slot_of >= 0)[0]
    gone = uses.victims(resident, 8)
    assert cache.follow_budget()
    assert bank.slots == 8 and not bank.identity
    kept = {int(e) for e in np.nonzero(bank.slot_of >= 0)[0]}
    assert kept == before - {int(e) for e in gone}
    assert bank_bytes(cache) == 8 * per_slot(model)
    # every kept expert's bytes moved with it: the rest of the decode is stock's
    assert_same(expected, generated(model))


def test_a_pinned_budget_never_moves_and_a_given_one_is_a_ceiling(q3_path, monkeypatch):
    model, cache, given = _following(q3_path, monkeypatch, expert_cache_fixed=True)
    generated(model, steps=4)
    assert cache.budget_watch is None and cache.moving is None
    cache.budget_due = per_slot(model)
    assert not cache.follow_budget()
    assert "budget" not in model.expert_streaming.stats_line()
    # a given budget of 4 experts per layer: pressure takes it down, free memory not above it
    four = 4 * per_slot(model)
    model, cache, given = _following(q3_path, monkeypatch, expert_cache_gb=(four + 0.5) / GB)
    generated(model, steps=4)
    given.now = Reading(100 * four, 100 * four)
    cache.budget_watch.check()
    assert cache.budget_due is None and cache.budget_bytes == four
    given.now = Reading(0, 100 * four)
    cache.budget_watch.check()
    assert cache.follow_budget() and cache.budget_bytes == per_slot(model)


def test_plan_says_what_the_cache_does_under_pressure_and_how_to_pin_it(q3_path, capsys):
    from mlx_lm_streaming.__main__ import main as cli

    assert cli(["plan", str(q3_path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "memory pressure" in x)
    assert "12.5%" in line and "25%" in line and "one expert per MoE layer" in line
    assert "--expert-cache-fixed" in line and "MLX_LM_STREAMING_CACHE_FIXED=1" in line


def test_a_cache_loaded_while_memory_is_short_starts_small_and_grows(
    q3_path, expected, monkeypatch
):
    probe, _ = load_streaming(q3_path)
    total = probe.expert_streaming.cache.total_expert_bytes
    probe.expert_streaming.close()
    given = GivenMemory()  # short at the load, where the banks are planned
    given.now = Reading(0, 100 * total)
    model, cache, given = _following(q3_path, monkeypatch, given)
    assert cache.total_expert_bytes == total
    # the load line says why the cache is smaller than its budget
    line = report.choice_line(model.expert_streaming)
    assert f"(default: {report.LOWERED}" in line or f", {report.LOWERED})" in line, line
    got = generated(model, steps=4)
    assert cache.budget_bytes == per_slot(model) and bank_bytes(cache) == per_slot(model)
    given.now = Reading(100 * cache.total_expert_bytes, 100 * cache.total_expert_bytes)
    cache.budget_watch.check()
    got += generated(model, steps=4)
    assert bank_bytes(cache) == cache.total_expert_bytes
    assert_same(expected[:4] * 2, got)


def test_a_bad_pin_is_one_line_naming_it(environ):
    from mlx_lm_streaming.errors import ConfigurationError
    from mlx_lm_streaming.runtime.options import StreamingOptions

    with pytest.raises(ConfigurationError, match="expert_cache_fixed must be"):
        StreamingOptions(expert_cache_fixed="maybe")
    environ.update({"MLX_LM_STREAMING_EXPERTS": "1", "MLX_LM_STREAMING_CACHE_FIXED": "maybe"})
    with pytest.raises(ConfigurationError, match="MLX_LM_STREAMING_CACHE_FIXED='maybe'"):
        StreamingOptions.from_env()


def test_a_move_that_runs_out_of_memory_leaves_the_bank_as_it_was(q3_path, expected, monkeypatch):
    from mlx_lm_streaming.runtime.bank import layer_bank

    model, cache, given = _following(q3_path, monkeypatch)
    generated(model, steps=4)
    take, calls = mx.take, []

    def take_until_out_of_memory(*args, **kwargs):  # the second bank's first part fails
        calls.append(1)
        if len(calls) == len(cache.banks[0].layer.parts) + 1:
            raise RuntimeError("[malloc] Unable to allocate 1234 bytes.")
        return take(*args, **kwargs)

    monkeypatch.setattr(layer_bank.mx, "take", take_until_out_of_memory)
    given.now = Reading(0, 100 * cache.total_expert_bytes)
    cache.budget_watch.check()
    assert cache.follow_budget()
    monkeypatch.setattr(layer_bank.mx, "take", take)
    one, untouched = cache.banks[0], cache.banks[1:]
    assert one.slots == 1 and all(b.slots == b.num_experts and b.identity for b in untouched)
    assert "Unable to allocate" in model.expert_streaming.stats()["budget_error"]
    assert "a move stopped: RuntimeError" in model.expert_streaming.stats_line()
    assert_same(expected, generated(model))  # every bank still consistent: stock's tokens
