"""Budgets side by side for ``mlx_lm_streaming plan --routing-trace``: what each would cost and give.

One row per budget (the default, the given one, and 10% to 100% of the experts' bytes): the slots
per layer that ``ExpertCache.plan_slots`` gives it, total memory (resident weights + the slots), the
decode hit rate of the trace replayed through the cache's own policy (``replay.py``), the GB each
decode token reads, and the decode speed the disk allows: ``disk GB/s / GB read per token``. That is
an upper bound: compute, host syncs and I/O not overlapped with compute come on top (what cold runs
reach of it: docs/benchmarks/README.md). GB are decimal (10**9 bytes) throughout.
"""

import os
import random
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from ..errors import ConfigurationError
from ..option_table import GB
from ..runtime.sizes import decimal_gb, gb_digits
from .replay import replay

# the disk probe reads at most this much, or for about this long, whichever comes first
PROBE_BYTES = 256 * 10**6
PROBE_SECONDS = 1.0
PROBE_THREADS = 4


@dataclass
class BudgetRow:
    label: str  # "default", "given", "30%"
    budget_bytes: int
    slots: List[int]  # per MoE layer, in model order
    memory_bytes: int  # resident weights + the experts the slots hold
    decode_hit_rate: float
    gb_per_token: float  # decimal GB read per decode token
    tok_s: Optional[float]  # decode tokens per second the disk allows; None: no reads


def slots_text(plan: List[int]) -> str:
    """``12`` or ``12; 13 layers get 13`` (what the budget has left gives layers one more)."""
    low = min(plan)
    more = sum(n > low for n in plan)
    layers = "layer gets" if more == 1 else "layers get"
    return f"{low}; {more} {layers} {low + 1}" if more else str(low)


def plan_for(cache, budget_bytes: int) -> List[int]:
    saved = cache.budget_bytes
    cache.budget_bytes = budget_bytes
    try:
        return cache.plan_slots()
    finally:
        cache.budget_bytes = saved


def budget_rows(state, trace, default_bytes: int, gbps: float, given: bool) -> List[BudgetRow]:
    """Rows for the default, the given budget (``given``: the cache's is the given one) and 10% to
    100% of the experts' bytes, by budget; budgets below the minimum are left out."""
    cache = state.cache
    banks = cache.banks
    per_slot = sum(b.layer.expert_nbytes for b in banks)
    from ..runtime.memory.report import cache_bytes  # a budget above every expert's bytes means every expert

    budgets = [("default", cache_bytes(cache, default_bytes))]
    if given:
        budgets.append(("given", cache_bytes(cache, cache.budget_bytes)))
    budgets += [(f"{p}%", cache.total_expert_bytes * p // 100) for p in range(10, 101, 10)]
    rows = []
    for label, budget in budgets:
        if budget < per_slot:
            continue
        plan = plan_for(cache, budget)
        result = replay(trace, plan, cache.policy)
        read = sum(m * b.layer.expert_nbytes for m, b in zip(result.decode_misses, banks))
        per_token = read / result.decode_tokens / 1e9 if result.decode_tokens else 0.0
        used = sum(n * b.layer.expert_nbytes for n, b in zip(plan, banks))
        rows.append(
            BudgetRow(
                label,
                budget,
                plan,
                state.resident_bytes + used,
                result.hit_rate("decode"),
                per_token,
                gbps / per_token if per_token > 0 else None,
            )
        )
    rows.sort(key=lambda r: (r.budget_bytes, r.label[0].isdigit()))
    return rows


def format_table(rows: List[BudgetRow]) -> str:
    head = ("budget", "GB", "slots per layer", "memory GB", "hit rate (decode)", "GB/token")
    head += ("tok/s disk-bound",)
    lines = [head]
    for r in rows:
        rate = "n/a" if r.decode_hit_rate != r.decode_hit_rate else f"{r.decode_hit_rate:.1%}"
        speed = (
            "no reads"
            if r.tok_s is None
            else f"{r.tok_s:.3g}" if r.tok_s < 1000 else f"{r.tok_s:.0f}"
        )
        lines.append(
            (
                r.label,
                gb_digits(r.budget_bytes),
                slots_text(r.slots),
                gb_digits(r.memory_bytes),
                rate,
                gb_digits(r.gb_per_token * GB),
                speed,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i in (0, 2) else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))
        ).rstrip()
        for line in lines
    )


# -- the disk ------------------------------------------------------------------------------------


def _uncached_fd(path) -> Tuple[int, bool]:
    """An fd of ``path`` whose reads bypass (or start without) the page cache, where the OS lets us."""
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return fd, True
    if sys.platform == "darwin":
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
        return fd, True
    return fd, False


