"""Which expert a layer's slot bank gives up when it must read another: the eviction policy.

A ``SlotTable`` is one MoE layer's residency: ``slot_of[expert]`` (-1: not resident) and
``expert_of[slot]`` (-1: free). ``admit(experts, keep)`` is the whole decision for one call of the
layer: it tells the policy which experts the call uses, then picks a slot for each missing expert,
free slots first, then the policy's victims among the resident experts that neither the call nor
``keep`` uses (those are pinned: the call computes from them, so their slots are never taken). The
layer's bank (``bank.LayerBank.reads``) reads the missing experts into those slots; a replay of a
routing trace (``tools/replay.py``) drives the same code with no bytes read.

The policies are one class, ``EvictionPolicy``, named at construction: its ``use`` is the whole
record of one call (what followed the last call, the victims where the call must evict, the use),
inline, so that a layer call that hits costs two Python calls here (``admit``, ``use``) and one that
evicts five (``_evict``, ``victims``, ``rank``). They keep per-expert state across evictions (an expert read
again keeps its history):

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

A verified step records every MoE layer's use of one token at once, after its check
(``PolicyRows.use``): the layers' policies joined into one set of 2-D arrays, a row per layer, and
each array updated by one numpy op for all of them, with each element's arithmetic the same as the
layer's own ``use`` (the same scores, bit for bit, so the same victims).

Pure Python and numpy: no threads, no MLX.
"""

from typing import Optional, Sequence, Tuple

import numpy as np

from ..errors import ConfigurationError

# calls of a layer after which a use counts half (``decay``); 8-32 all beat LRU on the traces
HALF_LIFE = 16.0
# how much the chance of a use in the next call weighs against ``decay``'s score (``decay_next``);
# 1-8 all beat ``decay`` on the traces, 4 at 32 slots the most
NEXT_WEIGHT = 4.0
POLICIES = ("decay", "decay_next", "lru")
DEFAULT_POLICY = "decay_next"


