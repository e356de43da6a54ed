"""The schedules with no host sync: the router's ids go to the kernel on the device."""

import mlx.core as mx

from .base import Schedule


class StockGraph(Schedule):
    """Chosen for a complete identity bank (every expert in its own slot) with a kernel that takes
    the ids on the device: expert ids are slot ids, so the router's indices go straight to the
    kernel, with no host sync: stock's graph, and mlx-lm's ``async_eval`` pipelining kept.
    Measured faster than the same call with the host sync on the GPU (``warm_sync``); on the CPU
    within noise."""

    def run(self):
        tiers = self.bank.cache.tiers
        if tiers is not None:  # two tiers: the ids kept for the device tier's count (``tiers``)
            tiers.note(self.bank, self.indices)
        return self.kernel(self.x, self.indices, None, self.bank)


class Verified(Schedule):
    """Chosen inside a verified step (``verified_step.py``: decode-sized calls while recent tokens
    missed in few layers), for a bank with slots and a kernel that takes the ids on the device: the
    router's ids mapped to slot ids on the device, with no host sync, and the bank's device map of
    missing experts handed to the step, which counts every layer's misses at once after the
    forward.
    Measured: the per-layer host sync costs more than the layer on a GPU."""

    def run(self):
        bank = self.bank
        tl = bank.cache.timeline
        start = tl.now()
        indices = mx.stop_gradient(self.indices)
        with bank.lock:
            if bank.identity and bank.staged:
                # the fill's reads that landed: into slots no resident expert has, which no pending
                # work reads but for rows a miss makes wrong anyway (dropped at the check)
                bank.install_finished()
                bank.note_complete()
            made, table = bank.last_map, bank.table
            if made is not None and made[0] is table and made[1] == table.version:
                slots, missing = made[2], made[3]  # (``device_map``'s check, inline)
            else:
                slots, missing = bank.device_map()
            y = self.kernel(self.x, slots[indices], None, bank)
        self.step.add(bank, indices, missing)
        bank.last_stream = mx.default_stream(mx.default_device())
        # its ids are not on the host: its experts and misses are the step's to count
        tl.layer(start, bank.path, indices.size // indices.shape[-1], verified=True)
        return y
