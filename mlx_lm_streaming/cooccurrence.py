"""Which experts the next MoE layer will pick, guessed from the ones this layer picked.

A token's experts in consecutive MoE layers are far from independent: on the recorded routing
(docs/routing.md) the experts a token uses at layer L say a good deal about those it uses at layer
L + 1. ``CoactivationPredictor`` counts this online, from the tokens seen so far only:

- ``pairs[L][a, b]``: tokens that used expert ``a`` at layer L and ``b`` at layer L + 1;
- ``uses[L][a]``: tokens that used ``a`` at layer L while layer L + 1 also ran for them.

A guess for layer L + 1 from this token's experts ``E`` at layer L scores each ``b`` by the mean
over ``a`` in ``E`` of P(b at L + 1 | a at L), smoothed: ``pairs[L][a, b] / (uses[L][a] + 1)``; where
layer L - 1 was observed in the same step, that score is averaged with the same one from L - 1's
experts to L + 1 (tables for layers two apart). Scores lie in [0, 1); the best come first; an
expert never seen after any of ``E`` is never guessed.

API (called at each layer's host sync, in the order the layers run):

- ``observe(layer, experts)``: this call of ``layer`` used ``experts``, an int array of shape
  ``(tokens, k)`` (or ``(k,)`` for one token). A call of a layer at or below the last one observed
  starts a new step (so a new call of layer 0 does); ``next_token()`` says so explicitly. The rows
  of consecutive layers in one step are counted as the same tokens, pair by pair, when their counts
  match.
- ``predict(layer, experts, limit, min_score=0.0, exclude=None, ahead=1) -> np.ndarray``: up to
  ``limit`` expert ids (int64, best first) for MoE layer ``layer + ahead`` (``ahead`` 1 or 2), from
  ``experts`` ((tokens, k) or (k,)) at ``layer``, each with score >= ``min_score`` and > 0, none
  where the boolean mask ``exclude`` (num_experts,) is set (e.g. the next bank's ``slot_of >= 0``);
  several tokens' scores are averaged. Empty for the last layer(s) and before anything was learnt.
  Call it after ``observe(layer, ...)`` of the same step (for the layer before's evidence).
- ``scores(layer, experts, ahead=1) -> np.ndarray``: every expert's score (float32, num_experts).

Pure numpy, one float32 (experts x experts) table per layer pair and distance (6 MB for 48 x 128);
a decode call of ``observe`` or ``predict`` costs about 15-40 microseconds, a 512-token call under
1 ms.
"""

from typing import List, Optional

import numpy as np


class CoactivationPredictor:
    """Counts of experts used together in consecutive MoE layers (see the module docstring)."""

    def __init__(self, num_layers: int, num_experts: int, ahead: int = 2):
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.ahead = ahead
        shape = (num_layers, num_experts, num_experts)
        # pairs[d - 1][L]: layer L's experts against layer L + d's, for d = 1..ahead
        self.pairs = [np.zeros(shape, dtype=np.float32) for _ in range(ahead)]
        self.uses = [np.zeros((num_layers, num_experts), dtype=np.float32) for _ in range(ahead)]
        # the current step's one-hot rows per layer (None: not observed in this step)
        self._rows: List[Optional[np.ndarray]] = [None] * num_layers
        self._last = -1

    def next_token(self) -> None:
        """The next call of any layer belongs to a new step (token or batch of tokens)."""
        self._rows = [None] * self.num_layers
        self._last = -1

    def observe(self, layer: int, experts) -> None:
        """This call of ``layer`` used ``experts`` ((tokens, k) or (k,) ids)."""
        if layer <= self._last:
            self.next_token()
        self._last = layer
        ids = np.asarray(experts, dtype=np.int64)
        ids = ids.reshape(-1, ids.shape[-1]) if ids.ndim else ids.reshape(1, 1)
        onehot = np.zeros((len(ids), self.num_experts), dtype=np.float32)
        onehot[np.arange(len(ids))[:, None], ids] = 1.0
        self._rows[layer] = onehot
        for d in range(1, self.ahead + 1):
            before = self._rows[layer - d] if layer >= d else None
            if before is None or len(before) != len(onehot):
                continue
            if len(onehot) == 1:
                a = np.flatnonzero(before[0])
                self.pairs[d - 1][layer - d][a[:, None], ids[0]] += 1.0
            else:
                self.pairs[d - 1][layer - d] += before.T @ onehot
            self.uses[d - 1][layer - d] += before.sum(axis=0)

    def _mean(self, d: int, layer: int, ids: np.ndarray) -> np.ndarray:
        """Mean over ``ids`` at ``layer`` of P(b at layer + d | a), smoothed: pairs / (uses + 1)."""
        count = np.bincount(ids, minlength=self.num_experts)
        a = np.flatnonzero(count)  # each distinct expert once, weighted by its tokens
        weight = count[a] / (self.uses[d - 1][layer][a] + 1.0) / len(ids)
        return weight.astype(np.float32) @ self.pairs[d - 1][layer][a]

    def scores(self, layer: int, experts, ahead: int = 1) -> np.ndarray:
        """Every expert's score for MoE layer ``layer + ahead`` (float32 in [0, 1); 0: never seen).

        For ``ahead == 1`` the layer before, if observed in this step, adds its evidence from two
        layers back: the score is the mean of the two layers' means."""
        if not 1 <= ahead <= self.ahead:
            raise ValueError(f"ahead must be 1..{self.ahead}, not {ahead}")
        if layer + ahead >= self.num_layers:
            return np.zeros(self.num_experts, dtype=np.float32)
        score = self._mean(ahead, layer, np.asarray(experts, dtype=np.int64).reshape(-1))
        before = self._rows[layer - 1] if ahead == 1 and self.ahead >= 2 and layer else None
        if before is not None and self._last == layer:
            score = (score + self._mean(2, layer - 1, np.nonzero(before)[1])) / 2
        return score

    def predict(
        self,
        layer: int,
        experts,
        limit: int,
        min_score: float = 0.0,
        exclude: Optional[np.ndarray] = None,
        ahead: int = 1,
    ) -> np.ndarray:
        """Up to ``limit`` likely experts of MoE layer ``layer + ahead``, best first, none with a
        score below ``min_score`` or of 0, none where the boolean mask ``exclude`` is set."""
        score = self.scores(layer, experts, ahead)
        if exclude is not None:
            score = np.where(exclude, 0.0, score)
        limit = min(limit, self.num_experts)
        if limit <= 0:
            return np.zeros(0, dtype=np.int64)
        top = np.argpartition(-score, limit - 1)[:limit]
        top = top[np.argsort(-score[top], kind="stable")]
        return top[(score[top] > 0) & (score[top] >= min_score)].astype(np.int64)
