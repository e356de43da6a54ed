"""Writes of expert bytes into a layer's slots: reads issued, landed experts handed out as they
land.

Two ways in. Direct reads: the store reads each missed expert straight into its slot's memory
through a host view of the bank, on the cache's demand threads. Staged writes: bytes read in the
background (lookahead, next wave, fill), or demand reads where the bank has no host view, land in
staging buffers first and are written into the slots (``_write``): through the banks' host views
(``copy_in``, for staging buffers in host memory) or by MLX slice updates (``install``). With a
host cache (host_cache.py) a third: misses it holds are copied from it by MLX updates, and are not
read; the load's victims are copied into it before any slot is written.

``landings`` is one load's reads, as ``concurrent.futures.as_completed`` hands out finished
futures: a generator that the bank primes (its first step issues every read and yields None), then
yields each landing as it comes, and whose end (or ``close()``) waits for every read still in
flight. Its caller computes between landings; control never comes back up through a callback.

Part of the bank unit (``mlx_lm_streaming.runtime.bank``): called by ``LayerBank`` under its lock, on the
thread that calls the layer.
"""

import queue
import time
from typing import Dict

import mlx.core as mx
import numpy as np

from ...errors import ExpertIOError, StreamingError
from .index import PROJECTIONS
from .prefetch import StagedBatch
from .safetensors_header import mx_dtype

# the order in which a load read by projection reads an expert's projections: the two the layer
# can compute from its input first, the one that needs both last
PHASE_ORDER = ("gate_proj", "up_proj", "down_proj")
assert sorted(PHASE_ORDER) == sorted(PROJECTIONS)


def _ended():
    yield from ()


# the landings of a load with nothing to read: a generator that has ended (iterating or closing it
# runs nothing)
NOTHING_TO_READ = _ended()
next(NOTHING_TO_READ, None)


