"""The wave engine: a call's experts through a bank's slots, a wave at a time, each expert read once.

One engine for every call that computes rows expert by expert: a decode or prefill layer call
(``schedules.Direct``, ``schedules.Waves``) and a layer of layer-major prefill over a group of
chunks (``layer_pass``). The caller hands it the experts in the order it wants them (resident
first: no read) and its ``work``, which computes rows:

- ``work.rows(ids)``: the rows of experts ``ids`` computed and submitted (``mx.async_eval``), each
  output appended to ``work.outs``;
- ``work.landed(ids, proj, slot)`` (direct reads): experts ``ids`` landed (``proj``: one projection
  of one expert, with ``by_projection``); it computes their rows now or puts them in
  ``work.waiting``, whose rows the engine computes at the end of the wave.

Direct reads (``direct``): with more experts than slots, waves of half the slots, each read into
the slots the wave two back used once that one finished computing, so a wave's reads overlap the
wave before's compute; the resident experts' rows submitted while the wave is read. Staged reads
(``staged``): waves of the bank's slots, each loaded (never evicting one the wave uses) then
computed and evaluated before the next takes the slots, the next wave read in the background
meanwhile. Both compute every (token, expert) row once, by the caller's kernel, over the same slot
bank: the engine moves reads, never what is computed.

Part of the bank unit: on the thread that calls the layer, under the bank's lock.
"""

import mlx.core as mx
import numpy as np

from ..reads import lookahead
from ..reads.prefetch import WAVE


def direct(bank, ordered: np.ndarray, work, by_projection: bool = False) -> None:
    """``ordered`` experts' rows through ``work`` (module docstring), with direct reads; every row
    submitted, none waited for but those a later wave's slots needed."""
    if len(ordered) <= bank.slots:
        waves, overlap = [ordered], False
    else:
        size = max(1, bank.slots // 2)
        overlap = 2 * size <= bank.slots  # room for a wave next to the one computing
        waves = [ordered[i : i + size] for i in range(0, len(ordered), size)]
    outs, waiting = work.outs, work.waiting
    ends = []  # len(outs) after each wave
    for w, wave in enumerate(waves):
        # the wave whose slots this one may take has finished computing
        back = w - 2 if overlap else w - 1
        if back >= 0:
            wait(bank, outs[: ends[back]])
        keep = np.concatenate([waves[w - 1], wave]) if overlap and w > 0 else wave
        if bank.staged:
            if w == 0:
                take_staged(bank, wave, keep)
            else:
                # installing them now (an MLX update of a bank that pending work reads) would
                # copy the whole bank: read them again directly instead
                bank.discard_staged()
        hit = wave[bank.slot_of[wave] >= 0]
        landings = bank.reads(wave, keep, by_projection=by_projection)  # issued
        try:
            if len(hit):
                work.rows(hit)  # while they are read
            for ids, proj, slot in landings:
                work.landed(ids, proj, slot)
        finally:
            landings.close()  # (after an error: every read has ended)
        if waiting:
            work.rows(np.array(waiting))
            waiting.clear()
        ends.append(len(outs))


def staged(bank, experts: np.ndarray, work, ahead=None) -> None:
    """``experts``' rows through ``work.rows`` in waves of the bank's slots, without direct reads
    (module docstring); after the last wave the next layer's lookahead guess ``ahead`` is read in
    the background. Each wave under the bank's lock; all but the last waited for."""
    size = bank.slots
    waves = [experts[i : i + size] for i in range(0, len(experts), size)]
    for w, wave in enumerate(waves):
        last = w + 1 == len(waves)
        with bank.lock:
            bank.load(wave)
            # read ahead while this wave computes: the next wave, or after the last one the next
            # layer's guess
            if not last:
                bank.stage(waves[w + 1], "wave", WAVE, fit=True)
            elif ahead is not None:
                lookahead.stage(*ahead)
            done = len(work.outs)
            work.rows(wave)
            if not last:
                wait(bank, work.outs[done:])  # finish this wave before the next takes the slots


def take_staged(bank, experts, keep) -> None:
    """Before any of this call's work is pending: write the experts read in the background into
    their slots (an MLX update, which would copy a bank that pending work reads)."""
    if bank.identity:
        bank.install_finished()
    staged = [e for e in experts.tolist() if e in bank.staged]
    if staged:
        # counted once, as misses, by the call's own load of ``experts`` (not as a miss here
        # and a hit there), and one call to the policy
        bank.load(np.array(staged, dtype=np.int64), keep=keep, guessed=True)


def submit(bank, y) -> None:
    """``mx.async_eval(y)``: the layer's compute handed to MLX (a timeline span)."""
    tl = bank.cache.timeline
    start = tl.now()
    mx.async_eval(y)
    tl.span("submit", start, "compute", layer=bank.path)


def wait(bank, y) -> None:
    """``mx.eval(y)`` where the layer waits for its own compute (a timeline span)."""
    tl = bank.cache.timeline
    start = tl.now()
    mx.eval(y)
    tl.span("wait compute", start, "wait", layer=bank.path)
