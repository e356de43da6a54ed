"""The expert cache's budget following free memory, where the user did not pin it.

With no budget given the default share (``machine.DEFAULT_CACHE_SHARE``) is the most the cache
takes, with ``--expert-cache-gb`` the given budget; unless ``--expert-cache-fixed`` pins it, a
background thread (``BudgetWatch``) reads free memory (``free_memory``) every ``CHECK_SECONDS`` and
moves the budget between one expert per MoE layer and that ceiling (``MovingBudget.target``):

- short of memory (less than ``LOW_FREE_SHARE`` of the memory free, or the OS says so): the cache
  gives back enough for ``MID_FREE_SHARE`` to be free again, and at least ``PRESSURE_STEP`` of
  itself when the OS reports pressure (half of itself where critical; a step per
  ``PRESSURE_EVERY_SECONDS``, the span the OS averages its pressure over);
- plenty free (more than ``HIGH_FREE_SHARE``), no pressure, and no shrink in the last
  ``GROW_AFTER_SECONDS``: it grows by what is free above ``HIGH_FREE_SHARE``, up to the ceiling;
- in between it stays.

It starts, before the banks are first made, at the ceiling where that leaves ``MID_FREE_SHARE``
free, else at what does (``MovingBudget.start``). The thread only decides. The cache applies a new
budget on the model's thread between two model calls (``follow``, from ``StepRunner.__call__``),
never inside one: its least useful experts (the eviction policy's victims) leave, the banks are
made again at their new size with the kept experts' bytes copied, and MLX's buffer cache is emptied
so the resident set falls (``give_back_memory``). A graph built before (mlx-lm builds step t+1
before t is evaluated) holds the old arrays, which live until it ran; nothing writes them after. So
a change of size never changes a token.
"""

import math
import threading
import time
import weakref
from dataclasses import replace
from typing import Callable, Optional

import mlx.core as mx

from ..decode.modes import PER_LAYER
from ..sizes import decimal_gb
from . import free_memory, machine as memory
from .free_memory import CRITICAL, NORMAL, Reading

# seconds between two readings of free memory
CHECK_SECONDS = 1.0
# shares of the memory (``Reading.total``) that decide: below LOW free, shrink until MID is free;
# above HIGH free, grow by what is free above HIGH
LOW_FREE_SHARE = 0.125
MID_FREE_SHARE = 0.1875
HIGH_FREE_SHARE = 0.25
# the least share of itself the cache gives back when the OS reports pressure (SHORT)
PRESSURE_STEP = 0.25
# the least time between two shrinks asked for by the OS's pressure alone (its average's span: PSI's
# avg10): a shrink does not lower the average at once
PRESSURE_EVERY_SECONDS = 10.0
# no growth this long after a shrink (the memory given back must not be taken again at once)
GROW_AFTER_SECONDS = 10.0
# a move smaller than this share of the ceiling is not made (each move copies the kept experts)
MIN_MOVE_SHARE = 1 / 32


def plan_line(cache) -> str:
    """What the cache does under memory pressure, for ``mlx_lm_streaming plan``."""
    if cache.tiers is not None or cache.host_cache is not None:
        return (
            "under memory pressure: the budget stays fixed (two tiers or a host cache on "
            "mlx-cuda: their placement is planned once)"
        )
    floor = sum(b.layer.expert_nbytes for b in cache.banks)
    return (
        "under memory pressure: the budget is a ceiling; with less than "
        f"{LOW_FREE_SHARE:.1%} of the memory free (or the OS reporting pressure) the cache gives "
        "its least used experts' memory back to the OS, down to one expert per MoE layer "
        f"({decimal_gb(floor)}), and grows again above {HIGH_FREE_SHARE:.0%} free; "
        "--expert-cache-fixed (MLX_LM_STREAMING_CACHE_FIXED=1) pins it"
    )


