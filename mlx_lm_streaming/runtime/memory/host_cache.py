"""A host cache between the device's slot banks and the disk, on mlx-cuda (issue 39, item 4).

Where host memory cannot hold every expert that the device budget (``--expert-cache-gb``) cannot
(``host_split.split`` gives no two tiers) but ``--expert-host-gb`` is given below that rest, each MoE
layer's slot bank gets a second bank of slots in host memory (``HostBank``). A miss in the device
slots that the host bank holds is served by an MLX copy from the host slot into the device slot:
the GPU reads the host pages over the bus, and the bytes are those once read from the checkpoint,
so the result is stock's. Only misses in both go to disk.

What is allocated where: the device slot banks are today's (``--expert-cache-gb``). The host banks
are MLX arrays made by the CPU (``mx.zeros`` on the CPU stream: on mlx-cuda, managed memory whose
pages start in host memory), placed there by the placer (``cuda_placer.CudaPlacer``: preferred
location the host, accessed by the device) and placed again should an update move one to new
memory; ``--expert-host-gb`` in all, shared over the layers as the slot plan shares a budget.

The policy is exclusive (a victim cache): an expert the device slots evict is copied into the host
bank before its slot is written (device pages to host pages, on the device's stream), displacing
the host bank's lowest ``decay`` score where it is full; an expert the host bank serves leaves it
(it is on the device now). The tiers hold different experts, about as many as both have slots.
A served expert's host slot is free only once it was copied out, after the load's victims were
kept (they are copied before any slot is written): those displace other host experts, and the
freed slots take the next load's victims. Replaying the routing traces
(``replay.host_cache_served``, tests/data/routing; per layer the device slots with the default
policy at 25% of the experts, the host bank at 50%, decode rows, this order of copies), the host
bank served 0.53 (Qwen3-30B-A3B), 0.56 (gemma-4)
and 0.92 (the trained qwen3moe 16x64, a longer trace) of the device's misses; admitting every
expert read from disk and keeping those served (inclusive) served 0.51, 0.54 and 0.86, and with
the host at 25% 0.34-0.53 against 0.50-0.68. Freeing a served slot before the victims are kept
(a swap through a spare slot: not built) would serve 0.95 and, at 25%, 0.75 on the long trace.
``decay`` ranked host victims as well as ``lru`` or a little better (0.68 against 0.66 at 25% /
25% on the long trace); ``decay_next`` learns which call follows which, which says nothing of
the host bank's admissions.

Off by default: on only where the option is given below the rest (``tiers.set_up``). Run once on
an H100 (the page cache warm, the Qwen3 trace, the device at 25%, the host cache at half: 33.8
against 29.8 tok/s without, the waits on reads 1.3 against 15.2 ms a token but its copies 12.8 ms;
docs/benchmarks/tiers.md, "The eleventh session"); a cold disk, where it saves reads, is
unmeasured. Its copies are
MLX updates, made on the thread that calls the layer: with a host cache, several banks' loads are
not run at once (``bank.load_together``).
"""

import time
from typing import Dict, List

import mlx.core as mx
import numpy as np

from ..policy import SlotTable
from ..reads.host_views import host_address
from ..reads.safetensors_header import mx_dtype

HOST_POLICY = "decay"  # (the module docstring)


def host_slots(banks, host_bytes: int) -> List[int]:
    """Host slots per bank: ``host_bytes`` shared as the slot plan shares a budget (the same count
    each, then one more to layers in model order while what is left lasts), at most the experts
    that the bank's device slots leave out."""
    room = [b.num_experts - b.slots for b in banks]
    per = sum(b.layer.expert_nbytes for b, r in zip(banks, room) if r > 0)
    each = host_bytes // per if per else 0
    plan = [max(0, min(each, r)) for r in room]
    left = host_bytes - sum(n * b.layer.expert_nbytes for n, b in zip(plan, banks))
    for i, b in enumerate(banks):
        if plan[i] < room[i] and left >= b.layer.expert_nbytes:
            plan[i] += 1
            left -= b.layer.expert_nbytes
    return plan


class HostBank:
    """One layer's host slots: per part of an expert a ``(slots, *shape)`` array in host memory,
    which expert is in which slot (``table``), and the addresses last placed."""

    def __init__(self, bank, slots: int):
        self.bank = bank
        self.table = SlotTable(bank.num_experts, HOST_POLICY)
        self.table.reset(slots)
        parts = bank.layer.parts
        self.arrays = [
            mx.zeros((slots, *p.shape), dtype=mx_dtype(p.dtype), stream=mx.cpu) for p in parts
        ]
        mx.eval(self.arrays)
        self.addresses: List = [None] * len(parts)