class EvictionPolicy:
    """One layer's policy state, keyed by expert id, for the policy ``name`` (``POLICIES``). One
    method per event, each doing its work inline (it runs for every call of every layer): ``use``
    (a call's experts, in the router's rank order, and its victims if it must evict), ``prefetched``
    (experts read ahead on a guess), ``victims`` (which resident experts to evict: those on
    probation first, then ``rank``'s order)."""

    def __init__(
        self,
        num_experts: int,
        name: str = DEFAULT_POLICY,
        half_life: float = HALF_LIFE,
        weight: float = NEXT_WEIGHT,
    ):
        if name not in POLICIES:
            raise ConfigurationError(
                f"unknown cache policy {name!r}; known: {', '.join(sorted(POLICIES))}"
            )
        self.name = name
        self.num_experts = num_experts
        self.clock = 0  # calls of the layer
        self.order = 0  # uses, one per expert per call, in rank order
        self.last = np.full(num_experts, -1, dtype=np.int64)  # ``order`` of the last use
        # read ahead on a guess and not used since: on probation, evicted before any other
        self.probation = np.zeros(num_experts, dtype=bool)
        # ``decay``, ``decay_next``: score as of call ``stamp``, aged lazily (only touched experts
        # are updated); None for ``lru``
        self.factor = 0.5 ** (1.0 / half_life)
        self.score = self.stamp = None
        if name != "lru":
            self.score = np.zeros(num_experts, dtype=np.float64)
            self.stamp = np.zeros(num_experts, dtype=np.int64)
        # ``decay_next``: follows[a, b]: calls that used a followed by a call that used b; after[a]:
        # calls that used a followed by any call; None for the others
        self.weight = weight
        self.follows = self.after = None
        if name == "decay_next":
            self.follows = np.zeros((num_experts, num_experts), dtype=np.float32)
            self.after = np.zeros(num_experts, dtype=np.float32)
        self.previous = None  # the last call's experts (``decay_next``)
        self.current = None  # the experts of the call choosing victims (``decay_next``)
        # joined with other layers' policies (``PolicyRows``): the arrays above are its rows there
        self.rows: Optional["PolicyRows"] = None
        self.row = 0

    def use(
        self, experts: np.ndarray, candidates: Optional[np.ndarray] = None, count: int = 0
    ) -> Optional[np.ndarray]:
        """One call of the layer uses ``experts`` (unique ids, rank order where known); where it
        must evict, ``victims(candidates, count)`` is chosen first and returned (else None).

        In order: what followed the last call is learnt (``decay_next``, before the victims are
        chosen), the victims, then the use: recency, probation ended, the score."""
        follows = self.follows
        if follows is not None:
            previous = self.previous
            if previous is not None and len(previous):
                self.after[previous] += 1.0
                # ``follows[previous[:, None], experts] += 1`` through the flat view: the same
                # elements (each pair once: both are unique ids), faster than numpy's 2-D fancy
                # indexing
                pairs = (previous[:, None] * self.num_experts + experts).reshape(-1)
                follows.reshape(-1)[pairs] += 1.0
            self.current = experts
        chosen = self.victims(candidates, count) if count else None
        self.clock += 1
        n = len(experts)
        self.last[experts] = np.arange(self.order, self.order + n)
        self.order += n
        self.probation[experts] = False
        score = self.score
        if score is not None:  # ``scores(experts) + 1``, spelt out
            stamp = self.stamp
            score[experts] = score[experts] * self.factor ** (self.clock - stamp[experts]) + 1.0
            stamp[experts] = self.clock
        if follows is not None:
            self.current = None
            self.previous = np.asarray(experts, dtype=np.int64)
        return chosen

    def prefetched(self, experts: np.ndarray) -> None:
        """``experts`` were read ahead on a guess: not a use (no score, no recency), but on
        probation until a call uses them, so a wrong guess is the first to go."""
        self.probation[experts] = True

    def victims(self, candidates: np.ndarray, count: int) -> np.ndarray:
        """``count`` of the resident, unpinned expert ids ``candidates``, to evict: those on
        probation first (in ``candidates``' order, ranked if more than ``count``), then the rest
        in ``rank``'s order."""
        on = self.probation[candidates]
        first, rest = candidates[on], candidates[~on]
        if len(first) >= count:
            return self.rank(first, count)
        if len(first) == 0:
            return self.rank(rest, count)
        return np.concatenate([first, self.rank(rest, count - len(first))])

    def rank(self, candidates: np.ndarray, count: int) -> np.ndarray:
        """The ``count`` of ``candidates`` the policy gives up first. ``lru``: least recently used.
        ``decay``: lowest score, the least recently used among equals. ``decay_next``: the same,
        with ``weight`` times the chance of a use in the next call (the sum over the current call's
        experts ``a`` of P(next call uses it | a call used ``a``), smoothed: ``follows / (after +
        1)``) added to the score."""
        last = self.last[candidates]
        if self.score is None:
            order = np.argsort(last, kind="stable")
            return candidates[order[:count]]
        score = self.score[candidates] * self.factor ** (self.clock - self.stamp[candidates])
        cur = self.current
        if self.follows is not None and cur is not None and len(cur):
            rows = self.follows[cur[:, None], candidates] / (self.after[cur] + 1.0)[:, None]
            score = score + self.weight * rows.sum(axis=0)
        order = np.lexsort((last, score))
        return candidates[order[:count]]

    def scores(self, experts: np.ndarray) -> np.ndarray:
        """``decay``'s scores of ``experts`` as of now."""
        return self.score[experts] * self.factor ** (self.clock - self.stamp[experts])


