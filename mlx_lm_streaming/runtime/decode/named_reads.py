"""A verified step's reads issued as its pass names them (``CacheTuning.reads_in_pass``).

A verified step's check reads every MoE call's ids back at once, after the forward, and only then
issues a miss's reads (the missed layer's experts, and as guesses those the pass beyond it named:
``VerifiedStep.named_after``): the disk idles while the pass computes. Here the check waits for
each call's ids in turn (the forward was handed to MLX whole, ``mx.async_eval``, so the device
runs ahead while the host waits on one layer's ids at a time) and issues a bank's reads as soon as
its call's ids say it missed: the first missed call's experts, then, as guesses, those each later
call that missed names and its bank lacks, by ``named_after``'s rules. The counts are
``host_counts``', one call at a time.

Exact: the reads write slots that work of the pass still pending may read, but only in the banks
of the first missed call and those after it, whose decoder layers run again from the one that
missed (the rows this pass computed there are dropped); the layers before it read other banks.
Each bank's lock is held from its issue until its landings are taken (``bank.later_landings``:
by its layer run again where ``replay_as_landed``, else all at once before that run). Used only
where the step can run again from the layer that missed (no whole restart) and no host cache
serves the banks; else the check is ``host_counts`` and the reads go as before. Banks written
through staging (no direct reads: Metal's way) touch no slot here: the missed calls' experts are
read into staging buffers as they are named (``LayerBank.stage``, the ``together`` kind
``load_together`` stages the banks after the first with, the first bank's too), and the check's
loads install them after it, as before. Verified bit-exact on the CPU (tests/test_verified_step.py,
with direct reads and staged; tests/test_parity_hybrids.py) and on an H100 (every step stock's,
direct reads), where it gained 1.02x-1.04x cold, within the runs' spread, and nothing with
uniform routing or gemma-4: off by default (docs/benchmarks/streaming-path.md). The staged way is
unmeasured (Metal: no Mac here).

Sooner still (``CacheTuning.first_call_reads``, on mlx-cuda): where a step's first MoE call often
missed (a cold decode), the check begins only once the whole pass is built and launched (3-5 ms a
token on an H100 or H200, seen on their timelines), so even its first call's reads wait that long.
There the step reads its first MoE call's ids back as soon as that call is built (``look_first``: a
wait for that call alone) and issues its misses' reads then; the rest of the pass is built and
computed while they read, and the check issues the guesses beyond (``issue_after_first``). Exact as
above: they write only that call's bank, whose rows of this pass are dropped. A bank written through
staging has that call's experts staged then, installed by the check's load as before. Measured on an
H100 (cold, 25% and 50%, the Qwen3 trace and uniform routing, every step stock's): 1.065x the
default at the median of 12 rounds, 10 of them faster, the waits on reads 2.6-8.6 ms a token
shorter; so on by default on mlx-cuda. The CPU gained 1-5% (its step is its compute); the staged way
(Metal: no Mac here) is unmeasured, so off there."""

from operator import itemgetter

import mlx.core as mx
import numpy as np

from ..bank.join_ids import join_rows
from ..bank.later_landings import LaterLandings
from ..reads.prefetch import WAVE

_MAP = itemgetter(3)  # (an unchecked call's host map of missing experts)
# the running share of checked steps whose first MoE call missed from which the next steps read
# that call's ids as it is built (``look_first``): a wait for them (~0.3 ms) is lost where the
# call hits, the 3-5 ms its reads start sooner gained where it misses
LOOK_SHARE = 0.25


def may_read_in_pass(step) -> bool:
    """Whether ``step``'s check may issue its reads as its calls' ids come back (module
    docstring)."""
    calls = step.calls
    if not calls or not step.replayable or step.restarted or step.caches.unclaimed_changed():
        return False
    cache = calls[0][1].cache
    return cache.host_cache is None


def count_as_named(step) -> np.ndarray:
    """Per MoE call of ``step`` (``calls``, their ids handed to MLX): how many of its ids its
    bank's host map marks missing, each call's ids read back in turn, the reads of a miss issued
    as they are named; ``step.early`` holds the issued reads' ``LaterLandings`` (None: none)."""
    calls, runner = step.calls, step.runner
    counts = np.zeros(len(calls), dtype=np.int64)
    # (the first call that missed; its reads issued: ``landings``; its own as it was built:
    # ``look_first``'s, taken on here)
    landings, step.looked = step.early, False
    first = -1 if landings is None else 0
    read = runner.guess_precision >= runner.min_precision
    staged = False  # (banks written through staging: their reads begun, loaded as before)
    try:
        for j, (_, bank, indices, missing) in enumerate(calls):
            named = np.array(indices, copy=False).reshape(-1)  # (a wait for this call's ids)
            counts[j] = n = missing[named].sum()
            if not n or j == first:
                continue
            if first < 0:
                first = j
                experts = np.unique(named.astype(np.int64))
                if len(experts) > bank.slots or id(bank) in step.loaded:
                    break  # (``read_missing`` does as it did: nothing issued here)
                if not bank.direct:
                    staged = True
                    bank.stage(experts, "together", WAVE, fit=True)
                    continue
                landings = issue_first(bank, experts)
            elif staged:  # (what ``named_after`` will name, read into staging now)
                if read and runner.together:
                    stage_lacking(step, bank, named)
            elif runner.together:  # (``VerifiedStep.named_after``'s)
                load = guess(step, bank, named, read and bank.direct)
                if load is not None:
                    landings.issue([load])
        else:
            step.early = landings
            return counts
    except BaseException:
        if landings is not None:
            landings.close()
        raise
    # the first miss's reads cannot be issued here: the rest counted at once, nothing issued
    for j in range(first + 1, len(calls)):
        _, _, indices, missing = calls[j]
        counts[j] = missing[np.array(indices, copy=False).reshape(-1)].sum()
    return counts


