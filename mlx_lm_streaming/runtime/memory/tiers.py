"""Two tiers on mlx-cuda: every routed expert in a complete identity bank, the hottest in device
memory, the rest in host memory that the GPU reads in place (issue 39).

Where the device budget (``--expert-cache-gb``) plus the host budget (``--expert-host-gb``) hold
every routed expert, each MoE layer's bank gets a slot per expert (an identity bank): once its
background fill is done it is complete, and the layer runs stock's graph (``StockGraph``: the
router's ids straight to the kernel, no host sync, no replay). The banks are MLX arrays, which
mlx-cuda allocates in managed memory: ``cudaMemAdvise`` on each expert's byte ranges says where its
pages live (preferred location the device for the device tier; the host, and accessed by the
device, for the host tier) and ``cudaMemPrefetchAsync`` moves them there on a stream of our own.
The GPU reads a host-tier expert over the bus inside the kernel; the bytes, the arrays and the
kernels are stock's, so results are bit-identical wherever the pages are.

The device tier follows the decode's routing (``Tiers``): every decode call's expert ids are kept;
every ``MOVE_EVERY`` tokens, at a step's first layer call (right after mlx-lm launched the step
before: the device is busy, not waiting), the ids mlx-lm has evaluated are read (no extra sync) and
counted with a decay, every bank's hottest experts chosen for the device (by a margin), and the
moves of all the banks issued as one batch, in the background. A prompt's calls run over a device
copy of their bank (``device_copy``) or over layer sets (``prefill.set_pass``) and move nothing
while it runs; their ids are counted (not as uses served) at the batch of the first token after it,
which places the device tier for the prompt's routing (a prompt of 4 rows per expert or more:
``device_copy.ROWS_PER_EXPERT``; a shorter one counts as a token's calls). The routing traces
replayed through ``Tiers`` (16 layers; tests/test_tiers.py; the rules' history in docs/design.md):
from a cold load, 165 decode tokens, the device served Qwen3 0.908 and 0.730 of decode's uses at
half and a quarter of the experts on the device (gemma-4 0.923 and 0.788), each layer's counted top
0.978 / 0.826 (0.989 / 0.869); once the counts are warm, at a quarter, 0.803 of 0.822 (0.855 of
0.865). A move changes where bytes live, never what they are; a closed model's banks are given
back without their advice (``Tiers.close``).

Everything except the CUDA calls (``cuda_placer.CudaPlacer``) runs anywhere: tests use a placer that
records what it was asked. The option is refused off CUDA (``options``: unified memory, where the
cache already is host memory).
"""

from operator import attrgetter
from typing import Dict, List, Optional

import numpy as np

from ..bank import device_copy
from ..bank.layer_set import expert_counts
from .host_split import FLAG, available_host_bytes, split
from .queue_worker import QueueWorker
from .tier_table import TierTable

