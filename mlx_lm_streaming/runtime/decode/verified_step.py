"""The verified step: a forward runs with no host sync per MoE layer, its experts checked once.

mlx-lm's own ``SwitchGLU`` never waits for the host: the router's ids index the experts on the
device. The per-layer schedule (``switch.py``) reads the ids back in every MoE layer, to make the
experts resident before the layer computes; on a GPU that wait, once per layer, costs more than the
layer itself. Nothing needs it while the experts a forward picks are resident already. A verified
step runs the forward with each MoE layer's ids turned into slot ids on the device
(``LayerBank.device_map``), then reads every layer's ids back once and counts on the host the
experts the layers' maps (host copies, as each call saw them) mark missing:

- none missing: every row came from its expert's slot: the per-layer schedule's graph (gather over
  the slot bank, exact: docs/design.md), so stock's bits. The host work the layers skipped (the
  policy's record of uses, the counters, the routing record) is done from the ids, which are on the
  host by then at no wait;
- some missing: the first MoE layer with a miss computed rows from the wrong slot, and every layer
  after it took a wrong input; the layers before it are right. Its ids are right (its input is), so
  its missing experts are read, the cache entries of that decoder layer and those after it are put
  back as they were before the step (``StepCaches``: KV entries' tokens taken back, hybrids'
  recurrent states given back their arrays), and the forward runs again, each decoder layer before
  that one giving back its recorded output (``layer_call``) instead of computing (a layer run again
  gets its first call's arguments: masks made before the step). Repeated until nothing is missing:
  one host sync per token plus one per layer that missed, instead of one per layer.
- read together (``CacheTuning.read_misses_together``): the layers after the first miss ran on a
  slightly wrong input, but on a trained model they pick nearly the experts they will pick once
  right (98.5% of them on the routing model, docs/routing.md). So the experts that pass picked and
  its banks lack are read too, at the same time as the missed layer's (``load_together``: several
  banks at once, each expert on its own demand thread), as guesses (``LayerBank.load(...,
  guessed=True)``: counted as misses only if the pass run again uses them). The forward then runs
  again from the first missed layer, and usually finds nothing missing: about one host sync more per
  token that missed, however many layers missed, and its reads overlapped.

Where layers cannot be replayed (``model.layers`` not wrapped, a cache entry shared by layers or
written outside them, a layer given what another gave beside its output: ``tuple_input``), a miss
puts every cache entry back and, once its experts and those the pass named are read, runs the whole
call again (``restart``); a miss in that run runs it per layer (layers not wrapped: per layer at
once). Which decode calls are verified steps: ``runner.StepRunner``.
"""

from operator import itemgetter
from threading import get_ident
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..bank import load_together
from . import schedules, share_limits
from .modes import Mode
from .named_reads import LOOK_SHARE, call_ids, count_as_named, guess, host_counts
from .named_reads import issue_after_first, look_first, may_read_in_pass
from .step_caches import StepCaches
from .step_uses import distinct_per_call, note_uses

MISSED_WEIGHT = share_limits.MISSED_WEIGHT  # (the running means' weight of the newest call)
_IDS, _SIZE = itemgetter(1), itemgetter(2)  # (a kept call's ids, their count: C, no frame)


class _Again(Exception):
    """A miss the step cannot take back layer by layer: the call runs again whole, per layer; or
    (``whole``: its misses and those the pass beyond named read first) once as a verified step."""

    def __init__(self, whole: bool = False):
        super().__init__()
        self.whole = whole