def issue_first(bank, experts, **args) -> LaterLandings:
    """The first missed call's ``experts`` (a bank read directly), their reads issued into new
    ``LaterLandings`` (its lock held until they are taken), spanned on the timeline as a check's
    load (``args``: the span's more)."""
    bank.cache.ensure_planned()
    tl = bank.cache.timeline
    start = tl.now()
    landings = LaterLandings().issue([(bank, experts, {})])
    tl.span("verify load", start, "read", layer=bank.path, experts=len(experts), **args)
    return landings


def lacking(step, bank, named):
    """A MoE call after ``step``'s first miss that missed, its ids ``named`` (picked on a wrong
    input): ``(experts, lack)``, the distinct experts it names and those its bank lacks; None
    where it lacks none, its bank was loaded in this step or it names more experts than slots (it
    runs in waves, if it comes)."""
    experts = np.unique(named.astype(np.int64))
    lack = experts[bank.slot_of[experts] < 0]
    if not len(lack) or id(bank) in step.loaded or len(experts) > bank.slots:
        return None
    return experts, lack


def stage_lacking(step, bank, named) -> None:
    """A staged bank's call after the first miss: the experts it names and its bank lacks
    (``lacking``) read into staging buffers now (as ``load_together`` reads the banks after the
    first); ``named_after`` counts them at the check, and their loads install them."""
    found = lacking(step, bank, named)
    if found is not None:
        bank.stage(found[1], "together", WAVE, fit=True)


def guess(step, bank, named, read: bool):
    """``(bank, experts, load options)`` reading as guesses the experts a call after ``step``'s
    first miss names and its bank lacks (``lacking``), the call's other experts kept, where
    ``read``; else None. The guess is noted either way (``guessed``: scored at ``commit``)."""
    found = lacking(step, bank, named)
    if found is None:
        return None
    experts, lack = found
    step.guessed.setdefault(id(bank), set()).update(lack.tolist())
    if not read:
        return None
    step.runner.named += len(lack)
    step.guesses_read = True
    return bank, lack, {"keep": experts, "guessed": True}


def look_first(step, bank, indices, missing) -> None:
    """``step``'s first MoE call, just built (``bank``, its ids ``indices``, its bank's host map
    of missing experts): its ids read back now, and where it misses, its experts' reads issued
    (``step.early``; module docstring), or for a bank written through staging (Metal's way)
    read into staging buffers, which the check's load installs. Only where the check may take
    them on: no host cache, a step that may run again from its layer."""
    if bank.cache.host_cache is not None or not step.replayable:
        return
    named = np.array(indices, copy=False).reshape(-1)  # (a wait for this call's ids alone)
    experts = np.unique(named.astype(np.int64))
    if not missing[named].any() or len(experts) > bank.slots:
        return
    if not bank.direct:  # (no slot written: its load after the check installs them)
        step.runner.first_call_reads += bank.stage(experts, "together", WAVE, fit=True) > 0
        return
    step.early, step.looked = issue_first(bank, experts, first=True), True
    step.runner.first_call_reads += 1


def issue_after_first(step, first: int, early) -> bool:
    """The check of a step whose first MoE call's reads ``look_first`` issued (``early``), that
    call ``calls[first]`` found missing: the pass evaluated (no pending work may read a slot the
    guesses' reads write), the guesses beyond it (``named_after``) issued into ``early``; whether
    the call must run again whole (a step that cannot run again from its layer)."""
    mx.eval(step.outputs[step.ran])
    whole = not step.replayable or step.caches.unclaimed_changed()
    early.issue(step.named_after(first, whole) if step.runner.together else [])
    return whole


def call_ids(calls, join: bool = False) -> tuple:
    """``(ids, rows)`` of the MoE calls ``(layer, bank, ids, missing)``: their ids for the check,
    lazy: stacked, a row each, where they have the same shapes (a token's layers; with ``join``,
    ``StepRunner.join``, by one kernel: ``bank.join_ids``), else each call's flattened one after
    another; ``rows``: the stacked ids, or None."""
    ids, same = [], True  # one loop: on Python 3.11 a comprehension is a call
    for _, _, i, _ in calls:  # (``i``: a call's ids, as the router gave them)
        ids.append(i)
        same = same and i.shape == ids[0].shape
    if not ids:
        return None, None
    if same:  # (``join_rows`` called for the kernel only: one call fewer a step elsewhere)
        rows = join_rows(ids, True) if join else mx.stack(ids).reshape(len(ids), -1)
        return rows, rows
    return mx.concatenate([i.reshape(-1) for i in ids]), None


def host_counts(calls, ids) -> tuple:
    """``(the ids read, counts)``: ``ids``, ``call_ids``' (read back here: the one host sync of
    a check; None: no calls), as a host array (None where None; a row per call where stacked:
    ``VerifiedStep.call_row``), and per MoE call ``(layer, bank, ids, missing)`` how many of its
    ids its bank's host map of missing experts (``LayerBank.device_map``, as the call saw it)
    marks, ``missing[ids].sum()``."""
    if ids is None:
        return None, np.zeros(0, dtype=np.int64)
    rows = np.array(ids, copy=False)
    maps = list(map(_MAP, calls))  # (C loops: no Python call per MoE call)
    if rows.ndim == 2 and len(set(map(len, maps))) == 1:
        return rows, np.stack(maps)[np.arange(len(maps))[:, None], rows].sum(axis=1)
    flat, counts, at = rows.reshape(-1), np.empty(len(calls), dtype=np.int64), 0
    for j, (_, _, i, m) in enumerate(calls):
        counts[j] = m[flat[at : at + i.size]].sum()
        at += i.size
    return rows, counts