# decode calls: every call's ids are kept (a reference: no host work); at the token before every
# MOVE_EVERY-th, every bank's kept ids are joined on the device (``gather``), and at the
# MOVE_EVERY-th, before its first call's ids are kept, that one array is read and counted, decayed
# by DECAY, and every bank's device tier re-chosen, the moves issued as one batch (a shift moves
# the device tier at the second batch: within 2 * MOVE_EVERY tokens);
# an expert takes a device slot from a colder one only where its count beats that one's by
# SWAP_RATIO and SWAP_MIN (no churn between near ties: 1,400-1,800 moves in 500 tokens without
# it), or from one never used since loading (count 0) by any count
MOVE_EVERY = 8
_SIZE = attrgetter("size")  # (an ids array's count: C, no frame)
# a long prompt's uses per expert counted at the first token after it, scaled so that its most
# used expert counts as one used by each of PROMPT_TOKENS decode tokens: decode's own counts take
# over within a few batches however long the prompt (the traces' replays: as good as unscaled
# for their prompts, and a prompt 8x as long no worse)
PROMPT_TOKENS = MOVE_EVERY
# counts kept a batch (the traces at a quarter: 0.766 / 0.827 of uses served at 0.5, 0.803 / 0.855
# at 0.9 against each layer's counted top 0.822 / 0.865; moves a token 7.0 / 5.3 -> 4.1 / 3.4)
DECAY = 0.9
SWAP_RATIO = 1.25
SWAP_MIN = 2.0
# a routing shift (a batch whose uses the device served at a share SHIFT_DROP below the running
# share, weight SHARE_WEIGHT; SHIFT_DROP_FAST while FAST_BATCHES run, so a shift not yet followed
# restarts them): the counts before that batch weigh SHIFT_KEEP, and FAST_BATCHES batches swap by
# SWAP_MIN_FAST and keep FAST_DECAY of their counts (the traces replayed one after the other: 90%
# of the new share in 32 tokens in all eight cases, not 40-64). A quarter of the experts on the
# device serves batches 0.13 below the running share by chance (Qwen3's trace): a SHIFT_DROP of
# 0.1 took those for shifts, 14 moves a token at 16 layers and 37 at 48 where 0.2 moves 1.2 and
# 3.1, serving 0.746 -> 0.801 and 0.794 -> 0.846 of uses (docs/benchmarks/tiers.md)
SHIFT_DROP = 0.2
SHIFT_DROP_FAST = 0.1
SHIFT_KEEP = 0.25
FAST_DECAY = 0.5
SHARE_WEIGHT = 0.3
FAST_BATCHES = 3
SWAP_MIN_FAST = 0.5
# a bank whose counts are as even as chance leaves them (``TierTable.skew`` below MIN_SKEW) moves
# nothing: uniform routing at a quarter of 256 experts made 9.7 moves a token (10.1 on an H100,
# the Qwen3.6 shape), none serving more; its skew stays under 1.5 once counted, the real traces'
# layers at 4.9 and over (``CacheTuning.tier_min_skew``)
MIN_SKEW = 2.0
# ``CacheTuning.tier_swap_z`` (None: this; an H100, the Qwen3 and gemma-4 traces: 1.11x and 1.46x at
# a quarter, 1.58x and 1.03x at a tenth, docs/benchmarks/tiers.md): a pair swaps only where the one
# coming in beats the one going out by that many standard deviations of their counts' difference
# were both used alike ((hot - cold)^2 > z^2 (hot + cold) / (1 + DECAY); one never used gives way as
# before). At SWAP_Z the traces replayed at a quarter (16 layers) moved 0.20 and 0.14 experts a
# token where the margins alone moved 1.09 and 0.65, serving 0.815 / 0.859 of uses against 0.804 /
# 0.855; at a tenth 0.12 / 0.07 against 0.83 / 0.44; at half the same shares; the first pass from a
# cold load 0.722 against 0.727 (Qwen3, a quarter), the others within 0.008; shifts back in 32
# tokens as before. Each move cost an H200 ~1.5-6.5% of a token's time a move a token (uniform
# routing, moves 5.3-6.9 a token against none: 1.08-1.35x)
SWAP_Z = 2.0


