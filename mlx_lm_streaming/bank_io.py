"""Bank I/O: the writes of expert bytes into a layer's slot bank.

Two ways in. Direct reads: the store reads each missed expert straight into its slot's memory
through a host view of the bank, on the cache's demand threads, and each expert is reported as it
lands, so the layer computes its rows while the others are still read. Staged writes: bytes read in
the background (lookahead, next wave, fill), or demand reads where the bank has no host view, land
in staging buffers first and are copied into the slots with MLX slice updates (``_install``).

Functions of a ``LayerBank`` (bank.py), called under its lock on the thread that calls the layer.
"""

import queue
import threading
import time
from typing import Dict

import mlx.core as mx
import numpy as np

from .errors import ExpertIOError, StreamingError
from .index import PROJECTIONS
from .prefetch import StagedBatch
from .safetensors_header import mx_dtype

# the order in which a phased direct read (``read_direct``) reads an expert's projections: the two
# the layer can compute from its input first, the one that needs both last
PHASE_ORDER = ("gate_proj", "up_proj", "down_proj")
assert sorted(PHASE_ORDER) == sorted(PROJECTIONS)


def read_into_slots(
    bank,
    experts: np.ndarray,
    slots: np.ndarray,
    ready=None,
    part_ready=None,
    started=None,
) -> None:
    """Bytes from staged background reads where there are, from the store for the rest; each
    expert is mapped to its slot once its bytes are there, and reported to ``ready``.
    ``started()``: called once (``LayerBank.load``): with direct reads when the store's reads have
    been issued, else before they are read (staged reads end before this returns)."""
    start = time.perf_counter()
    stats = bank.cache.prefetch_stats
    tl = bank.cache.timeline
    groups = []  # (batch, rows of the batch, slots)
    rest = []
    by_batch: Dict[int, tuple] = {}
    popped: Dict[int, StagedBatch] = {}
    failed = []  # (expert, error) whose background read failed: read again below
    for e, slot in zip(experts.tolist(), slots.tolist()):
        batch = bank.staged.pop(e, None)
        if batch is not None:
            popped[id(batch)] = batch
            waited = time.perf_counter()
            good = batch.ok(wait=True)
            with stats.lock:
                stats.waited_s += time.perf_counter() - waited
            if tl:
                tl.span("wait staged", waited, "wait", layer=bank.path, expert=e)
            if good:
                by_batch.setdefault(id(batch), (batch, [], []))
                by_batch[id(batch)][1].append(batch.row[e])
                by_batch[id(batch)][2].append(slot)
                stats.add("used", batch.kind, 1)
                continue
            if batch.future.done() and not batch.future.cancelled():
                failed.append((e, batch.future.exception()))
        rest.append((e, slot))
    groups.extend(by_batch.values())
    io = time.perf_counter() - start
    install = 0.0

    def resident(pairs):
        ids = [e for e, _ in pairs]
        bank.table.place(ids, [s for _, s in pairs])
        if ready is not None:
            ready(ids)

    def write(groups):
        nonlocal install
        t = time.perf_counter()
        if bank.direct and all(batch.host for batch, _, _ in groups):
            _copy_in(bank, groups)
        else:
            _install(bank, groups)
        install += time.perf_counter() - t
        for batch, rows, group_slots in groups:
            resident([(int(batch.experts[r]), s) for r, s in zip(rows, group_slots)])

    try:
        if bank.direct:
            # staged ones first: their MLX update must not race with the direct writes
            if groups:
                write(groups)
                groups = []
            io += read_direct(bank, rest, resident, part_ready, started)
        else:
            if started is not None:
                started()
            # the rest from the store, in chunks of at most the staging bound (a prefill wave
            # can miss a whole bank's worth of experts: its bytes need not all be staged at once)
            chunk = max(1, bank.cache.staging_limit // max(1, bank.layer.expert_nbytes))
            for i in range(0, len(rest), chunk):
                part = rest[i : i + chunk]
                t = time.perf_counter()
                batch = StagedBatch(bank.layer, np.array([e for e, _ in part]), "demand")
                bank.cache.store.read_many(batch.jobs())
                io += time.perf_counter() - t
                if tl:
                    tl.batch_read(t, batch)
                if groups:  # staged ones after the first read: it overlaps the layer's work
                    write(groups)
                    groups = []
                write([(batch, list(range(len(part))), [s for _, s in part])])
                del batch
            if groups:
                write(groups)
    except StreamingError as err:
        if failed:  # the read again failed too: say that the background read had failed first
            err.args = (
                f"{err} (the background read of expert {failed[0][0]} of {bank.path} had "
                f"failed first: {type(failed[0][1]).__name__}: {failed[0][1]})",
            )
        raise
    finally:
        still = {id(b) for b in bank.staged.values()}
        for key, batch in popped.items():
            if key not in still:
                bank.cache.release(batch)
        bank.cache.stats.add_time(io, install)


# set on a thread whose load runs beside other banks' (``verified_step.load_together``): its
# experts are read each on one demand thread, never spread (several loads in flight already keep the
# readers busy; on the H200 8 experts spread read at 3.4 GB/s, each alone at 5.2)
ALONE = threading.local()


def slot_reader(bank, spread: bool = True):
    """``read(expert, slot, members)``: the bank parts ``members`` of ``expert`` read into ``slot``'s
    memory through the bank's host views (as they are now), spread over the store's reader pool,
    or (``spread`` False) on the calling thread alone. For direct reads (``read_direct``)."""
    store = bank.cache.store
    read_ranges = store.read_many if spread else store.read_on_this_thread
    views, refs = bank.views, bank.layer.refs
    copier = bank.copier
    if copier is not None:  # on mlx-cuda: device copies from a page-locked buffer (cuda_copy.py)
        starts = [view.ctypes.data for view in views]
        rows = [view.shape[1] for view in views]

        def read(expert, slot, members):
            expert_refs = refs(expert)
            copier.read(read_ranges, [(expert_refs[i], starts[i] + slot * rows[i]) for i in members])

        return read

    def read(expert, slot, members):
        expert_refs = refs(expert)
        read_ranges([(expert_refs[i], memoryview(views[i][slot])) for i in members])

    return read


def read_direct(bank, pairs, resident, part_landed=None, started=None) -> float:
    """Read each ``(expert, slot)`` into the slot's memory, in parallel; report each expert to
    ``resident`` as it lands. Every read has ended when
    this returns, also on error (the first error is raised then; experts that landed stay
    resident). Returns the seconds waited.

    ``part_landed(expert, slot, proj)``, if given: each expert is read one projection at a time, in
    ``PHASE_ORDER``, and this is called (on this thread) as each projection but the last lands,
    so that the caller can start computing it (``schedules.ByProjection``).
    ``started()``, if given: called (on this thread) once every read has been handed to the demand
    threads, before the first wait (at once if there is nothing to read)."""
    if not pairs:
        if started is not None:
            started()
        return 0.0
    stream = bank.last_stream
    if stream is not None and stream != mx.default_stream(mx.default_device()):
        mx.synchronize(stream)  # work of the previous call, if on another stream, has ended
    parts = bank.layer.parts
    # a few experts: each one's ranges spread over the store's readers; more, or loads of several
    # banks at once (``alone``): each expert read by its own demand thread alone
    # (``CacheTuning.spread_reads_upto``)
    upto = bank.cache.tuning.spread_reads_upto
    spread = upto is None or (len(pairs) <= upto and not getattr(ALONE, "on", False))
    read_slot = slot_reader(bank, spread=spread)
    if part_landed is None:
        groups = [(None, list(range(len(parts))))]
    else:
        groups = [
            (proj, [i for i, spec in enumerate(parts) if spec.proj == proj]) for proj in PHASE_ORDER
        ]
    events: "queue.SimpleQueue" = queue.SimpleQueue()
    tl = bank.cache.timeline

    def read(pair):
        e, slot = pair
        start = time.perf_counter()
        try:
            for g, (proj, members) in enumerate(groups):
                read_slot(e, slot, members)
                if g < len(groups) - 1:
                    events.put((pair, proj, None))
        except BaseException as exc:
            events.put((pair, None, exc))
            return
        if tl:
            tl.read(start, bank.path, e, bank.layer.expert_nbytes, "demand", slot=slot)
        events.put((pair, None, None))

    def read_in_turn(batch):
        for pair in batch:
            read(pair)

    def cancelled(future, batch):
        # reads that never ran (their pool shut down with cancel_futures) still report
        if future.cancelled():
            for pair in batch:
                error = ExpertIOError(f"{bank.path}: the read of expert {pair[0]} was cancelled")
                events.put((pair, None, error))

    # experts in parallel, one thread each; a projection at a time, one expert after the other, so
    # that the first expert's projections land first rather than share the disk with the others'
    # (the store still reads a projection's parts in parallel)
    batches = [[p] for p in pairs] if part_landed is None else [list(pairs)]
    pool = bank.cache.demand_pool
    for batch in batches:
        pool.submit(read_in_turn, batch).add_done_callback(lambda f, b=batch: cancelled(f, b))
    pending, error, waited = len(pairs), None, 0.0
    if started is not None:
        try:
            started()
        except BaseException as e:  # still wait for every read before raising
            error = e
    landed = []  # landed and not yet reported

    def report():
        nonlocal error
        if landed and error is None:
            try:
                resident(list(landed))
            except BaseException as e:
                error = e
        landed.clear()

    while pending:
        t = time.perf_counter()
        batch = [events.get()]
        waited += time.perf_counter() - t
        if tl:
            tl.span(
                "wait read", t, "wait", layer=bank.path, expert=batch[0][0][0], part=batch[0][1]
            )
        for pair, proj, exc in batch:
            if proj is not None:
                if error is None:
                    try:
                        part_landed(*pair, proj)
                    except BaseException as e:  # still wait for every read before raising
                        error = e
                continue
            pending -= 1
            if exc is not None:
                report()  # those that landed before it stay resident
                error = error or exc
            else:
                landed.append(pair)
        report()
    if error is not None:
        raise error
    return waited


def _install(bank, groups) -> None:
    """Write staged rows into slots, one slice copy per run of consecutive slots, then evaluate.

    Slice copies run at memcpy speed on the CPU backend; a scatter with a slot index array was
    measured ~7x slower (8 slots of 786 KB: 10 ms vs 1.4 ms)."""
    start = time.perf_counter()
    parts = bank.layer.parts
    for batch, rows, slots in groups:
        runs = _runs(rows, slots)
        total = len(batch.experts)
        for i, spec in enumerate(parts):
            values = batch.part(i).view(mx_dtype(spec.dtype)).reshape(total, *spec.shape)
            target = bank.array(spec.proj, spec.part)
            for r, s, n in runs:
                # in place: the SwitchGLU's own array object is updated
                target[s : s + n] = values[r : r + n]
    # evaluated now, in this thread (see ``LayerBank.allocate``)
    mx.eval([bank.array(spec.proj, spec.part) for spec in parts])
    if bank.views is not None:
        bank.refresh_views()
    if bank.cache.timeline:
        experts = sum(len(rows) for _, rows, _ in groups)
        bank.cache.timeline.span("install", start, "install", layer=bank.path, experts=experts)


def _copy_in(bank, groups) -> None:
    """With direct reads: write staged rows into slots through the banks' host views, a memcpy per
    run of consecutive slots, with no MLX update (no evaluation, no views to remake). Safe where a
    direct read into the same slots is (module docstring of bank.py): the slots are the call's
    victims, which no pending work reads. Used for batches with host buffers, which banks make
    on the CPU backend only (``LayerBank.stage``): there it is faster than MLX buffers and updates;
    on the H200 it was faster alone but slower inside decode, where the GPU last touched the slots'
    memory (docs/benchmarks/README.md, superseded runs)."""
    start = time.perf_counter()
    for batch, rows, slots in groups:
        runs = _runs(rows, slots)
        for view, staged in zip(bank.views, batch.buffers):
            for r, s, n in runs:
                view[s : s + n] = staged[r : r + n]
    if bank.cache.timeline:
        experts = sum(len(rows) for _, rows, _ in groups)
        bank.cache.timeline.span("install", start, "install", layer=bank.path, experts=experts)


def install_finished(bank) -> None:
    """Identity banks: write every finished staged expert into its own slot."""
    start = time.perf_counter()
    stats = bank.cache.prefetch_stats
    batches = {id(b): b for b in bank.staged.values()}
    groups, done = [], []
    for batch in batches.values():
        if not batch.future.done():
            continue
        done.append(batch)
        if not batch.ok(wait=False):
            continue  # a failed background read: those experts are read on demand
        rows = [
            i
            for i, e in enumerate(batch.experts.tolist())
            if bank.staged.get(e) is batch and bank.slot_of[e] < 0
        ]
        if rows:
            experts = batch.experts[rows]
            groups.append((batch, rows, experts.tolist()))
            bank.table.place(experts, experts)
            stats.add("used", batch.kind, len(rows))
    for batch in done:
        for e in batch.experts.tolist():
            if bank.staged.get(e) is batch:
                del bank.staged[e]
    if groups:
        _install(bank, groups)
    for batch in done:
        bank.cache.release(batch)
    if groups:
        bank.cache.stats.add_time(0.0, time.perf_counter() - start)


def _runs(rows, slots):
    """``(first row, first slot, length)`` of each run where rows and slots both step by one."""
    runs = []
    for r, s in zip(rows, slots):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == s:
            runs[-1][2] += 1
        else:
            runs.append([r, s, 1])
    return runs
