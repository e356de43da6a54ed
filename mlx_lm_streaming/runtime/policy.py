"""Which expert a layer's slot bank gives up when it must read another: the eviction policy.

A ``SlotTable`` is one MoE layer's residency: ``slot_of[expert]`` (-1: not resident) and
``expert_of[slot]`` (-1: free). ``admit(experts, keep)`` is the whole decision for one call of the
layer: it tells the policy which experts the call uses, then picks a slot for each missing expert,
free slots first, then the policy's victims among the resident experts that neither the call nor
``keep`` uses (those are pinned: the call computes from them, so their slots are never taken). The
layer's bank (``bank.LayerBank.reads``) reads the missing experts into those slots; a replay of a
routing trace (``tools/replay.py``) drives the same code with no bytes read.

Policies keep per-expert state across evictions (an expert read again keeps its history):

- ``lru``: least recently used; within one call, the router's rank order (the first-ranked expert
  counts as used first).
- ``decay_next`` (default): ``decay``, plus how likely the layer's next call is to use the expert,
  given the experts of this call: learnt online, per layer, from which experts followed which in the
  calls so far (``NEXT_WEIGHT`` times the sum over this call's experts a of P(next call uses b | a)).
  On the traces it adds 0.1-1.5 points of decode hit rate to ``decay`` at every budget, held-out
  halves included (docs/routing.md).
- ``decay``: frequency with exponential aging. Each use adds 1 to the expert's score, and
  every score halves every ``HALF_LIFE`` calls of the layer; the lowest score goes first, the least
  recently used among equals. Replaying real routing (docs/routing.md), it beats LRU at every budget
  tried: it keeps the experts a layer keeps coming back to, where LRU lets one burst of
  rarely-used experts push them out.

Pure Python and numpy: no threads, no MLX.
"""

from typing import Dict, Sequence, Tuple, Type

import numpy as np

from ..errors import ConfigurationError

# calls of a layer after which a use counts half (``decay``); 8-32 all beat LRU on the traces
HALF_LIFE = 16.0
# how much the chance of a use in the next call weighs against ``decay``'s score (``decay_next``);
# 1-8 all beat ``decay`` on the traces, 4 at 32 slots the most
NEXT_WEIGHT = 4.0


class EvictionPolicy:
    """Per-layer policy state, keyed by expert id. ``used`` sees every call's experts, in the
    router's rank order; ``victims`` picks which resident experts to evict; ``evict`` is what the
    slot table asks: prefetched experts not used since go first (``prefetched``)."""

    name = ""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.clock = 0  # calls of the layer
        self.order = 0  # uses, one per expert per call, in rank order
        self.last = np.full(num_experts, -1, dtype=np.int64)  # ``order`` of the last use
        # read ahead on a guess and not used since: on probation, evicted before any other
        self.probation = np.zeros(num_experts, dtype=bool)

    def used(self, experts: np.ndarray) -> None:
        """One call of the layer uses ``experts`` (unique ids, rank order where known)."""
        self.clock += 1
        n = len(experts)
        self.last[experts] = np.arange(self.order, self.order + n)
        self.order += n
        self.probation[experts] = False

    def calling(self, experts: np.ndarray) -> None:
        """A call of the layer is about to use ``experts`` (before its victims, if any, are
        chosen); ``used`` follows once its slots are found."""

    def prefetched(self, experts: np.ndarray) -> None:
        """``experts`` were read ahead on a guess: not a use (no score, no recency), but on
        probation until a call uses them, so a wrong guess is the first to go."""
        self.probation[experts] = True

    def evict(self, candidates: np.ndarray, count: int) -> np.ndarray:
        """``victims``, taken first among the experts on probation."""
        on = self.probation[candidates]
        first, rest = candidates[on], candidates[~on]
        if len(first) >= count:
            return self.victims(first, count)
        if len(first) == 0:
            return self.victims(rest, count)
        return np.concatenate([first, self.victims(rest, count - len(first))])

    def victims(self, candidates: np.ndarray, count: int) -> np.ndarray:
        """``count`` of the resident, unpinned expert ids ``candidates``, to evict."""
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def victims(self, candidates, count):
        order = np.argsort(self.last[candidates], kind="stable")
        return candidates[order[:count]]