class VerifiedStep(Mode):
    """One model call run as a verified step (the mode of that call: ``modes``): its MoE calls,
    its decoder layers' calls and outputs."""

    wraps = True  # its decoder layers' calls are recorded (``layer_call``), to be run again

    def __init__(self, runner, kv, tokens: int, every: int):
        self.owner = get_ident()  # (``modes``: another thread's layer calls run per layer)
        self.runner = runner
        self.kv = kv
        self.layers = runner.layers  # decoder layers wrapped in the model, or 0
        # MoE calls between two checks (at least 1); the last decoder layer always checks
        self.every = every
        # decoder layers below this give back their recorded output (a forward run again)
        self.replay_below = 0
        # the decoder layer running now, and each one's call and output in this step
        self.layer: Optional[int] = None
        self.ran = -1
        self.inputs: Dict[int, tuple] = {}
        self.outputs: Dict[int, object] = {}
        self.given: set = set()  # ids of what layers gave beside their output (``tuple_input``)
        # the cache entries as they were before the step, and the layer that got each
        self.caches = StepCaches(kv)
        # whether layers can be run again from one that missed: the model's layers were wrapped,
        # each got a cache entry of its own or none (``layer_call``) and took the output of
        # the layer before as its input
        self.replayable = self.layers > 0
        # MoE calls not yet checked: (decoder layer, bank, ids (lazy), the bank's host map of
        # missing experts as the call saw it)
        self.calls: List[tuple] = []
        # id(bank) -> (bank, ids, their count) of the call kept for each MoE layer;
        # banks whose experts a load in this step made resident (counted there)
        self.kept: Dict[int, tuple] = {}
        self.loaded: set = set()
        # the kept calls' ids, concatenated in the order of ``kept`` (set by the check after the
        # forward)
        self.ids: Optional[mx.array] = None
        # the last check's per-call miss counts (host); id(bank) -> experts read for it on the
        # word of a pass that ran beyond a miss (``load_together``)
        self.counts: Optional[np.ndarray] = None
        # the ids that check read back, a row per call (``call_row``), or None; the lazy array
        # they were read from, and the one ``ids`` is a view of where it is the rows flattened
        self.rows: Optional[np.ndarray] = None
        self.rows_of = self.ids_of = None
        self.guessed: Dict[int, set] = {}
        self.guesses_read = False
        # a held step's unchecked calls' ids (``hold``: ``call_ids``), lazy until its check
        # (``StepRunner.check``) reads them
        self.held_ids: Optional[mx.array] = None
        self.held = False  # ``counts`` are a held step's, made by ``StepRunner.check``
        self.restarted = False  # run again whole after its misses were read (``restart``)
        # banks whose landings its MoE calls take (``CacheTuning.replay_as_landed``); the reads
        # its last check issued as the pass named them (``named_reads``), not yet handed on
        self.later = self.early = None
        # its first MoE call's reads to be issued as it is built (``named_reads.look_first``),
        # and whether they were (its check issues the guesses beyond: ``issue_after_first``)
        self.look = runner.look_first and runner.together and runner.first_missed >= LOOK_SHARE
        self.looked = False
        # the stream its layers' work is submitted to (``LayerBank.last_stream``)
        self.stream = mx.default_stream(mx.default_device())

    def moe_call(self, layer, x, indices):
        """Chosen for a bank with slots and a kernel that takes the ids on the device: the
        router's ids mapped to slot ids on the device, with no host sync, and the bank's device
        map of missing experts kept for the check, which counts every layer's misses at once
        after the forward. Elsewhere (a complete bank with no routing recorded, a kernel that wants
        the slots on the host, no slots) the layer's own schedule (``Mode.moe_call``). Measured:
        the per-layer host sync costs more than the layer on a GPU."""
        bank = layer.bank
        cache = bank.cache
        if self.later is not None:  # (its reads issued by the last check: their landings)
            self.later.take(bank)
        size = indices.size  # (an MLX attribute: read once)
        kernel = (layer.kernels.get(size) or schedules.kernel_of(layer, size))[0]
        # (a complete bank's graph is stock's where no recorder wants the step's record of ids)
        if kernel.needs_host_slots or bank.slots == 0 or bank.complete and cache.recorder is None:
            return Mode.moe_call(self, layer, x, indices)
        tl = cache.timeline
        start = tl.now()
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
            if kernel.calls_only_glu:  # (its call: the layer's own code over the bank)
                mapped = bank.glu_mapped  # (compiled: ``slots[indices]`` in its graph)
                y = bank.glu_call(x, slots[indices]) if mapped is None else mapped(x, slots, indices)
            else:
                y = kernel(x, slots[indices], None, bank)
        # (its ids as the router gave them: the check flattens every call's at once)
        self.calls.append((self.layer, bank, indices, missing))
        self.kept[id(bank)] = (bank, indices, size)
        bank.last_stream = self.stream
        # its ids are not on the host: its experts and misses are the step's to count
        tl.layer(start, bank.path, size // indices.shape[-1], verified=True)
        if self.look:  # (the step's first MoE call, where recent steps' often missed)
            self.look = False
            look_first(self, bank, indices, missing)
        return y

    def layer_call(self, i: int, call, args, kwargs):
        """Decoder layer ``i`` of the model (``mlx_shims.wrap_call``): run, recorded, and checked
        every ``every`` MoE calls and at the last layer."""
        # its cache entry (``mlx_shims.layer_cache``, inline: every decode step's layers pass)
        entry = args[2] if len(args) > 2 else kwargs.get("cache")
        # (its entry recorded in ``StepCaches`` here: a call fewer per decoder layer)
        caches = self.caches
        caches.entries[i] = entry
        if entry is not None and (
            id(entry) not in caches.marks or caches.owners.setdefault(id(entry), i) != i
        ):
            self.replayable = False  # an entry none of the call's, or another layer's
        outputs = self.outputs
        if i > 0:
            prev = outputs.get(i - 1)
            if type(prev) is tuple:  # (gemma-4's, kimi-k3's layers: ``(h, ...)``)
                self.tuple_input(prev, args, kwargs)
            elif not args or args[0] is not prev:
                self.replayable = False
        if i < self.replay_below:  # the forward run again after a miss in a later layer
            return self.outputs[i]
        if i in self.inputs and args:
            # run again: the arguments its first call got, made from the caches as they were
            # before the step (masks and offsets made again now would see the layers before
            # written), with its input of now
            _, first_args, first_kwargs = self.inputs[i]
            args, kwargs = (args[0], *first_args[1:]), first_kwargs
        self.layer, self.ran = i, max(self.ran, i)
        self.inputs[i] = (call, args, kwargs)
        out = outputs[i] = call(*args, **kwargs)
        if self.later is not None:  # (run again while later banks' reads land: begun now)
            mx.async_eval(_first(out))
        if len(self.calls) >= self.every and i < self.layers - 1:
            self.settle(i)
            return outputs[i]
        return out

    def tuple_input(self, prev: tuple, args, kwargs) -> None:
        """A layer after one that gave a tuple: replayable while its input is the tuple's first
        item and nothing else it is given came from a layer's tuple (a KV-shared layer's keys and
        values, kimi-k3's blocks: a replay would give it those of the first pass). Seen by
        identity, as the input is: mlx-lm's loops (gemma-4, kimi-k3, hunyuan, muse_spark) pass
        what a layer gave as it is, none something made from it between layers."""
        given = self.given
        given.update(id(v) for v in prev[1:] if not isinstance(v, (int, float, type(None))))
        if not args or args[0] is not prev[0]:
            self.replayable = False
        elif not given.isdisjoint(map(id, (*args[1:], *kwargs.values()))):
            self.replayable = False

    def settle(self, upto: int) -> None:
        """Check the MoE calls so far (one host sync); while one has a missing expert, read its
        experts, take back the cache entries its decoder layer and those after it wrote, and run
        them again, up to decoder layer ``upto``."""
        while True:
            layer = self.read_missing()
            if layer is None:
                return
            self.caches.rewind(layer, upto + 1)
            self.runner.replays += 1
            for i in range(layer, upto + 1):
                call, args, kwargs = self.inputs[i]
                if i > 0:  # the layer before's output, as it is now (it may have run again)
                    args = (_first(self.outputs[i - 1]), *args[1:])
                self.inputs[i] = (call, args, kwargs)
                self.layer = i
                self.outputs[i] = call(*args, **kwargs)

    def read_missing(self, out=None) -> Optional[int]:
        """Check the MoE calls not yet checked (one host sync; ``out``: the forward's output, for
        the check after it). None if nothing is missing; else read the first missing call's
        experts and return its decoder layer, from which the forward must run again (raises
        ``_Again`` where it cannot)."""
        if self.later is not None:  # (the layers run again took what they used: the rest)
            self.land()
        first = self.first_miss(out)  # (it did the step before's host work)
        if first is None:
            self.calls = []
            return None
        layer, bank, indices, _ = self.calls[first]
        early, self.early = self.early, None
        if early is not None:  # (its reads issued as it was built, or by the check)
            whole = self.looked and issue_after_first(self, first, early)
            self.runner.read_in_pass += not self.looked
            self.looked = False
            self.loaded.add(id(bank))
            self.calls = []
            if whole:  # (its reads and the guesses' landed first)
                early.finish()
                raise _Again(whole=True)
            if self.runner.as_landed:
                self.later = early
            else:
                early.finish()
            return layer
        experts = np.unique(self.call_row(first, indices).astype(np.int64))
        # it missed again after its load (ids that changed), or more experts than slots
        if len(experts) > bank.slots or id(bank) in self.loaded:
            raise _Again
        # layers that cannot be run again from the one that missed (a layer given what another
        # gave beside its output; an entry written outside the layers): the reads below, then the
        # call again whole (``_Again(whole=True)``, once: ``restart``)
        whole = not self.replayable or self.caches.unclaimed_changed()
        if layer is None or whole and (self.restarted or not self.outputs):
            raise _Again
        # no pending work may read a slot the load writes
        mx.eval(self.outputs[self.ran])
        tl = bank.cache.timeline
        start = tl.now()
        runner = self.runner
        # (the call run again whole: the pass's names read whatever the guesses scored, the
        # layers after the first miss being no cheaper to run per layer than to read ahead)
        guesses = self.named_after(first, whole) if runner.together else []
        # reads what is missing; counts the call's hits and misses (landings taken later: as
        # the layers run again)
        later = not whole and runner.as_landed
        self.later = load_together([(bank, experts, {})] + guesses, later=later)
        self.loaded.add(id(bank))
        tl.span("verify load", start, "read", layer=bank.path, experts=len(experts),
                guessed=sum(len(g[1]) for g in guesses))
        self.calls = []
        if whole:
            raise _Again(whole=True)
        return layer

    def land(self, error: bool = False) -> None:
        """The landings the layers run again did not take, taken (``error``: the reads ended,
        nothing mapped)."""
        later, self.later = self.later, None
        if later is not None:
            later.close() if error else later.finish()
        early, self.early = self.early, None
        if early is not None:  # (an error's, between the check and its reads' hand-on)
            early.close()

    def restart(self) -> None:
        """Begun again for the call run again whole (``_Again(whole=True)``), its caches put back
        by the caller: its layers' and MoE calls' records anew, what its loads counted kept; a
        miss in that run runs the call per layer."""
        self.replay_below, self.layer, self.ran, self.restarted = 0, None, -1, True
        self.inputs, self.outputs, self.calls, self.kept, self.given = {}, {}, [], {}, set()

    def named_after(self, first: int, always: bool = False) -> List[tuple]:
        """``(bank, experts, load options)`` for each MoE call after ``calls[first]`` that the
        check found missing experts: those its ids (picked on a wrong input) name and its bank
        lacks, to be read as guesses, the call's other experts kept; none while the runner's
        guesses scored badly (``StepRunner.guess_precision``: scored at ``commit`` either way),
        unless ``always``."""
        read = always or self.runner.guess_precision >= self.runner.min_precision
        out = []
        for j in np.nonzero(self.counts[first + 1 :])[0] + first + 1:
            _, bank, indices, _ = self.calls[j]
            load = guess(self, bank, self.call_row(j, indices), read)
            if load is not None:
                out.append(load)
        return out

    def call_row(self, j: int, indices) -> np.ndarray:
        """Call ``j``'s ids (``indices``) on the host: its row of those the last check read back,
        else read from its own array (on mlx-cuda a second read of device memory, which the device
        pays: docs/benchmarks/tiers.md, "The thirteenth session")."""
        rows = self.rows
        if rows is not None and rows.ndim == 2 and len(rows) == len(self.calls):
            return rows[j]
        return np.array(indices, copy=False)

    def hold(self) -> None:
        """The forward is built and handed back unchecked (``StepRunner.defer``): the arrays its
        check reads, made lazily, to be evaluated with the caller's next arrays (the ids for
        ``commit``, the unchecked calls' ids)."""
        self.held_ids, rows = call_ids(self.calls, self.runner.join)
        self.ids = self.flat_ids(rows)

    def first_miss(self, out=None) -> Optional[int]:
        """The index in ``calls`` of the first MoE call with a missing expert, or None: a host
        sync. With the forward's output ``out``: it, the counts and every kept call's ids
        (``ids``, for ``commit``) handed to MLX in one evaluation."""
        if self.held:  # a held step's first check: its counts were made (``StepRunner.check``)
            self.held = False
            hit = np.nonzero(self.counts)[0]
            return int(hit[0]) if len(hit) else None
        if not self.calls:
            if out is not None:
                self.ids = self.flat_ids(None)
                mx.async_eval(out, self.ids)
            return None
        ids, rows = call_ids(self.calls, self.runner.join)
        pending = ()
        if out is not None:
            self.ids = self.flat_ids(rows)
            pending = (out, self.ids)
        mx.async_eval(*pending, ids)
        self.runner.flush()  # the step before's host work, while this one computes
        tl = self.calls[0][1].cache.timeline
        start = tl.now()
        if self.runner.in_pass and may_read_in_pass(self):  # (``CacheTuning.reads_in_pass``)
            self.rows = None
            counts = self.counts = count_as_named(self)
        else:  # (the ids read back, the one host sync, kept for ``call_row`` and ``commit``)
            self.rows, self.counts = host_counts(self.calls, ids)
            self.rows_of = ids
            counts = self.counts
        tl.span("verify", start, "sync", calls=len(self.calls))
        runner = self.runner
        runner.first_missed += MISSED_WEIGHT * ((counts[0] > 0) - runner.first_missed)
        hit = np.nonzero(counts)[0]
        return int(hit[0]) if len(hit) else None

    def flat_ids(self, rows) -> mx.array:
        """Every kept call's ids one after another, flat (``ids``, for ``commit``): ``rows``
        (``call_ids``': the unchecked calls' ids, a row each) where those calls are the kept
        ones in order (a forward checked once: a token's layers), else each kept call's ids
        flattened: no reshape per MoE call while the forward is built."""
        kept, self.ids_of = self.kept, None
        if rows is not None and len(self.calls) == len(kept):
            for call, kept_call in zip(self.calls, kept.values()):
                if call[2] is not kept_call[1]:
                    break
            else:
                self.ids_of = rows
                return rows.reshape(-1)
        return mx.concatenate(list(map(mx.flatten, map(_IDS, kept.values()))))

    def commit(self, cache) -> None:
        """The host work of a step found complete: each kept MoE call's uses told to its policy and
        counted as hits (unless a load in this step counted them), the routing recorded, identity
        banks' fill asked for."""
        hits = misses = named = used = 0
        kept = self.kept
        # the kept calls' ids, in ``kept``'s order: the rows the check read where ``ids`` is
        # them flattened (no second read), else one read
        if self.rows is not None and self.ids_of is not None and self.ids_of is self.rows_of:
            flat = self.rows
        else:
            flat = np.array(self.ids, copy=False)
        flat = flat.reshape(-1).astype(np.int64)
        distinct = distinct_per_call(flat, list(map(_SIZE, kept.values())))
        at = j = 0
        # nothing missing: the policies' records of the uses (``note_uses``), all at once
        banks, uses = [], []
        for key, (bank, indices, size) in kept.items():
            experts = distinct[j]
            j += 1
            guessed = self.guessed.get(key)
            if guessed:  # the guess, read or not, against the experts the call used
                named += len(guessed)
                used += len(guessed.intersection(experts.tolist()))
            if key in self.loaded:
                bank.drop_guesses()  # its load counted what it used
            else:
                banks.append(bank)
                uses.append(experts)
            if cache.recorder is not None:
                cache.recorder.record(bank, flat[at : at + size].reshape(indices.shape))
            at += size
            if bank.identity and not bank.complete:
                cache.request_fill(bank)
        if banks:  # (guesses a call used are its misses)
            hits, misses = note_uses(banks, uses)
        stats = cache.stats
        if stats.first_request is None:
            stats.start()
        stats.add(hits, misses, 0)
        runner = self.runner
        if named:
            runner.named_used += used if self.guesses_read else 0
            runner.guess_precision += MISSED_WEIGHT * (used / named - runner.guess_precision)


def _first(out):
    """A decoder layer's output, or the first item of the tuple it gave (its hidden states)."""
    return out[0] if type(out) is tuple else out