class PolicyRows:
    """Several layers' policies (one name, experts and half-life each) joined: each array of
    their state one 2-D array (3-D: ``follows``), a row per layer, and each policy's arrays views
    of its row, so that its own methods work on as before. ``use`` records one call of each of
    several of them at once; their scalars (``clock``, ``order``, ``previous``) stay theirs.
    """

    def __init__(self, policies: Sequence[EvictionPolicy]):
        first = policies[0]
        self.num_experts, self.factor = first.num_experts, first.factor
        for name in ("last", "probation", "score", "stamp", "follows", "after"):
            if getattr(first, name) is None:
                setattr(self, name, None)
                continue
            rows = np.stack([getattr(p, name) for p in policies])
            setattr(self, name, rows)
            for i, policy in enumerate(policies):
                setattr(policy, name, rows[i])
        for i, policy in enumerate(policies):
            policy.rows, policy.row = self, i
        # the arrays flat, indexed by ``row * num_experts + expert`` (``follows``: by that
        # times ``num_experts`` plus the expert that followed)
        for name in ("last", "probation", "score", "stamp", "follows", "after"):
            rows = getattr(self, name)
            setattr(self, f"flat_{name}", None if rows is None else rows.reshape(-1))

    @staticmethod
    def joinable(policies: Sequence[EvictionPolicy]) -> bool:
        """Whether ``policies`` can be joined: plain ``EvictionPolicy``s of one name, number of
        experts, half-life and weight."""
        first = policies[0]
        same = (first.name, first.num_experts, first.factor, first.weight)
        return all(
            type(p) is EvictionPolicy and (p.name, p.num_experts, p.factor, p.weight) == same
            for p in policies
        )

    def use(self, policies: Sequence[EvictionPolicy], experts: Sequence[np.ndarray]) -> None:
        """``policy.use(e)`` (no victims) for each of ``policies`` (rows of these, each once) and
        its ``experts`` (unique int64 ids, rank order where known), in one numpy op per array for
        all of them: element by element the same arithmetic, so the same state."""
        n, learn = self.num_experts, self.follows is not None
        offsets, clocks, orders, sizes, before = [], [], [], [], []
        start, width = 0, len(experts[0])  # (``width``: every call's and previous call's count)
        for policy, used in zip(policies, experts):  # (the scalars: one Python loop)
            size = len(used)
            offsets.append(policy.row * n)
            policy.clock += 1
            clocks.append(policy.clock)
            # ``last[e] = arange(order, order + size)``: the use's place in all, made per row
            orders.append(policy.order - start)
            policy.order += size
            start += size
            sizes.append(size)
            if learn:
                previous = policy.previous
                before.append(previous)
                if previous is None or len(previous) != width or size != width:
                    width = 0
                policy.current, policy.previous = None, used
        offset, clock, order = np.repeat(np.array((offsets, clocks, orders)), sizes, axis=1)
        ids = np.concatenate(experts)
        flat = ids + offset
        if learn and width:  # (a token's layers, top-k each, after one: numpy ops once)
            previous = np.concatenate(before) + offset
            self.flat_after[previous] += 1.0
            pairs = previous.reshape(-1, width, 1) * n + ids.reshape(-1, 1, width)
            self.flat_follows[pairs.reshape(-1)] += 1.0
        elif learn:
            self._learn(offsets, before, experts)
        self.flat_last[flat] = np.arange(start) + order
        self.flat_probation[flat] = False
        if self.score is not None:  # ``score[e] * factor ** (clock - stamp[e]) + 1`` per row
            score, stamp = self.flat_score, self.flat_stamp
            score[flat] = score[flat] * self.factor ** (clock - stamp[flat]) + 1.0
            stamp[flat] = clock

    def _learn(self, offsets: list, before: list, experts) -> None:
        """``decay_next``'s record of what followed each row's last call (``before``), row by
        row: ``after`` and ``follows`` counted (each pair once: unique ids), as ``use`` does.
        """
        n = self.num_experts
        pairs, after = [], []
        for offset, previous, used in zip(offsets, before, experts):
            if previous is not None and len(previous):
                after.append(previous + offset)
                pairs.append(((previous + offset)[:, None] * n + used).reshape(-1))
        if after:
            self.flat_after[np.concatenate(after)] += 1.0
            self.flat_follows[np.concatenate(pairs)] += 1.0