def measure_disk(banks) -> Tuple[float, str]:
    """Read expert-sized ranges of the model's expert files at random, page cache bypassed, for
    about ``PROBE_SECONDS`` or ``PROBE_BYTES``: the GB/s, and a line that says how it was measured.
    """
    files = sorted({str(f) for b in banks for f in b.layer.files()})
    chunk = max(1 << 18, min(8 << 20, max(b.layer.expert_nbytes for b in banks)))
    fds, bypassed = [], True
    try:
        jobs = []
        for f in files:
            fd, ok = _uncached_fd(f)
            fds.append(fd)
            bypassed &= ok
            size = os.fstat(fd).st_size
            jobs += [(fd, off) for off in range(0, size, chunk)]
        random.Random(0).shuffle(jobs)
        start = time.perf_counter()
        deadline = start + PROBE_SECONDS
        total = 0

        def read(job):
            if time.perf_counter() > deadline:
                return 0
            return len(os.pread(job[0], chunk, job[1]))

        budget = max(1, PROBE_BYTES // chunk)
        with ThreadPoolExecutor(PROBE_THREADS) as pool:
            total = sum(pool.map(read, jobs[:budget]))
        seconds = max(time.perf_counter() - start, 1e-9)
    finally:
        for fd in fds:
            os.close(fd)
    gbps = total / seconds / 1e9
    how = "page cache dropped first" if bypassed else "page cache NOT bypassed on this OS"
    return gbps, (
        f"disk: {gbps:.3g} GB/s, measured by reading {decimal_gb(total)} of the model's expert "
        f"files in {seconds:.2f} s ({PROBE_THREADS} threads, {decimal_gb(chunk)} reads, {how}; "
        "--disk-gbps X to give it)"
    )


# -- the picture ---------------------------------------------------------------------------------

def plot_hint() -> str:
    """The one line for a missing matplotlib: a command that installs it into this Python, from a
    checkout as from an index (the ``[plot]`` extra is matplotlib alone)."""
    return (
        f"--plot needs matplotlib: {shlex.quote(sys.executable)} -m pip install matplotlib "
        "(what the [plot] extra installs)"
    )


def check_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigurationError(plot_hint()) from None


def plot_path(path) -> Path:
    """Where ``--plot PATH`` writes: checked before anything loads (``outputs.check_output``).
    Without an extension, ``PATH.png``; an extension other than .png, .svg, .pdf is refused."""
    from ..files.outputs import PLOT, PLOT_MAGIC, check_output

    if path is None or not str(path).strip():
        raise ConfigurationError("--plot: an empty path; give a file name such as budget.png")
    path = Path(path)
    if path.is_dir():
        raise ConfigurationError(f"--plot {path}: is a directory, not a file for the plot")
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    if path.suffix.lower() not in PLOT_MAGIC:
        raise ConfigurationError(
            f"--plot {path}: {path.suffix} is not a plot format it writes; use "
            f"{', '.join(PLOT_MAGIC)} (no extension: .png)"
        )
    try:
        return check_output(path, PLOT)
    except ConfigurationError as e:
        raise ConfigurationError(f"--plot {e}") from None


def plot(rows: List[BudgetRow], path, title: str) -> Path:
    """Decode hit rate and disk-bound tok/s against budget (GB), with the default and the given
    budget marked, one image at ``plot_path(path)``, written beside it and renamed over it (with
    ``PLOT_MARK`` in its metadata: a later --plot may replace it); returns that path."""
    from ..files.outputs import PLOT, PLOT_MARK, replace_whole

    path = plot_path(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    marked = [r for r in rows if not r.label.endswith("%")]  # the default and the given budget
    rows = [r for r in rows if r.label.endswith("%")] or rows
    x = [r.budget_bytes / 1e9 for r in rows]
    fig, left = plt.subplots(figsize=(7, 4))
    for r, style in zip(marked, (":", "-.")):
        left.axvline(
            r.budget_bytes / 1e9,
            color="tab:gray",
            linestyle=style,
            label=f"{r.label} budget, {gb_digits(r.budget_bytes)} GB",
        )
    left.plot(x, [100 * r.decode_hit_rate for r in rows], "o-", color="tab:blue")
    left.set_xlabel("expert cache budget (GB)")
    left.set_ylabel("decode hit rate (%)", color="tab:blue")
    left.set_ylim(0, 100)
    right = left.twinx()
    speeds = [r.tok_s for r in rows]
    shown = [(a, s) for a, s in zip(x, speeds) if s is not None]
    if shown:
        right.plot(*zip(*shown), "s--", color="tab:red")
    right.set_ylabel("decode tok/s the disk allows", color="tab:red")
    if marked:
        left.legend(loc="lower right")
    left.set_title(title)
    fig.tight_layout()
    fmt = path.suffix.lower()[1:]
    try:
        return replace_whole(
            path,
            PLOT,
            lambda tmp: fig.savefig(tmp, dpi=100, format=fmt, metadata={"Creator": PLOT_MARK}),
        )
    except ConfigurationError as e:
        raise ConfigurationError(f"--plot {e}") from None
    finally:
        plt.close(fig)