class HostCache:
    """The host banks of one model's slot banks (module docstring). ``placer``:
    ``cuda_placer.CudaPlacer`` or any object with ``place(ranges, on_device)``."""

    def __init__(self, placer, host_bytes: int):
        self.placer = placer
        self.host_bytes = host_bytes
        self.banks: Dict[int, HostBank] = {}
        self.hits = 0  # device misses served by a host bank
        self.served_bytes = 0
        self.kept = 0  # experts evicted by the device slots and copied into a host bank
        self.placements = 0  # host arrays placed on the host (more than one each: moved by MLX)
        self.error = None  # the first placement the runtime refused, if any

    def plan(self, banks) -> None:
        """A host bank for each slot bank that leaves experts out (``host_slots``), placed."""
        self.banks = {}
        for bank, n in zip(banks, host_slots(banks, self.host_bytes)):
            if n > 0:
                host = self.banks[id(bank)] = HostBank(bank, n)
                self.place(host)

    def place(self, host: HostBank) -> None:
        """Each host array whose memory is new placed on the host: where MLX could not update
        one in place, the new buffer was allocated by the device's stream. On the model's thread
        (``tiers.Tiers.ranges``: an array's address evaluates it)."""
        for i, arr in enumerate(host.arrays):
            address = host_address(arr)
            if address is None or address == host.addresses[i]:
                continue
            host.addresses[i] = address
            self.placements += 1
            try:
                self.placer.place([(address, arr.nbytes)], on_device=False)
            except OSError as e:  # where bytes live, not what they are: said, not fatal
                self.error = self.error or str(e)

    def held(self, bank):
        """The host bank's ``slot_of`` (an expert's host slot, -1 if it has none), or None."""
        host = self.banks.get(id(bank))
        return None if host is None else host.table.slot_of

    def take(self, bank, pairs: list, evicted: int):
        """A load of ``bank`` before it writes any slot: its ``(expert, slot)`` ``pairs``
        split into those to read and those the host bank holds, after the experts the load
        evicted from the device slots (``evicted`` of them: ``SlotTable.evicted``) were copied
        into the host bank (``keep``). Returns ``(pairs to read, pairs held)``."""
        host = self.banks.get(id(bank))
        if host is None:
            return pairs, []
        slot_of = host.table.slot_of
        held = [p for p in pairs if slot_of[p[0]] >= 0]
        rest = [p for p in pairs if slot_of[p[0]] < 0] if held else pairs
        if evicted:
            self.keep(bank, host, *bank.table.evicted, [e for e, _ in held])
        return rest, held

    def keep(self, bank, host: HostBank, experts, slots, pinned) -> None:
        """Copy the device slots' ``slots`` (of the evicted ``experts``) into host slots, for
        those the host bank lacks and has room for besides the ``pinned`` experts (about to be
        served), displacing its policy's victims."""
        start = time.perf_counter()
        table = host.table
        lacking = table.slot_of[experts] < 0
        experts, slots = experts[lacking], slots[lacking]
        resident = table.expert_of[table.expert_of >= 0]
        room = int((table.expert_of < 0).sum()) + int((~np.isin(resident, pinned)).sum())
        experts, slots = experts[:room], slots[:room]
        if not len(experts):
            return
        _, into, _ = table.admit(experts, keep=pinned)
        for arr, spec in zip(host.arrays, bank.layer.parts):
            source = bank.array(spec.proj, spec.part)
            for h, s in zip(into.tolist(), slots.tolist()):
                arr[h : h + 1] = source[s : s + 1]
        mx.eval(host.arrays)  # now, in this thread (``LayerBank.allocate``)
        table.place(experts, into)
        self.kept += len(experts)
        self.place(host)
        self._spent(bank, start, "host keep", len(experts))

    def serve(self, bank, held: list) -> list:
        """The ``(expert, slot)`` pairs ``held`` copied from the host bank into their device
        slots and mapped there; they leave the host bank. Returns their ids."""
        start = time.perf_counter()
        host = self.banks[id(bank)]
        ids = np.array([e for e, _ in held], dtype=np.int64)
        slots = [s for _, s in held]
        froms = host.table.slot_of[ids].tolist()
        parts = bank.layer.parts
        for arr, spec in zip(host.arrays, parts):
            target = bank.array(spec.proj, spec.part)
            for h, s in zip(froms, slots):
                target[s : s + 1] = arr[h : h + 1]  # in place: the SwitchGLU's own array
        mx.eval([bank.array(spec.proj, spec.part) for spec in parts])
        if bank.views is not None:
            bank.refresh_views()
        bank.table.place(ids, slots)
        host.table.policy.use(ids)
        host.table.drop(ids)
        self.hits += len(ids)
        self.served_bytes += len(ids) * bank.layer.expert_nbytes
        self._spent(bank, start, "host serve", len(ids))
        return ids.tolist()

    def _spent(self, bank, start: float, name: str, experts: int) -> None:
        """A copy's seconds: installing, in the stats' split and on the timeline."""
        cache = bank.cache
        cache.stats.add_time(0.0, time.perf_counter() - start)
        cache.timeline.span(name, start, "install", layer=bank.path, experts=experts)

    def summary(self) -> dict:
        size = sum(h.table.slots * h.bank.layer.expert_nbytes for h in self.banks.values())
        return {
            "host_cache_gb": size / 1e9,
            "host_cache_hits": self.hits,
            "host_cache_served_gb": self.served_bytes / 1e9,
            "host_cache_kept": self.kept,
            "host_cache_error": self.error,
        }


def set_up(cache, host_bytes: int, placer) -> None:
    """Give ``cache`` a host cache of ``host_bytes`` (``tiers.set_up``: on mlx-cuda, given below
    the rest)."""
    cache.host_cache = HostCache(placer, host_bytes)
    cache.planned = False