class MovingBudget:
    """The budget's rule (module docstring): ``target(current, reading, now)`` in bytes, between
    ``floor`` (one expert per MoE layer) and ``ceiling``; and the budget's low, high and moves
    over the run, for ``--streaming-stats``."""

    def __init__(self, ceiling: int, floor: int):
        self.ceiling, self.floor = int(ceiling), int(min(floor, ceiling))
        # the budget now, and its least and most over the run
        self.budget = self.low = self.high = int(ceiling)
        self.shrinks = self.grows = 0
        self.last_shrink: Optional[float] = None
        # the first error that stopped a move, for the stats (a bank that could not be made again
        # keeps its size and contents: the next move tries again)
        self.error: Optional[str] = None

    def start(self, reading: Optional[Reading]) -> int:
        """The budget before anything is allocated: the ceiling where ``MID_FREE_SHARE`` of the
        memory stays free besides it (or nothing is known), else what leaves that much free, at
        least ``floor``; counted as the budget's first value (its low and high)."""
        budget = self.ceiling
        if reading is not None and reading.available is not None and reading.total:
            room = int(reading.available - MID_FREE_SHARE * reading.total)
            if reading.pressure != NORMAL:
                room = min(room, reading.available // 2)
            budget = max(self.floor, min(self.ceiling, room))
        self.budget = self.low = self.high = budget
        return budget

    def target(self, current: int, reading: Optional[Reading], now: float) -> int:
        """The budget for ``current`` bytes of budget now, given ``reading`` (None: unknown, stay)."""
        if reading is None or reading.available is None or not reading.total:
            return current
        free, total = reading.available, reading.total
        want = current
        since = math.inf if self.last_shrink is None else now - self.last_shrink
        # the OS's pressure is an average over the last 10 s: one step per such span
        pressed = reading.pressure != NORMAL and since >= PRESSURE_EVERY_SECONDS
        if free < LOW_FREE_SHARE * total or pressed:
            want = current - max(0, int(MID_FREE_SHARE * total - free))
            if pressed and reading.pressure == CRITICAL:
                want = min(want, current // 2)
            elif pressed:
                want = min(want, int(current * (1 - PRESSURE_STEP)))
        elif reading.pressure == NORMAL and free > HIGH_FREE_SHARE * total:
            if since >= GROW_AFTER_SECONDS:
                want = current + int(free - HIGH_FREE_SHARE * total)
        want = max(self.floor, min(self.ceiling, want))
        if abs(want - current) < MIN_MOVE_SHARE * self.ceiling and self.floor < want < self.ceiling:
            return current
        return want

    def moved(self, before: int, after: int, now: float) -> None:
        """The cache's budget went from ``before`` to ``after``."""
        if after < before:
            self.shrinks += 1
            self.last_shrink = now
        elif after > before:
            self.grows += 1
        self.budget = after
        self.low, self.high = min(self.low, after), max(self.high, after)

    def summary(self) -> dict:
        return {
            "budget_low_gb": self.low / 1e9,
            "budget_high_gb": self.high / 1e9,
            "budget_ceiling_gb": self.ceiling / 1e9,
            "budget_shrinks": self.shrinks,
            "budget_grows": self.grows,
            "budget_error": self.error,
        }


class BudgetWatch:
    """The background thread: every ``interval`` s a reading, and the budget it asks for put on
    the cache (``ExpertCache.budget_due``) for its model thread to apply between calls."""

    def __init__(
        self,
        cache,  # expert_cache.ExpertCache
        rule: MovingBudget,
        reader: Callable[[], Optional[Reading]],
        interval: float = CHECK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cache, self.rule, self.reader = cache, rule, reader
        self.interval, self.clock = interval, clock
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._loop, name="mlx-lm-streaming-budget", daemon=True
        )
        self._thread.start()

    def check(self) -> None:
        """One reading; a budget other than the cache's is left for its model thread."""
        cache = self.cache
        current = cache.budget_bytes
        reading = self.reader()
        if reading is not None and reading.available is not None:
            # MLX's buffer cache (freed buffers it keeps for reuse: large on Metal and CUDA) is
            # ours to give back at once (``give_back_memory``): free memory too, or the cache
            # would shrink for it and grow again once it was cleared
            reading = replace(reading, available=reading.available + mx.get_cache_memory())
        want = self.rule.target(current, reading, self.clock())
        cache.budget_due = want if want != current else None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # a failed reading leaves the budget where it is
                self.cache.budget_due = None

    def close(self, wait: bool = True) -> None:
        self._stop.set()
        thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()


# -- the cache's side (``ExpertCache``: ``follow_memory``, ``moving``, ``budget_watch``) ------------


def watch(cache) -> None:
    """``cache``'s budget becomes the ceiling of a moving one, which starts where free memory
    allows now (``MovingBudget.start``: nothing is allocated yet), and its thread starts; before
    the banks are first planned. Not with two tiers or a host cache (their placement is planned
    once: docs/usage.md)."""
    if cache.tiers is not None or cache.host_cache is not None or cache.budget_bytes is None:
        return
    floor = sum(b.layer.expert_nbytes for b in cache.banks)
    cache.moving = MovingBudget(min(cache.budget_bytes, cache.total_expert_bytes), floor)
    reader = cache.memory_reader or free_memory.reader_for(memory.cuda_memory_bytes() is not None)
    cache.budget_watch = BudgetWatch(cache, cache.moving, reader)
    cache.budget_bytes = cache.moving.start(reader())
    seconds = cache.tuning.budget_check_seconds
    if seconds is not None:
        cache.budget_watch.interval = seconds
        cache.budget_watch.start()


def follow(cache) -> bool:
    """Apply the budget the watch asked for (``cache.budget_due``), between two model calls on the
    model's thread (``StepRunner.__call__``): every bank made again at its new slot count
    (``LayerBank.resize``: the least useful experts leave; kept ones are copied), then MLX's
    freed buffers given back to the OS (``give_back_memory``). Not while another thread's call
    runs or several threads call the layers (a bank cannot be remade under a call). Whether it
    moved."""
    want, cache.budget_due = cache.budget_due, None
    before, moving = cache.budget_bytes, cache.moving
    if want is None or want == before or not cache.planned or moving is None:
        return False
    if cache.shared or cache.mode is not PER_LAYER:
        return False
    if cache.steps is not None:
        cache.steps.flush()  # the last verified step's uses, recorded under the old table
    cache.budget_bytes = want
    banks = cache.banks
    try:
        for bank, slots in zip(banks, cache.plan_slots()):
            bank.resize(slots)
    except Exception as e:  # (MLX out of memory): the banks not made again keep their size
        moving.error = moving.error or f"{type(e).__name__}: {e}"
    cache.all_complete = all(b.complete for b in banks)
    moving.moved(before, want, cache.budget_watch.clock())
    give_back_memory(moving)
    return True


# MLX's buffer cache limit as it was before a cache's budget fell below its ceiling, and the
# budgets below their ceilings now (``give_back_memory``)
_cache_limit: Optional[int] = None
_BELOW: "weakref.WeakSet[MovingBudget]" = weakref.WeakSet()


def give_back_memory(moving: MovingBudget) -> None:
    """After the banks were made again: MLX's freed buffers go back to the OS (``mx.clear_cache``)
    and, while some budget of this process is below its ceiling, MLX keeps at most one expert per
    layer's bytes of freed buffers (``mx.set_cache_limit``: the arrays that a graph built before
    still holds are freed when it ran, and go back then), the limit as it was once every budget is
    back at its ceiling. On Linux with glibc, ``malloc_trim`` returns the heap's free pages too."""
    global _cache_limit
    if moving.budget < moving.ceiling:
        _BELOW.add(moving)
    else:
        _BELOW.discard(moving)
    if _BELOW and _cache_limit is None:
        _cache_limit = mx.set_cache_limit(min(m.floor for m in _BELOW))
    elif not _BELOW and _cache_limit is not None:
        mx.set_cache_limit(_cache_limit)
        _cache_limit = None
    mx.clear_cache()
    memory.trim_heap()