def landings(bank, experts, slots, counts, by_projection=False, alone=False):
    """Make each of ``experts`` resident in its slot of ``slots`` (from staged background reads
    where there are, from the store for the rest), as a generator of landings:

    - the first step (the bank's priming ``next``) issues the reads (direct reads: handed to the
      demand threads; staged bytes written into their slots first) and yields None;
    - then each landing, ``(ids, proj, slot)``: ``proj`` None: the experts ``ids`` are resident
      (mapped in the table); else (``by_projection``: each expert read one projection at a time,
      in ``PHASE_ORDER``, with direct reads) expert ``ids[0]``'s projection ``proj`` landed in
      ``slot``, before the expert is resident (its other projections are still read);
    - at its end every read has ended; the bank's counters get ``counts``
      (``(hits, misses, evicted)``) and the first error is raised. Closed early (the caller
      raised), it still waits for every read; landings after an error are not mapped.

    ``alone``: the load runs beside other banks' loads (``verified_step.load_together``): each
    expert read on one demand thread, never spread over the store's readers."""
    start = time.perf_counter()
    tl = bank.cache.timeline
    by_batch: Dict[int, tuple] = {}
    popped: Dict[int, StagedBatch] = {}
    failed = []  # (expert, error) whose background read failed: read again below
    rest = []
    for e, slot in zip(experts.tolist(), slots.tolist()):
        batch = bank.staged.pop(e, None) if bank.staged else None
        if batch is not None:
            stats = bank.cache.prefetch_stats
            popped[id(batch)] = batch
            waited = time.perf_counter()
            good = batch.ok(wait=True)
            with stats.lock:
                stats.waited_s += time.perf_counter() - waited
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
    groups = list(by_batch.values())
    io = time.perf_counter() - start
    install = 0.0
    host, held = bank.cache.host_cache, ()
    try:
        if host is not None:  # before any slot is written: the victims kept, the misses it holds
            rest, held = host.take(bank, rest, counts[2])
        if bank.direct:
            installed = []
            if groups:  # first: their MLX update must not race with the direct writes
                install += _write(bank, groups)
                installed = _place(bank, groups)
            if held:  # (an MLX update too)
                installed += host.serve(bank, held)
            reads = DirectReads(bank, rest, by_projection, alone)
            try:
                yield None  # issued
                if installed:
                    yield installed, None, None
                # each landing as it comes; the first read error raised once every read has
                # ended (experts that landed before it stay resident)
                events = reads.events
                while reads.pending:
                    t = time.perf_counter()
                    pair, proj, exc = events.get()
                    reads.waited += time.perf_counter() - t
                    tl.span("wait read", t, "wait", layer=bank.path, expert=pair[0], part=proj)
                    if proj is not None:
                        if reads.error is None:
                            yield [pair[0]], proj, pair[1]
                        continue
                    reads.pending -= 1
                    if exc is not None:
                        reads.error = reads.error or exc
                    elif reads.error is None:
                        bank.table.place([pair[0]], [pair[1]])
                        yield [pair[0]], None, None
                if reads.error is not None:
                    raise reads.error
            finally:
                io += reads.finish()
        else:
            yield None  # nothing is read before the caller asks for the first landing
            if held:
                yield host.serve(bank, held), None, None
            # the rest from the store, in chunks of at most the staging bound (a prefill wave
            # can miss a whole bank's worth of experts: its bytes need not all be staged at once)
            chunk = max(1, bank.cache.staging_limit // max(1, bank.layer.expert_nbytes))
            for i in range(0, len(rest), chunk):
                part = rest[i : i + chunk]
                batch = StagedBatch(bank.layer, np.array([e for e, _ in part]), "demand")
                t = bank.cache.stats.read_began()
                try:
                    bank.cache.store.read_many(batch.jobs())
                finally:
                    bank.cache.stats.read_ended()
                io += time.perf_counter() - t
                tl.batch_read(t, batch)
                if groups:  # staged ones after the first read: it overlaps the layer's work
                    install += _write(bank, groups)
                    yield _place(bank, groups), None, None
                    groups = []
                read = [(batch, list(range(len(part))), [s for _, s in part])]
                install += _write(bank, read)
                del batch
                yield _place(bank, read), None, None
            if groups:
                install += _write(bank, groups)
                yield _place(bank, groups), None, None
    except StreamingError as err:
        if failed:  # the read again failed too: say that the background read had failed first
            err.args = (
                f"{err} (the background read of expert {failed[0][0]} of {bank.path} had "
                f"failed first: {type(failed[0][1]).__name__}: {failed[0][1]})",
            )
        raise
    finally:
        if popped:
            still = {id(b) for b in bank.staged.values()}
            for key, batch in popped.items():
                if key not in still:
                    bank.cache.release(batch)
        bank.cache.stats.add_time(io, install)
    hits, misses, evicted = counts
    bank.hits += hits
    bank.misses += misses
    bank.cache.stats.add(hits, misses, evicted)
    if bank.identity and not bank.complete:
        bank.note_complete()


def _write(bank, groups) -> float:
    """Staged rows into their slots; the seconds it took."""
    t = time.perf_counter()
    if bank.direct and all(batch.host for batch, _, _ in groups):
        copy_in(bank, groups)
    else:
        install(bank, groups)
    return time.perf_counter() - t


def _place(bank, groups) -> list:
    """Map the experts of staged ``groups`` (written) to their slots; their ids."""
    ids, slots = [], []
    for batch, rows, group_slots in groups:
        ids.extend(int(batch.experts[r]) for r in rows)
        slots.extend(group_slots)
    bank.table.place(ids, slots)
    return ids


class DirectReads:
    """Direct reads of ``(expert, slot)`` pairs into the slots' memory, issued when made: each
    expert on its own demand thread, or (``by_projection``) a projection at a time, one expert
    after the other, so that the first expert's projections land first rather than share the disk
    with the others' (the store still reads a projection's parts in parallel). ``landings`` takes
    their events as they come (``events``: ``((expert, slot), projection or None, error or
    None)``, ``pending`` experts still read); ``finish()`` waits for the rest."""

    def __init__(self, bank, pairs, by_projection=False, alone=False):
        self.bank = bank
        self.pending = len(pairs)
        self.waited = 0.0
        self.error = None
        self.events: "queue.SimpleQueue" = queue.SimpleQueue()
        if not pairs:
            return
        stream = bank.last_stream
        if stream is not None and stream != mx.default_stream(mx.default_device()):
            mx.synchronize(stream)  # work of the previous call, if on another stream, has ended
        parts = bank.layer.parts
        # a few experts: each one's ranges spread over the store's readers; more, or loads of
        # several banks at once (``alone``): each expert read by its own demand thread alone
        # (``CacheTuning.spread_reads_upto``)
        upto = bank.cache.tuning.spread_reads_upto
        spread = upto is None or (len(pairs) <= upto and not alone)
        read_slot = slot_reader(bank, spread=spread)
        if by_projection:
            groups = [
                (proj, [i for i, spec in enumerate(parts) if spec.proj == proj])
                for proj in PHASE_ORDER
            ]
        else:
            groups = [(None, list(range(len(parts))))]
        # (a demand thread's: records unconditionally)
        events, tl, stats = self.events, bank.cache.timeline, bank.cache.stats

        def read(pair):
            e, slot = pair
            start = stats.read_began()
            try:
                for g, (proj, members) in enumerate(groups):
                    read_slot(e, slot, members)
                    if g < len(groups) - 1:
                        events.put((pair, proj, None))
            except BaseException as exc:
                stats.read_ended()
                events.put((pair, None, exc))
                return
            stats.read_ended()
            tl.read(start, bank.path, e, bank.layer.expert_nbytes, "demand", slot=slot)
            events.put((pair, None, None))

        def read_in_turn(batch):
            for pair in batch:
                read(pair)

        def cancelled(future, batch):
            # reads that never ran (their pool shut down with cancel_futures) still report
            if future.cancelled():
                for pair in batch:
                    error = ExpertIOError(
                        f"{bank.path}: the read of expert {pair[0]} was cancelled"
                    )
                    events.put((pair, None, error))

        # one batch of every pair, or a batch of one per pair (``zip``: no comprehension's call)
        batches = [tuple(pairs)] if by_projection else list(zip(pairs))
        pool = bank.cache.demand_pool
        for batch in batches:
            pool.submit(read_in_turn, batch).add_done_callback(lambda f, b=batch: cancelled(f, b))

    def finish(self) -> float:
        """Wait for every read still in flight (landings not mapped: the caller stopped taking
        them); the seconds waited for reads."""
        while self.pending:
            t = time.perf_counter()
            _, proj, _ = self.events.get()
            self.waited += time.perf_counter() - t
            if proj is None:
                self.pending -= 1
        return self.waited


def slot_reader(bank, spread: bool = True):
    """``read(expert, slot, members)``: the bank parts ``members`` of ``expert`` read into
    ``slot``'s memory through the bank's host views (as they are now), or on mlx-cuda into a
    page-locked buffer and copied there by the device (``bank.copier``, cuda_copy.py); spread over
    the store's reader pool, or (``spread`` False) on the calling thread alone. For direct reads
    (``DirectReads``)."""
    store = bank.cache.store
    read_ranges = store.read_many if spread else store.read_on_this_thread
    views, refs = bank.views, bank.layer.refs
    copier = bank.copier
    if copier is not None:
        starts = bank.view_addresses  # (the views' own addresses)
        rows = [view.shape[1] for view in views]

        def read(expert, slot, members):
            expert_refs = refs(expert)
            copier.read(read_ranges, [(expert_refs[i], starts[i] + slot * rows[i]) for i in members])

        return read

    def read(expert, slot, members):
        expert_refs = refs(expert)
        read_ranges([(expert_refs[i], memoryview(views[i][slot])) for i in members])

    return read


def install(bank, groups) -> None:
    """Write staged rows into slots, one slice copy per run of consecutive slots, then evaluate.

    Slice copies run at memcpy speed on the CPU backend; a scatter with a slot index array was
    slower (docs/benchmarks/README.md, "Behind the code's constants")."""
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
    experts = sum(len(rows) for _, rows, _ in groups)
    bank.cache.timeline.span("install", start, "install", layer=bank.path, experts=experts)


def copy_in(bank, groups) -> None:
    """With direct reads: write staged rows into slots through the banks' host views, a memcpy per
    run of consecutive slots, with no MLX update (no evaluation, no views to remake). Safe where a
    direct read into the same slots is (the unit's docstring): the slots are the call's victims,
    which no pending work reads. Used for batches with host buffers, which banks make on the CPU
    backend only (``LayerBank.stage``): there it is faster than MLX buffers and updates; on the
    H200 it was faster alone but slower inside decode, where the GPU last touched the slots'
    memory (docs/benchmarks/README.md, "Behind the code's constants")."""
    start = time.perf_counter()
    for batch, rows, slots in groups:
        runs = _runs(rows, slots)
        for view, staged in zip(bank.views, batch.buffers):
            for r, s, n in runs:
                view[s : s + n] = staged[r : r + n]
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
        install(bank, groups)
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
