"""The host work of a verified step found complete (``verified_step.VerifiedStep.commit``): each
call's distinct experts, and the policies' records of their uses, all banks at once."""

from typing import Optional

import numpy as np

from ..bank import note_hits
from ..policy import PolicyRows


def distinct_per_call(flat: np.ndarray, sizes: list):
    """Each call's distinct experts, sorted (``np.unique`` of each), from ``flat``: the calls' ids
    one after another, ``sizes`` of each. Calls of one size (a token's layers): each call's ids
    sorted as one row of a 2-D array, its rows the answer where no id repeats in one (top-k ids
    never do); else (or where one does) one sort of all the ids, call j's offset by j << 32, kept
    where unlike the one before. Not ``np.unique`` (12 µs on 32 ids where a sort takes 1)."""
    if len(set(sizes)) == 1:
        rows = np.sort(flat.reshape(len(sizes), -1), axis=1)
        if (rows[:, 1:] != rows[:, :-1]).all():
            return rows
    calls = np.arange(len(sizes), dtype=np.int64) << 32
    ids = flat + np.repeat(calls, sizes)
    ids.sort()
    first = np.ones(len(ids), dtype=bool)
    np.not_equal(ids[1:], ids[:-1], out=first[1:])
    ids = ids[first]
    ends = np.searchsorted(ids, calls + (1 << 32)).tolist()
    ids &= (1 << 32) - 1
    return np.split(ids, ends[:-1])


def note_uses(banks: list, experts: list) -> tuple:
    """Each of ``banks`` found every one of its ``experts`` (unique int64 ids) resident and loaded
    nothing (a verified step's commit): the policies' records of the uses, at once for all banks
    (``PolicyRows.use``: their policies joined here once, every bank of the cache, where they can
    be), and the banks' counters (``note_hits``), the banks' locks held (taken in model order, as
    ``load_together``'s; a join takes every bank's). Returns ``(hits, misses)`` summed."""
    policies, rows = [], banks[0].table.policy.rows
    for bank in banks:  # (loops, not comprehensions: on Python 3.11 those are calls)
        bank.lock.acquire()
        policies.append(bank.table.policy)
        if policies[-1].rows is not rows:
            rows = None
    try:
        if rows is None:  # (joined once; again after a bank's policy was made anew)
            rows = join(banks[0].cache.banks)
        if rows is None:  # (policies of several kinds: each its own record)
            for policy, used in zip(policies, experts):
                policy.use(used)
        else:
            rows.use(policies, experts)
        return note_hits(banks, experts)
    finally:
        for bank in banks:
            bank.lock.release()


def join(every: list) -> Optional[PolicyRows]:
    """The policies of ``every`` bank joined (``PolicyRows``), under their locks; None where they
    cannot be (``PolicyRows.joinable``)."""
    for bank in every:
        bank.lock.acquire()
    try:
        policies = [bank.table.policy for bank in every]
        return PolicyRows(policies) if PolicyRows.joinable(policies) else None
    finally:
        for bank in every:
            bank.lock.release()