class SlotTable:
    """One layer's expert <-> slot maps and its policy (see the module docstring)."""

    def __init__(self, num_experts: int, policy: str = DEFAULT_POLICY):
        self.num_experts = num_experts
        self.policy_name = policy
        self.policy = EvictionPolicy(num_experts, policy)
        self.slot_of = np.full(num_experts, -1, dtype=np.int64)
        self.expert_of = np.zeros(0, dtype=np.int64)
        self.identity = False
        # bumped by every change of the maps: a device copy of ``slot_of`` made at one version is
        # the residency of that version only (``LayerBank.device_map``)
        self.version = 0
        self.evicted = (np.zeros(0, dtype=np.int64),) * 2  # (``_evict``)

    @property
    def slots(self) -> int:
        return len(self.expert_of)

    def reset(self, slots: int) -> None:
        """Empty, with ``slots`` slots; ``slots == num_experts`` maps expert e to slot e."""
        self.policy = EvictionPolicy(self.num_experts, self.policy_name)
        self.slot_of[:] = -1
        self.expert_of = np.full(slots, -1, dtype=np.int64)
        self.identity = slots == self.num_experts
        self.version += 1

    def resize(self, slots: int, experts: np.ndarray, at: np.ndarray) -> None:
        """``slots`` slots holding just ``experts``, in slots ``at`` (the bank made again at a new
        size: ``LayerBank.resize``); the policy keeps its history."""
        self.slot_of[:] = -1
        self.expert_of = np.full(slots, -1, dtype=np.int64)
        self.identity = slots == self.num_experts
        self.place(experts, at)

    def admit(
        self, experts: np.ndarray, keep: Sequence[int] = ()
    ) -> Tuple[np.ndarray, np.ndarray, int]:
        """One call uses ``experts`` (unique ids): ``(missing experts, their slots, evicted)``.

        Inline, as it runs for every call of every layer: the missing experts; free slots for
        them; where too few are free, the policy's victims among the unpinned residents, chosen
        within its record of the call's use (``EvictionPolicy.use``: one call to the policy). The
        victims' slots are freed here (no slot names an evicted expert, even if the read that
        follows fails); ``place`` maps each missing expert once its bytes are in its slot."""
        experts = np.asarray(experts, dtype=np.int64)
        expert_of = self.expert_of
        if len(experts) > len(expert_of):
            raise ValueError(
                f"{len(experts)} experts asked for at once but only {self.slots} slots"
            )
        missing = experts[self.slot_of[experts] < 0]
        if len(missing) == 0 or self.identity:
            self.policy.use(experts)
            return missing, missing.copy(), 0
        free = np.nonzero(expert_of < 0)[0][: len(missing)]
        need = len(missing) - len(free)
        if need == 0:
            self.policy.use(experts)
            return missing, free, 0
        pinned = np.zeros(self.num_experts, dtype=bool)
        pinned[experts] = True
        if len(keep):
            pinned[np.asarray(keep, dtype=np.int64)] = True
        taken = self._evict(pinned, len(missing), need, experts)
        return missing, np.concatenate([free, taken]), need

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
        slots = np.nonzero(self.expert_of < 0)[0][: len(missing)]
        need = len(missing) - len(slots)
        if need:
            slots = np.concatenate([slots, self._evict(pinned, len(missing), need)])
        self.policy.prefetched(missing)
        return missing, slots, need

    def _evict(self, pinned: np.ndarray, count: int, need: int, experts=None) -> np.ndarray:
        """The slots of ``need`` victims (for ``count`` missing experts) among the resident
        experts that are not ``pinned``, freed: chosen by the policy within its record of the
        call's use of ``experts`` (``EvictionPolicy.use``), or (None: a read ahead, not a use)
        alone (``EvictionPolicy.victims``)."""
        resident = self.expert_of[self.expert_of >= 0]
        candidates = resident[~pinned[resident]]
        if len(candidates) < need:
            raise ValueError(
                f"{count} experts to read but fewer slots are free of pinned and kept experts"
            )
        policy = self.policy
        if experts is None:
            chosen = policy.victims(candidates, need)
        else:
            chosen = policy.use(experts, candidates, need)
        chosen = np.asarray(chosen, dtype=np.int64)
        valid = len(np.unique(chosen)) == need and np.isin(chosen, candidates).all()
        if not valid:
            raise RuntimeError(f"policy {self.policy_name!r} chose invalid victims {chosen}")
        taken = self.slot_of[chosen]
        self.slot_of[chosen] = -1
        self.expert_of[taken] = -1
        self.version += 1
        # the last victims and their slots: a host cache keeps their bytes before the slots are
        # written (``host_cache``)
        self.evicted = (chosen, taken)
        return taken

    def place(self, experts, slots) -> None:
        """``experts`` are now resident in ``slots`` (as ``admit`` gave them)."""
        self.slot_of[experts] = slots
        self.expert_of[slots] = experts
        self.version += 1

    def drop(self, experts) -> None:
        """``experts`` (resident) are resident no more; their slots are free. The policy keeps
        their history."""
        self.expert_of[self.slot_of[experts]] = -1
        self.slot_of[experts] = -1
        self.version += 1
