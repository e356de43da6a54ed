"""Replay a routing trace through the cache's slot tables: hit rates without reading a byte.

Rule (as for the reference figures in the traces' README): one ``policy.SlotTable`` per MoE layer,
the whole trace in order, cold start, every token one call of each layer that ran for it (prefill
rows warm the cache). Hit rate = hits / lookups over the rows of a phase. ``belady`` is the offline
optimum for the same rule (it knows the future: a yardstick, not a policy).
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from ..files.routing_trace import RoutingTrace
from ..runtime.policy import DEFAULT_POLICY, SlotTable


@dataclass
class ReplayResult:
    """Hits and lookups per phase; ``misses_per_decode_token[i]``: misses of the i-th decode token,
    per MoE layer."""

    hits: Dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    lookups: Dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    decode_tokens: int = 0
    decode_misses: List[int] = field(default_factory=list)  # per MoE layer, over decode tokens

    def hit_rate(self, phase: str) -> float:
        n = self.lookups[phase]
        return self.hits[phase] / n if n else float("nan")

    def count(self, phase: str, layer: int, hits: int, lookups: int) -> None:
        self.hits[phase] += hits
        self.lookups[phase] += lookups
        if phase == "decode":
            self.decode_misses[layer] += lookups - hits


def _slots(trace: RoutingTrace, slots: Union[int, Sequence[int]]) -> List[int]:
    plan = [slots] * trace.num_layers if isinstance(slots, int) else list(slots)
    if len(plan) != trace.num_layers:
        raise ValueError(f"{len(plan)} slot counts for {trace.num_layers} MoE layers")
    return plan


def replay(
    trace: RoutingTrace,
    slots: Union[int, Sequence[int]],
    policy: str = DEFAULT_POLICY,
    misses: Optional[Callable[[int, np.ndarray, str], None]] = None,
) -> ReplayResult:
    """``slots``: per MoE layer (or one count for all). A token that uses more experts in a layer
    than it has slots goes in waves of ``slots`` experts, lowest ids first, as the layer does it.
    ``misses(layer, experts, phase)``: told each call's missing experts, in the order they are
    read (``bench/page_cache_split.py`` (retired, in git at bc42dd5) ran them through a page cache)."""
    plan = _slots(trace, slots)
    tables = []
    for n in plan:
        table = SlotTable(trace.num_experts, policy)
        table.reset(n)
        tables.append(table)
    result = ReplayResult(decode_misses=[0] * trace.num_layers)
    for row in trace.rows:
        result.decode_tokens += row.phase == "decode"
        for layer, ids in enumerate(row.experts):
            if not ids:
                continue
            table = tables[layer]
            experts = np.array(ids, dtype=np.int64)
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
    return result


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


def host_cache_served(
    trace: RoutingTrace, slots: int, host_slots: int, exclusive: bool = True,
    policy: str = DEFAULT_POLICY, host_policy: str = "decay",
) -> float:
    """The share of the device slots' decode misses that a host cache of ``host_slots`` slots per
    MoE layer would serve (``runtime/memory/host_cache.py``), each layer's decode rows in order, cold.
    ``exclusive`` (the host cache's policy): the device's victims enter the host bank, the ones it
    serves leave it, in the order of its copies (the victims kept, the served experts pinned, then
    those dropped); else every expert read from disk enters it and the served ones stay."""
    missed = served = 0
    for layer in range(trace.num_layers):
        dev, host = SlotTable(trace.num_experts, policy), SlotTable(trace.num_experts, host_policy)
        dev.reset(slots)
        host.reset(host_slots)
        for row in trace.rows:
            if row.phase != "decode" or not row.experts[layer]:
                continue
            before = dev.expert_of.copy()
            missing, into, _ = dev.admit(np.array(row.experts[layer], dtype=np.int64))
            held = [e for e in missing.tolist() if host.slot_of[e] >= 0]
            missed, served = missed + len(missing), served + len(held)
            if exclusive:
                admit = [int(before[s]) for s in into if before[s] >= 0]
                admit = [e for e in admit if host.slot_of[e] < 0]
                resident = host.expert_of[host.expert_of >= 0]
                room = int((host.expert_of < 0).sum()) + int((~np.isin(resident, held)).sum())
                admit, keep = admit[:room], held
            else:
                admit, keep = [e for e in missing.tolist() if host.slot_of[e] < 0], ()
            if admit and host_slots:
                new, at, _ = host.admit(np.array(admit[:host_slots]), keep=keep)
                host.place(new, at)
            if held:
                host.policy.use(np.array(held))
                if exclusive:
                    host.drop(np.array(held))
            dev.place(missing, into)
    return served / missed if missed else float("nan")
