"""The device tier's counts over every bank at once: one table a batch, not a loop over banks.

``Tiers`` (tiers.py) counts each batch's ids and chooses each bank's swaps at a decode step's first
MoE call, on the decode's own thread, where the host's time is the step's on a GPU (a step of 16
MoE layers builds in ~0.3 ms on an H100's host). Bank by bank, that was ~40 numpy calls a bank,
0.36-0.64 ms a batch at 16 layers on this CPU; here the same counts, the same swaps and the same
decay are a handful of calls over a ``(banks, experts)`` table whose rows each ``BankTier`` keeps
as its own arrays (``counts``, ``device``, ``fresh``: views, so a bank's arrays are the table's).
Banks of fewer experts than the most leave the rest of their row unused (never counted, never
chosen). The result is the loop's, number for number: tests/test_tiers.py replays the traces.
"""

from typing import List

import numpy as np


class TierTable:
    """The rows of ``tiers`` (``BankTier`` each, in the order their ids are gathered): their
    arrays become views of the table's, their values kept."""

    def __init__(self, tiers: List) -> None:
        experts = np.array([t.bank.num_experts for t in tiers], dtype=np.int64)
        shape = (len(tiers), int(experts.max()) if len(tiers) else 0)
        self.counts, self.fresh = np.zeros(shape), np.zeros(shape)
        self.device = np.zeros(shape, dtype=bool)
        self.real = np.arange(shape[1]) < experts[:, None]  # (a row's experts, not its padding)
        self.experts = experts
        # the pairs a row may swap at most: every device expert out, or every host expert in
        capacity = np.array([t.capacity for t in tiers], dtype=np.int64)
        self.pairs = np.minimum(capacity, experts - capacity)
        self.tiers = tiers
        for i, t in enumerate(tiers):
            n = t.bank.num_experts
            for name in ("counts", "fresh", "device"):
                row = getattr(self, name)[i, :n]
                row[:] = getattr(t, name)
                setattr(t, name, row)

    def count(self, flat, spans) -> tuple:
        """The ids of a batch (``flat``, each bank's at ``spans[id(tier)]``; None: none) added to
        the counts (``fresh`` their own), each row's ids outside its experts left out: ``(uses
        the device served, uses)`` a row, before any swap."""
        self.fresh[:] = 0
        rows = len(self.tiers)
        if flat is None or not len(flat):
            return np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        row = np.full(len(flat), -1, dtype=np.int64)
        for i, t in enumerate(self.tiers):
            start, end = spans.get(id(t), (0, 0))
            row[start:end] = i
        keep = row >= 0
        row, ids = row[keep], flat[keep]
        keep = (ids >= 0) & (ids < self.experts[row])
        row, ids = row[keep], ids[keep]
        width = self.counts.shape[1]
        self.fresh += np.bincount(row * width + ids, minlength=self.counts.size).reshape(
            self.counts.shape
        )
        self.counts += self.fresh
        on = np.bincount(row, weights=self.device[row, ids], minlength=rows).astype(np.int64)
        return on, np.bincount(row, minlength=rows)

    def shift(self, keep: float) -> None:
        """A routing shift: the counts before the last batch weigh ``keep``."""
        self.counts[:] = self.fresh + keep * (self.counts - self.fresh)

    def swaps(self, ratio, margin, decay, min_skew=0.0, z=0.0) -> List:
        """Each row's hottest experts outside the device tier swap places with the coldest in it,
        pair by pair (ties by expert order), while the one coming in beats the one going out by
        ``ratio`` and ``margin`` and by ``z`` standard deviations of the difference chance makes
        between counts kept ``decay`` a batch (by any count where that one was never used); the
        counts then keep ``decay``. A row whose counts are as even as chance makes them (``skew``
        below ``min_skew``) swaps nothing. ``device`` changed; ``(row, the experts that swap)`` of
        each row that swaps, in order."""
        counts, device, out = self.counts, self.device, []
        noise = z * z / (1 + decay)  # (``_beats``' chance, for counts kept ``decay`` a batch)
        # the first pair of a row (its hottest host expert, its coldest device one) decides
        # whether any pair of it wins: only rows where it does are sorted
        hottest = np.where(~device & self.real, counts, -np.inf).max(axis=1, initial=-np.inf)
        coldest = np.where(device, counts, np.inf).min(axis=1, initial=np.inf)
        first = _beats(hottest, coldest, ratio, margin, noise)
        if min_skew:
            first &= self.skew(decay) >= min_skew
        rows = np.flatnonzero(first & (self.pairs > 0))
        if len(rows):
            c, d, most = counts[rows], device[rows], int(self.pairs[rows].max())
            cold = np.argsort(np.where(d, c, np.inf), axis=1, kind="stable")[:, :most]
            hot = np.argsort(np.where(~d & self.real[rows], -c, np.inf), axis=1, kind="stable")
            hot = hot[:, :most]
            c_cold = np.take_along_axis(c, cold, axis=1)
            c_hot = np.take_along_axis(c, hot, axis=1)
            wins = _beats(c_hot, c_cold, ratio, margin, noise)
            wins &= np.arange(most) < self.pairs[rows, None]
            # pairs while each wins: up to the first that does not
            k = np.where(wins.all(axis=1), most, np.argmin(wins, axis=1))
            for j, i in enumerate(rows.tolist()):
                n = int(k[j])
                device[i, cold[j, :n]] = False
                device[i, hot[j, :n]] = True
                out.append((i, np.concatenate([cold[j, :n], hot[j, :n]])))
        counts *= decay
        return out

    def skew(self, decay: float) -> np.ndarray:
        """Each row's index of dispersion: its counts' variance over their mean, times ``1 +
        decay``. A batch's uses of an expert are about Poisson, and counts kept ``decay`` a batch
        then vary by their mean over ``1 + decay``: routing that favours no expert (uniform, as a
        random-weight router's) gives about 1, where every swap follows chance and serves nothing
        more (the Qwen3.6 shape at a quarter: 10 moves a token, the device serving 0.25 of uses
        either way); the real traces' layers give 5 and more once counted (tests/test_tiers.py)."""
        n = self.real.sum(axis=1)
        mean = np.where(self.real, self.counts, 0.0).sum(axis=1) / np.maximum(n, 1)
        var = np.where(self.real, (self.counts - mean[:, None]) ** 2, 0.0).sum(axis=1)
        return var / np.maximum(n, 1) / np.where(mean > 0, mean, np.inf) * (1 + decay)


def _beats(hot, cold, ratio: float, margin: float, noise: float = 0.0):
    """Where a count ``hot`` beats ``cold`` by ``ratio`` and ``margin``, and by more than chance
    (``(hot - cold)^2 > noise * (hot + cold)``: Poisson uses, ``noise`` z^2 over 1 + the decay),
    or by any count where ``cold`` is 0 (an expert never used since loading)."""
    used = cold != 0
    beats = hot > cold * ratio + np.where(used, margin, 0.0)
    if noise:
        beats &= ~used | ((hot - cold) ** 2 > noise * (hot + cold))
    return beats