class DecayPolicy(EvictionPolicy):
    name = "decay"

    def __init__(self, num_experts: int, half_life: float = HALF_LIFE):
        super().__init__(num_experts)
        self.factor = 0.5 ** (1.0 / half_life)
        # score as of call ``stamp``; aged lazily (only touched experts are updated)
        self.score = np.zeros(num_experts, dtype=np.float64)
        self.stamp = np.zeros(num_experts, dtype=np.int64)

    def scores(self, experts: np.ndarray) -> np.ndarray:
        return self.score[experts] * self.factor ** (self.clock - self.stamp[experts])

    def used(self, experts):
        super().used(experts)
        # ``scores(experts) + 1``, spelt out: once per layer call
        self.score[experts] = (
            self.score[experts] * self.factor ** (self.clock - self.stamp[experts]) + 1.0
        )
        self.stamp[experts] = self.clock

    def victims(self, candidates, count):
        # lowest score first, then least recently used
        order = np.lexsort((self.last[candidates], self.scores(candidates)))
        return candidates[order[:count]]


class DecayNextPolicy(DecayPolicy):
    name = "decay_next"

    def __init__(self, num_experts: int, half_life: float = HALF_LIFE, weight: float = NEXT_WEIGHT):
        super().__init__(num_experts, half_life)
        self.weight = weight
        # follows[a, b]: calls that used a followed by a call that used b; after[a]: calls that used
        # a followed by any call
        self.follows = np.zeros((num_experts, num_experts), dtype=np.float32)
        self.after = np.zeros(num_experts, dtype=np.float32)
        self.previous = None  # the last call's experts
        self.current = None  # the experts of the call choosing victims

    def calling(self, experts):
        # what followed the last call is known now, before this call's victims are chosen
        if self.previous is not None and len(self.previous):
            self.after[self.previous] += 1.0
            # ``follows[previous[:, None], experts] += 1`` through the flat view: the same
            # elements (each pair once: both are unique ids), faster than numpy's 2-D fancy
            # indexing, and this runs for every call of every layer
            pairs = (self.previous[:, None] * self.num_experts + experts).reshape(-1)
            self.follows.reshape(-1)[pairs] += 1.0
        self.current = experts

    def used(self, experts):
        super().used(experts)
        self.current = None
        self.previous = np.asarray(experts, dtype=np.int64)

    def next_use(self, candidates: np.ndarray) -> np.ndarray:
        """Per candidate: the sum over the current call's experts ``a`` of P(next call uses it |
        a call used ``a``), smoothed (``follows / (after + 1)``)."""
        cur = self.current
        if cur is None or len(cur) == 0:
            return np.zeros(len(candidates))
        rows = self.follows[cur[:, None], candidates] / (self.after[cur] + 1.0)[:, None]
        return rows.sum(axis=0)

    def victims(self, candidates, count):
        score = self.scores(candidates) + self.weight * self.next_use(candidates)
        order = np.lexsort((self.last[candidates], score))
        return candidates[order[:count]]


POLICIES: Dict[str, Type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "decay": DecayPolicy,
    "decay_next": DecayNextPolicy,
}
DEFAULT_POLICY = "decay_next"


