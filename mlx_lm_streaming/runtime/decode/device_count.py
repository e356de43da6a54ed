"""A held step's misses counted on the device, its ids read for the policies a window at a time.

On mlx-cuda (0.32.x) an array a kernel wrote lives in device memory (``cudaMallocAsync``); a host
read of one longer than 8 bytes (numpy's view, ``tolist``) makes MLX move it to managed memory
first (``Buffer::raw_ptr``: a ``cudaMallocManaged``, a copy, the device buffer freed), and the moved
buffer, recycled by MLX's allocator, is later handed to kernels whose writes fault its pages
back. Stock reads one such value a token, its sample, a 4-byte scalar from MLX's scalar pool
(managed from the start: nothing moves). A held step's check (``StepRunner._check``) read its
calls' ids, a ``(layers, k)`` array, every token.

``CacheTuning.count_on_device``: the check reads instead a 4-byte count made on the device with
the token (``misses``: each call's ids looked up in its bank's map of missing experts as the call
saw it, the maps stacked once while they stay the same objects, then summed). A step found
complete leaves its host work (``VerifiedStep.commit``: the policies' records of its uses) for
later (``StepRunner.deferred``): every ``WINDOW`` held steps, the decode thread joins their ids
on the device with the last one's token (``join_window``), and the flush that commits them reads
that one array (``commit_deferred``): one host read, one move, for ``WINDOW`` tokens. A flush
before a window is full (a miss, the counters read, a step of another mode) reads the ids of the
steps not covered one by one, as before. The policies see the same uses in the same order before
any load can evict (every load flushes first), so the cache's state, and the logits, are those of
the check that reads the ids every token. A step that missed reads its ids as before.

Measured on the CPU only (exact, tests/test_device_count.py); off by default until an H100 or
H200 run says whether it pays (docs/benchmarks/streaming-path.md, "The seventeenth session").
"""

from operator import is_
from typing import List

import mlx.core as mx
import numpy as np

# held steps whose ids one host read brings back (``join_window``)
WINDOW = 16


def hold(step, rows) -> None:
    """A held step's count (``misses``) and its place in the window (``join_window``), where its
    calls' ids were stacked (``rows``, a row per call) and no routing recorder wants every step's
    ids at its check; else its check reads its ids as before."""
    runner = step.runner
    if rows is None or runner.state.cache.recorder is not None:
        return
    step.count = misses(runner, step.calls, rows)
    join_window(runner, step)


def misses(runner, calls, rows) -> mx.array:
    """The number of ``calls``' ids (``rows``: their stacked ids, a row per call) that their
    banks' host maps of missing experts (as each call saw them) mark, as a lazy 4-byte scalar.
    The maps are stacked into one device array once while they stay the same objects (a bank's
    map is made anew whenever its table changes: ``LayerBank.device_map``)."""
    maps = [call[3] for call in calls]
    held = runner.count_maps
    if held is None or len(held[0]) != len(maps) or not all(map(is_, held[0], maps)):
        stacked = mx.array(np.stack(maps).astype(np.uint32))
        held = runner.count_maps = (maps, stacked)
    return mx.take_along_axis(held[1], rows, axis=1).sum()


def join_window(runner, step) -> None:
    """``step`` (held, its ids made) joins the decode thread's window; at ``WINDOW`` steps their
    ids are joined on the device (evaluated with ``step``'s token: ``Held.arrays``) and each step
    of the window is told where its ids are in that array."""
    window = runner.count_window
    window.append(step)
    if len(window) < WINDOW:
        return
    runner.count_window = []
    joined = mx.concatenate([s.ids for s in window])
    at = 0
    for s in window:
        s.joined = (joined, at, step)
        at += s.ids.size
    step.joined_here = joined


def host_ids(array: mx.array) -> np.ndarray:
    """A window's joined ids on the host (the one read, and move, of the window)."""
    return np.array(array, copy=False)


def commit_deferred(steps: List, cache) -> None:
    """The host work of ``steps`` (found complete, in check order): their ids read, each window's
    once where the step that made the window's array has been checked (its token computed: else
    the read would wait for it), the others' one by one, then each step committed in turn."""
    checked = {id(s) for s in steps}
    read = {}
    for step in steps:
        flat = None
        joined = step.joined
        if joined is not None and id(joined[2]) in checked:
            array, at, _ = joined
            host = read.get(id(array))
            if host is None:
                host = read[id(array)] = host_ids(array)
            flat = host[at : at + step.ids.size]
        step.joined = None
        step.commit(cache, flat)