def device_slots(banks, device_bytes: int) -> List[int]:
    """Experts per bank in the device tier: ``device_bytes`` shared over the banks as the slot
    plan shares a budget (the same count each, then one more to layers in model order while what
    is left lasts), at most every expert."""
    per = sum(b.layer.expert_nbytes for b in banks)
    each = max(0, device_bytes // per) if per else 0
    plan = [min(each, b.num_experts) for b in banks]
    left = device_bytes - sum(n * b.layer.expert_nbytes for n, b in zip(plan, banks))
    for i, b in enumerate(banks):
        if plan[i] < b.num_experts and left >= b.layer.expert_nbytes:
            plan[i] += 1
            left -= b.layer.expert_nbytes
    return plan


class BankTier:
    """One identity bank's tiers: which experts are on the device, the decayed use counts."""

    def __init__(self, bank, on_device: int):
        self.bank = bank
        self.capacity = on_device
        self.counts = np.zeros(bank.num_experts, dtype=np.float64)
        self.device = np.zeros(bank.num_experts, dtype=bool)
        self.device[:on_device] = True  # no counts yet: the first experts
        self.pending: List = []  # the calls' ids arrays kept, not gathered yet
        self.fresh = np.zeros(bank.num_experts)  # the last batch's uses per expert (``TierTable``)
        self.prompt: List = []  # a prompt's uses per expert (calls' or a set pass's), uncounted
        self.calls = 0  # decode calls (a token each)
        self.uses = {"device": 0, "host": 0}  # counted uses each tier served


class Tiers:
    """The two tiers of one model's banks (module docstring). ``placer``: ``cuda_placer.CudaPlacer`` or any
    object with ``place(ranges, on_device)``; moves run on one background thread."""

    def __init__(self, placer, device_bytes: int, host_bytes: int, join=False,
                 min_skew=MIN_SKEW, swap_z=0.0):  # fmt: skip
        self.placer = placer
        self.join = join  # a batch's ids joined by one kernel (``CacheTuning.join_kernel``)
        self.min_skew = min_skew  # (``MIN_SKEW``; 0: a bank's counts may be as even as chance)
        self.swap_z = swap_z  # (0: a pair's counts may differ by chance; ``SWAP_Z``: not)
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self.banks: Dict[int, BankTier] = {}
        self.table = TierTable([])  # their counts and tiers, a row each (``plan``)
        self.moves = 0  # experts moved between the tiers after the first placement
        self.tokens = 0  # decode tokens: the most decode calls of any bank
        self.batches = 0  # batches of moves issued (``rebalance``)
        self.prompt_calls = 0  # calls run over a device copy of their bank (``caller``)
        self.prompted = False  # a prompt ran since the last batch: the next token's call batches
        self.gathered = None  # ``gather``'s ``(ids joined, {id(tier): its span})``, not read yet
        # the running share of a batch's uses the device served; batches left by SWAP_MIN_FAST
        self.served: Optional[float] = None
        self.fast = self.shifts = 0
        self.error: Optional[str] = None  # the first placement the runtime refused, if any
        self.released = False  # the banks' advice taken back (``close``)
        # each queued placement: ``(on_device, ranges)`` jobs, run on one background thread
        self._moves = QueueWorker("mlx-lm-streaming-tiers", self._place)

    # -- placement --------------------------------------------------------------------------

    def plan(self, banks) -> None:
        """The device tier's size per bank (``device_slots``), first placement queued."""
        for bank, n in zip(banks, device_slots(banks, self.device_bytes)):
            tier = self.banks[id(bank)] = BankTier(bank, n)
            self._submit([(bank, np.arange(bank.num_experts), tier.device.copy())])
        self.table = TierTable(list(self.banks.values()))  # (each tier's arrays: its rows)

    def ranges(self, bank, experts) -> List[tuple]:
        """``(address, nbytes)`` of the experts' bytes in each part of the bank, a range per run
        of consecutive experts (each costs the runtime two advices and a prefetch). On the
        model's thread: taking an MLX array's address evaluates it, which another thread must
        not do (seen on the H200 as placements that never ran, and a decode that stopped); the
        bank's views' addresses where it has them (kept current by ``refresh_views``)."""
        from ..reads.bank_reads import _runs
        from ..reads.host_views import host_address

        out = []
        ids = sorted(int(e) for e in experts)
        runs = _runs(ids, ids)  # (first, first, length) of each run of consecutive experts
        known = bank.view_addresses
        for i, spec in enumerate(bank.layer.parts):
            arr = bank.array(spec.proj, spec.part)
            base = known[i] if known is not None else host_address(arr)
            if base is None:
                return []
            per = arr.nbytes // bank.slots
            out += [(base + e * per, k * per) for e, _, k in runs]
        return out

    def _submit(self, moves) -> None:
        """``moves``: ``(bank, experts, on_device)`` each, placed as one job: every range out of
        the device first, then every range in."""
        # the ranges taken here, on the model's thread; the worker only calls the runtime
        jobs = []
        for flag in (False, True):
            ranges = []
            for bank, experts, on_device in moves:
                experts, on_device = np.asarray(experts), np.asarray(on_device)
                ranges += self.ranges(bank, experts[on_device == flag])
            jobs.append((flag, ranges))
        self._moves.put(jobs)

    def _place(self, jobs) -> None:
        try:
            for flag, ranges in jobs:  # out of the device first, then in
                if ranges:
                    self.placer.place(ranges, on_device=flag)
        except OSError as e:  # where bytes live, not what they are: said, not fatal
            self.error = str(e)

    def drain(self) -> None:
        """Wait until every queued placement was issued (and, on CUDA, ran)."""
        self._moves.join()
        wait = getattr(self.placer, "wait", None)
        if wait is not None:
            wait()

    def close(self, wait: bool = True) -> None:
        """No move after the one running (``wait`` False, a finalizer's: not waited for); then,
        once, every bank's advice taken back (``placer.unplace``): MLX hands a freed bank to the
        next array of its size (a model loaded after this one), which would keep it."""
        self._moves.close()
        if wait:
            self._moves.join()
        unplace = getattr(self.placer, "unplace", None)
        if unplace is not None and not self.released:
            self.released = True  # (a finalizer's: only addresses known, no array evaluated)
            banks = [t.bank for t in self.banks.values() if wait or t.bank.view_addresses]
            try:
                unplace([r for b in banks for r in self.ranges(b, range(b.num_experts))])
            except OSError:  # (the memory is being given up: said nowhere)
                pass

    # -- following the routing ----------------------------------------------------------------

    def caller(self, bank, glu):
        """A complete bank's call (``LayerBank.complete_call``, ``StockGraph``): ``glu(x,
        indices)``, stock's code over the bank. A decode call's ids are kept for the device
        tier's count (``MOVE_EVERY``); a prompt's call (``device_copy.is_prompt``) is not
        counted and runs over a device copy of the bank (``device_copy.run``)."""
        tier = self.banks.get(id(bank))
        if tier is None:
            return glu
        pending = tier.pending

        def call(x, indices):
            if device_copy.is_prompt(bank, indices):
                self.prompt_calls += 1
                tier.prompt.append(expert_counts([indices], bank.num_experts))  # (read later)
                self.prompted = True
                return device_copy.run(bank, glu, x, indices)
            tier.calls += 1
            if tier.calls > self.tokens:  # the step's first call: a token begins
                self.tokens = tokens = tier.calls
                if tokens % MOVE_EVERY == 0 or self.prompted:
                    self.rebalance()
                if (tokens + 1) % MOVE_EVERY == 0:
                    self.gather()
            pending.append(indices)
            return glu(x, indices)

        return call

    def seed(self, bank, uses: np.ndarray) -> None:
        """A long prompt's uses per expert of ``bank``'s layer (``prefill.set_pass``, over layer
        sets), counted at the batch of the first token after the prompt."""
        tier = self.banks.get(id(bank))
        if tier is not None and uses.any():
            tier.prompt.append(uses)
            self.prompted = True

    def gather(self) -> None:
        """Every bank's kept ids joined into one array, launched now (``mx.async_eval``: behind
        the token in flight) and read at the next batch (``follow``), a token later, when it has
        long run: one read of device memory a batch. Reading each call's ids array instead took
        128 reads a batch at 16 layers, which on an H100 kept the device 0.6 ms a step busier
        (likely each read's managed page pulled to the host and back: docs/benchmarks/tiers.md,
        "The thirteenth session")."""
        import mlx.core as mx

        from ..bank.join_ids import join_flat

        arrays, spans, at = [], {}, 0
        for tier in self.banks.values():
            done = tier.pending[:]
            tier.pending.clear()  # (the list its calls append to)
            arrays += done
            n = sum(map(_SIZE, done))
            spans[id(tier)], at = (at, at + n), at + n
        joined = join_flat(arrays, self.join) if arrays else None  # (``bank.join_ids``)
        if joined is not None:
            mx.async_eval(joined)
        self.gathered = (joined, spans)

    def rebalance(self) -> None:
        """One batch: every bank's kept ids counted and its swaps chosen (``follow``,
        ``TierTable.swaps``: one table, not a loop over banks), the moves of all the banks
        submitted as one job."""
        self.prompted = False
        if self.follow():  # (a fast batch: the shift is the routing's unevenness)
            rule = (SWAP_MIN_FAST, FAST_DECAY, 0.0, 0.0)
        else:
            rule = (SWAP_MIN, DECAY, self.min_skew, self.swap_z)
        tiers, swaps = self.table.tiers, self.table.swaps(SWAP_RATIO, *rule)
        moves = [(tiers[i].bank, changed, tiers[i].device[changed]) for i, changed in swaps]
        self.moves += sum(len(c) for _, c, _ in moves)
        if moves:
            self.batches += 1
            self._submit(moves)

    def follow(self) -> bool:
        """The ids ``gather`` joined, read once and counted (``TierTable.count``), after a
        prompt's uses per expert, which count where the device tier goes but are no decode's
        uses served (its most used expert weighs as one every token of PROMPT_TOKENS); whether
        this batch is a fast one, which swaps by ``SWAP_MIN_FAST`` and keeps ``FAST_DECAY`` of its
        counts (else ``SWAP_MIN``, ``DECAY``, the skew and the pairs' noise asked for): the
        ``FAST_BATCHES`` batches from one whose uses the device served at a share ``SHIFT_DROP``
        below the running share (a routing shift: the counts before it then weigh
        ``SHIFT_KEEP``)."""
        joined, spans = self.gathered or (None, {})
        self.gathered = None
        flat = None
        if joined is not None:
            flat = np.array(joined)
            flat = flat.reshape(-1).astype(np.int64)
        for tier in self.table.tiers:
            if tier.prompt:
                uses = sum(np.array(c, dtype=np.float64) for c in tier.prompt)
                tier.prompt.clear()
                if uses.max() > 0:
                    tier.counts += uses * (PROMPT_TOKENS / uses.max())
        on, used = self.table.count(flat, spans)
        for tier, served, n in zip(self.table.tiers, on.tolist(), used.tolist()):
            tier.uses["device"] += served
            tier.uses["host"] += n - served
        on, used = int(on.sum()), int(used.sum())
        if used:
            share, served = on / used, self.served
            drop = SHIFT_DROP_FAST if self.fast else SHIFT_DROP
            if served is not None and share < served - drop:
                self.fast, self.shifts = FAST_BATCHES, self.shifts + 1
                self.table.shift(SHIFT_KEEP)
            self.served = share if served is None else served + SHARE_WEIGHT * (share - served)
        if self.fast:
            self.fast -= 1
            return True
        return False

    # -- the figures -------------------------------------------------------------------------

    def check(self) -> Optional[str]:
        """Where the runtime says each bank's first device-tier and first host-tier expert live
        (their first part's range), against the tier each is in: "k of n as planned" (a placer
        that cannot tell: None), once the moves queued are issued (a batch queued just before:
        its experts' flags say where they go, the runtime where they were). On the model's
        thread (``ranges``)."""
        where = getattr(self.placer, "where", None)
        if where is None:
            return None
        self._moves.join()
        ok = n = 0
        for tier in self.banks.values():
            for flag in (True, False):
                picked = np.flatnonzero(tier.device == flag)[:1]
                ranges = self.ranges(tier.bank, picked) if len(picked) else []
                if ranges:
                    n += 1
                    ok += where(*ranges[0]) == (("device",) * 2 if flag else ("host",) * 2)
        return f"{ok} of {n} as planned"

    def summary(self) -> dict:
        device = sum(int(t.device.sum()) * t.bank.layer.expert_nbytes for t in self.banks.values())
        total = sum(t.bank.num_experts * t.bank.layer.expert_nbytes for t in self.banks.values())
        on = sum(t.uses["device"] for t in self.banks.values())
        off = sum(t.uses["host"] for t in self.banks.values())
        return {
            "tier_device_gb": device / 1e9,
            "tier_host_gb": (total - device) / 1e9,
            "tier_device_share": on / (on + off) if on + off else float("nan"),
            "tier_sampled_uses": on + off,
            "tier_moves": self.moves,
            "tier_moves_per_token": self.moves / self.tokens if self.tokens else 0.0,
            "tier_move_batches": self.batches,
            "tier_shifts": self.shifts,
            "tier_prompt_calls": self.prompt_calls,
            "tier_error": self.error,
            "tier_placed": self.check(),
        }


# the host tier when --expert-host-gb is not given: ``split``'s default (every expert the device
# cannot hold, where host RAM less a margin allows it), on mlx-cuda only where the placement was
# measured faster than streaming misses from the page cache, and exact (docs/design.md, "Two tiers
# on mlx-cuda", gives the run)
DEFAULT_ON = True
def set_up(cache, given_gb, backend: str, placer=None, available=None) -> None:
    """Give ``cache`` its host tier (``split``) and ``Tiers`` where it is on mlx-cuda and the two
    tiers hold every expert; where a host budget is given below what they would need, a host
    cache between the device's slots and disk (``host_cache``: off by default, not yet measured
    on a GPU); elsewhere nothing changes. A host budget given off CUDA is refused in one line
    (``ConfigurationError``)."""
    from ...errors import ConfigurationError

    if backend != "cuda":
        if given_gb:
            raise ConfigurationError(
                f"{FLAG} is for mlx-cuda only: on {backend}, memory is unified and the expert "
                "cache already is host memory; leave it out"
            )
        return
    if cache.budget_bytes is None or not cache.banks or (given_gb is None and not DEFAULT_ON):
        return
    total = cache.total_expert_bytes
    device = min(cache.budget_bytes, total)
    available = available_host_bytes() if available is None else available
    host = split(total, device, given_gb, available)
    if host == 0 and not given_gb:
        return
    from ...option_table import GB
    from . import host_cache, machine as memory
    from .cuda_placer import cuda_placer

    placer = placer if placer is not None else cuda_placer()
    if placer is None:
        return
    # never more device memory for the device tier than the device has free (a managed range
    # prefetched beyond it can hang the GPU): at most the default budget's share of it
    free = getattr(placer, "free_device_bytes", lambda: None)()
    slots = device  # today's slot banks' budget, where there are no two tiers
    if host and free is not None and device > int(free * memory.CUDA_CACHE_SHARE):
        device = int(free * memory.CUDA_CACHE_SHARE)
        host = split(total, device, given_gb, available)
    if host == 0:  # given below the rest: today's slot banks, a host cache behind them
        if given_gb and total > slots:
            host_cache.set_up(cache, min(int(given_gb * GB), total - slots), placer)
        return
    cache.host_bytes = host
    tuning = cache.tuning  # (mlx-cuda here)
    skew = MIN_SKEW if tuning.tier_min_skew is None else tuning.tier_min_skew
    z = SWAP_Z if tuning.tier_swap_z is None else tuning.tier_swap_z
    cache.tiers = Tiers(placer, device, host, tuning.cuda_only("join_kernel", True), skew, z)
    cache.planned = False
