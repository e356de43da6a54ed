"""Replay a routing trace through the cache's slot tables: hit rates without reading a byte.

Rule (as for the reference figures in the traces' README): one ``policy.SlotTable`` per MoE layer,
the whole trace in order, cold start, every token one call of each layer that ran for it (prefill
rows warm the cache). Hit rate = hits / lookups over the rows of a phase. ``belady`` is the offline
optimum for the same rule (it knows the future: a yardstick, not a policy).

With ``lookahead`` (a ``Lookahead``), each token's call of layer L is followed by a guess of layer
L + 1's experts (``cooccurrence.CoactivationPredictor``, learnt online from the tokens before); the
guessed experts not resident are read ahead into layer L + 1's table (``SlotTable.prefetch``:
victims by the policy, on probation until used) before L + 1's call is looked up. As the live
lookahead does, a layer's guesses are scored from the start and read only while their running
precision is at least ``min_precision``. ``ReplayResult.prefetched`` counts the reads ahead of the
decode tokens; ``reads_per_decode_token`` adds them to the misses.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from .cooccurrence import CoactivationPredictor
from .policy import DEFAULT_POLICY, SlotTable
from .routing_trace import RoutingTrace


@dataclass
class ReplayResult:
    """Hits and lookups per phase; ``misses_per_decode_token[i]``: misses of the i-th decode token,
    per MoE layer."""

    hits: Dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    lookups: Dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    decode_tokens: int = 0
    decode_misses: List[int] = field(default_factory=list)  # per MoE layer, over decode tokens
    prefetched: int = 0  # experts read ahead for decode tokens (lookahead)
    prefetch_used: int = 0  # of those, used by the call they were read for

    @property
    def precision(self) -> float:
        return self.prefetch_used / self.prefetched if self.prefetched else float("nan")

    @property
    def reads_per_decode_token(self) -> float:
        """Experts read per decode token, all layers: misses plus reads ahead."""
        reads = self.lookups["decode"] - self.hits["decode"] + self.prefetched
        return reads / self.decode_tokens if self.decode_tokens else float("nan")

    def hit_rate(self, phase: str) -> float:
        n = self.lookups[phase]
        return self.hits[phase] / n if n else float("nan")

    def count(self, phase: str, layer: int, hits: int, lookups: int) -> None:
        self.hits[phase] += hits
        self.lookups[phase] += lookups
        if phase == "decode":
            self.decode_misses[layer] += lookups - hits


@dataclass
class Lookahead:
    """Read ahead the ``limit`` best guesses of the next layer scoring at least ``min_score``,
    while the layer's running precision (an average over calls, rate 0.2) is at least
    ``min_precision``."""

    # chosen on the real traces at 16 and 32 slots (docs/routing.md): the most hits that read no
    # more per decode token than LRU without lookahead; the gate stops reads ahead where layers
    # are not correlated (the synthetic trace: precision 0.02 without it)
    limit: int = 2
    min_score: float = 0.275
    min_precision: float = 0.2


def _slots(trace: RoutingTrace, slots: Union[int, Sequence[int]]) -> List[int]:
    plan = [slots] * trace.num_layers if isinstance(slots, int) else list(slots)
    if len(plan) != trace.num_layers:
        raise ValueError(f"{len(plan)} slot counts for {trace.num_layers} MoE layers")
    return plan


def replay(
    trace: RoutingTrace,
    slots: Union[int, Sequence[int]],
    policy: str = DEFAULT_POLICY,
    lookahead: Optional[Lookahead] = None,
    misses: Optional[Callable[[int, np.ndarray, str], None]] = None,
) -> ReplayResult:
    """``slots``: per MoE layer (or one count for all). A token that uses more experts in a layer
    than it has slots goes in waves of ``slots`` experts, lowest ids first, as the layer does it.
    ``misses(layer, experts, phase)``: told each call's missing experts, in the order they are
    read (``bench/page_cache_split.py`` runs them through a page cache)."""
    plan = _slots(trace, slots)
    tables = []
    for n in plan:
        table = SlotTable(trace.num_experts, policy)
        table.reset(n)
        tables.append(table)
    result = ReplayResult(decode_misses=[0] * trace.num_layers)
    ahead = _Ahead(trace, tables, lookahead, result) if lookahead else None
    for row in trace.rows:
        result.decode_tokens += row.phase == "decode"
        for layer, ids in enumerate(row.experts):
            if not ids:
                continue
            table = tables[layer]
            experts = np.array(ids, dtype=np.int64)
            if ahead:
                ahead.arrive(layer, experts, row.phase)
            waves = [experts]
            if len(experts) > table.slots:
                experts = np.sort(experts)
                waves = [experts[i : i + table.slots] for i in range(0, len(experts), table.slots)]
            for wave in waves:
                missing, into, _ = table.admit(wave)
                table.place(missing, into)
                result.count(row.phase, layer, len(wave) - len(missing), len(wave))
                if misses is not None:
                    misses(layer, missing, row.phase)
            if ahead:
                ahead.leave(layer, experts)
    return result


class _Ahead:
    """The replay's lookahead: guesses, their scores, and the reads ahead (module docstring)."""

    def __init__(self, trace, tables, config: Lookahead, result: ReplayResult):
        self.tables, self.config, self.result = tables, config, result
        self.predictor = CoactivationPredictor(trace.num_layers, trace.num_experts)
        self.precision = [0.0] * trace.num_layers
        self.guess: List[Optional[np.ndarray]] = [None] * trace.num_layers  # not resident
        self.read: List[Optional[np.ndarray]] = [None] * trace.num_layers  # read ahead

    def arrive(self, layer: int, experts: np.ndarray, phase: str) -> None:
        """Score the guess for this call and count the reads ahead it used."""
        guess, read = self.guess[layer], self.read[layer]
        self.guess[layer] = self.read[layer] = None
        if guess is not None and len(guess):
            hit = np.isin(guess, experts).mean()
            self.precision[layer] += 0.2 * (hit - self.precision[layer])
        if read is not None and phase == "decode":
            self.result.prefetched += len(read)
            self.result.prefetch_used += int(np.isin(read, experts).sum())

    def leave(self, layer: int, experts: np.ndarray) -> None:
        """Learn from this call, then guess the next layer's and read ahead if it has earned it."""
        self.predictor.observe(layer, experts)
        nxt = layer + 1
        if nxt >= len(self.tables):
            return
        table = self.tables[nxt]
        limit = min(self.config.limit, table.slots)
        resident = table.slot_of >= 0
        guess = self.predictor.predict(layer, experts, limit, self.config.min_score, resident)
        self.guess[nxt] = guess
        if len(guess) and self.precision[nxt] >= self.config.min_precision:
            missing, into, _ = table.prefetch(guess)
            table.place(missing, into)
            self.read[nxt] = missing


def belady(trace: RoutingTrace, slots: Union[int, Sequence[int]]) -> ReplayResult:
    """Offline optimum: on a miss, evict the unpinned resident expert used again furthest ahead."""
    plan = _slots(trace, slots)
    result = ReplayResult(decode_misses=[0] * trace.num_layers)
    result.decode_tokens = sum(row.phase == "decode" for row in trace.rows)
    rows = trace.rows
    for layer, n in enumerate(plan):
        # uses[e]: the row indices where this layer uses expert e, consumed as the replay passes
        uses: Dict[int, List[int]] = {}
        for i in reversed(range(len(rows))):
            for e in rows[i].experts[layer]:
                uses.setdefault(e, []).append(i)
        resident = set()
        for i, row in enumerate(rows):
            ids = row.experts[layer]
            for e in ids:
                uses[e].pop()
            missing = [e for e in ids if e not in resident]
            result.count(row.phase, layer, len(ids) - len(missing), len(ids))
            for e in missing:
                if len(resident) >= n:
                    victim = max(
                        (k for k in resident if k not in ids),
                        key=lambda k: uses[k][-1] if uses[k] else len(rows),
                    )
                    resident.remove(victim)
                resident.add(e)
    return result