def make_policy(name: str, num_experts: int) -> EvictionPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown cache policy {name!r}; known: {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(num_experts)


class SlotTable:
    """One layer's expert <-> slot maps and its policy (see the module docstring)."""

    def __init__(self, num_experts: int, policy: str = DEFAULT_POLICY):
        self.num_experts = num_experts
        self.policy_name = policy
        self.policy = make_policy(policy, num_experts)
        self.slot_of = np.full(num_experts, -1, dtype=np.int64)
        self.expert_of = np.zeros(0, dtype=np.int64)
        self.identity = False
        # bumped by every change of the maps: a device copy of ``slot_of`` made at one version is
        # the residency of that version only (``LayerBank.device_map``)
        self.version = 0

    @property
    def slots(self) -> int:
        return len(self.expert_of)

    def reset(self, slots: int) -> None:
        """Empty, with ``slots`` slots; ``slots == num_experts`` maps expert e to slot e."""
        self.policy = make_policy(self.policy_name, self.num_experts)
        self.slot_of[:] = -1
        self.expert_of = np.full(slots, -1, dtype=np.int64)
        self.identity = slots == self.num_experts
        self.version += 1

    def admit(
        self, experts: np.ndarray, keep: Sequence[int] = ()
    ) -> Tuple[np.ndarray, np.ndarray, int]:
        """One call uses ``experts`` (unique ids): ``(missing experts, their slots, evicted)``.

        The victims' slots are freed here (no slot names an evicted expert, even if the read that
        follows fails); ``place`` maps each missing expert once its bytes are in its slot."""
        experts = np.asarray(experts, dtype=np.int64)
        if len(experts) > len(self.expert_of):
            raise ValueError(
                f"{len(experts)} experts asked for at once but only {self.slots} slots"
            )
        missing = experts[self.slot_of[experts] < 0]
        self.policy.calling(experts)
        if len(missing) == 0 or self.identity:
            self.policy.used(experts)
            return missing, missing.copy(), 0
        pinned = np.zeros(self.num_experts, dtype=bool)
        pinned[experts] = True
        if len(keep):
            pinned[np.asarray(keep, dtype=np.int64)] = True
        slots, evicted = self._take(len(missing), pinned)
        self.policy.used(experts)
        return missing, slots, evicted

    def prefetch(
        self, experts: np.ndarray, keep: Sequence[int] = ()
    ) -> Tuple[np.ndarray, np.ndarray, int]:
        """Read ahead on a guess: like ``admit`` for the non-resident ``experts`` (at most
        ``slots``, in the order given), but not a use; they enter on probation
        (``EvictionPolicy.prefetched``). Only ``keep`` is pinned (experts whose bytes are still
        being read): the layer's next call has not started."""
        experts = np.asarray(experts, dtype=np.int64)
        pinned = np.zeros(self.num_experts, dtype=bool)
        if len(keep):
            pinned[np.asarray(keep, dtype=np.int64)] = True
        free = int((self.expert_of < 0).sum())
        room = free + int((~pinned[self.expert_of[self.expert_of >= 0]]).sum())
        missing = experts[self.slot_of[experts] < 0][: min(self.slots, room)]
        if len(missing) == 0 or self.identity:
            return missing, missing.copy(), 0
        slots, evicted = self._take(len(missing), pinned)
        self.policy.prefetched(missing)
        return missing, slots, evicted

    def _take(self, count: int, pinned: np.ndarray) -> Tuple[np.ndarray, int]:
        """``count`` slots: free ones first, then the policy's victims among the unpinned."""
        free = np.nonzero(self.expert_of < 0)[0]
        slots = free[:count]
        if len(slots) == count:
            return slots, 0
        resident = self.expert_of[self.expert_of >= 0]
        candidates = resident[~pinned[resident]]
        need = count - len(slots)
        if len(candidates) < need:
            raise ValueError(
                f"{count} experts to read but fewer slots are free of pinned and kept experts"
            )
        chosen = np.asarray(self.policy.evict(candidates, need), dtype=np.int64)
        valid = len(np.unique(chosen)) == need and np.isin(chosen, candidates).all()
        if not valid:
            raise RuntimeError(f"policy {self.policy_name!r} chose invalid victims {chosen}")
        taken = self.slot_of[chosen]
        self.slot_of[chosen] = -1
        self.expert_of[taken] = -1
        self.version += 1
        return np.concatenate([slots, taken]), need

    def place(self, experts, slots) -> None:
        """``experts`` are now resident in ``slots`` (as ``admit`` gave them)."""
        self.slot_of[experts] = slots
        self.expert_of[slots] = experts
        self.version += 1
