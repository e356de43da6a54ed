"""The next-layer lookahead, whole: find a layer's router, guess the next layer's experts, read
them ahead, score the guesses.

At layer L's host sync (``PerLayer.run``) layer L+1's router (``find_router``, kept as
``LayerBank.router``) is applied to layer L's input (``guess``), evaluated in the same sync as layer
L's ids. Once layer L's own reads are issued, the guessed experts that layer L+1 does not hold are read
into staging buffers in the background (``stage``: ``prefetch.ExpertPrefetcher``, priority
``LOOKAHEAD``), most wanted first, while layer L computes. Layer L+1's next load scores the guess
against what it missed (``score``); guesses are read only while a layer's running precision is at least
``CacheTuning.lookahead_min_precision``, so a layer that guesses badly costs neither disk time nor
staging memory. A wrong guess costs a read, never exactness: a staged expert is used only if the layer
asks for it.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .prefetch import LOOKAHEAD

# weight of the newest call in a layer's running precision of guesses
PRECISION_WEIGHT = 0.2


def find_router(parent, num_experts: int):
    """The router of an MoE block: a child that maps the hidden state to one logit per expert.

    Returns a function ``x -> logits`` or None. Used only to predict the next layer's experts, so a
    wrong guess costs reads, never exactness.
    """
    if parent is None or not isinstance(parent, nn.Module):
        return None
    children = parent.children()
    names = sorted(children, key=lambda n: (n not in ("gate", "router"), n))
    for name in names:
        child = children[name]
        if not isinstance(child, nn.Module) or "weight" not in child:
            continue
        weight = child["weight"]
        if not isinstance(weight, mx.array) or weight.ndim != 2 or weight.shape[0] != num_experts:
            continue
        if isinstance(child, (nn.Linear, nn.QuantizedLinear)):
            return child
        # a gate module with its own routing code (DeepSeek's MoEGate): its logits
        return lambda x, m=child: x @ m["weight"].T.astype(x.dtype)
    return None


def guess(bank, x, indices):
    """``(next MoE layer's bank, its predicted expert ids, lazy)``, from its router applied to
    this layer's input, or None."""
    cache = bank.cache
    if not cache.tuning.lookahead:
        return None
    nxt = bank.next_bank
    # identity banks are filled in the background instead
    if nxt is None or nxt.identity or nxt.router is None or nxt.slots == 0:
        return None
    # the ``k`` experts with the largest logits for each row of ``x``, lazily
    k = indices.shape[-1]
    logits = nxt.router(x)
    if k >= logits.shape[-1]:
        return None  # every expert: nothing to predict
    return nxt, mx.stop_gradient(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])


def stage(bank, guess) -> None:
    """Read the experts the next layer is predicted to miss (most wanted first), if its recent
    guesses were good enough; score the guess either way."""
    ids, counts = np.unique(np.array(guess, copy=False), return_counts=True)
    if len(ids) > bank.slots:
        # more than fit at once (prefill): the lowest ids, which the first wave takes
        ids = ids[: bank.slots]
    else:
        ids = ids[np.argsort(-counts, kind="stable")]
    with bank.lock:
        ids = ids[bank.slot_of[ids] < 0].tolist()
        if bank.staged:
            ids = [e for e in ids if e not in bank.staged]
        bank.predicted = set(ids)
        good = bank.ahead_precision >= bank.cache.tuning.lookahead_min_precision
    if not ids or not good:
        return
    bank.stage(np.array(ids), "lookahead", LOOKAHEAD, fit=True)


def score(bank, missing: np.ndarray) -> None:
    """The guess read ahead for ``bank`` (``bank.predicted``) against the experts its call missed:
    counted in the cache's lookahead statistics, and into the bank's running precision."""
    guess, bank.predicted = bank.predicted, None
    hit = len(guess.intersection(missing.tolist()))
    stats = bank.cache.prefetch_stats
    with stats.lock:
        stats.predicted += len(guess)
        stats.predicted_hit += hit
        stats.demand += len(missing)
    if guess:
        bank.ahead_precision += PRECISION_WEIGHT * (hit / len(guess) - bank.ahead_precision)
