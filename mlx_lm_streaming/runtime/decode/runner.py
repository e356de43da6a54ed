"""The runner of a streaming model's calls: each model call's mode, chosen once for the call.

``StepRunner.__call__`` is the model's call (``mlx_shims.wrap_call``). It puts the call's mode on the
cache (``modes``; ``ExpertCache.install``) for its length: stock's graph where every bank is complete
(``modes.COMPLETE``), a verified step (``verified_step.VerifiedStep``) or each layer on its own
(``modes.PER_LAYER``). It chooses verified steps for calls of up to
``VERIFY_MAX_TOKENS`` tokens, over caches that can be rewound, on one calling thread, outside
pipeline stages, while recent tokens missed in few enough layers (``share_limits``); the
per-layer schedule otherwise (prefill, cold caches).

A verified step may also be held (``defer``, set by ``checked_late.generate`` around one decode
call): its forward is built and handed back unchecked, with the arrays its check reads
(``Held``), so that the next token's graph is built on its sample before the host waits for it.
``check`` then reads its counts; on a miss, once the caller has taken the next token back,
``redo`` runs it again from the layer that missed, as an unheld step would have.
"""

import operator
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from threading import get_ident
from typing import Optional

from .. import mlx_shims
from . import share_limits
from .modes import COMPLETE, PER_LAYER
from .verified_step import VerifiedStep, _Again, host_counts

# calls of up to this many tokens (decode, a draft model's verification of its 3 default drafts) may
# be verified steps; longer ones (prefill) read most experts and take the per-layer schedule
VERIFY_MAX_TOKENS = 4
_MISSES = operator.attrgetter("misses")


@dataclass
class Held:
    """A verified step handed back unchecked (``StepRunner.defer``): its mode, and the call to
    run again on a miss."""

    step: VerifiedStep
    call: object
    args: tuple
    kwargs: dict

    def arrays(self) -> list:
        """What to evaluate with the call's output: the ids its check and commit read."""
        step = self.step  # (no comprehension: on Python 3.11 that is a call)
        return [step.ids] if step.held_ids is None else [step.held_ids, step.ids]


class StepRunner:
    """Runs each call of a streaming model as a verified step or with the per-layer schedule."""

    def __init__(self, state):  # loading.StreamingState
        self.state = state
        self.layers = 0  # decoder layers wrapped (``wrap_layers``)
        self.moe = 0  # MoE layers (banks), counted at the first decode-sized call
        # running mean of the share of MoE layers that missed, per decode-sized call; and of the
        # share of decode-sized calls that missed in some layer (``defers``)
        self.missed_share = self.missed_tokens = 0.0
        # calls run as verified steps; layers run again; calls run again whole; calls per layer
        self.verified = self.replays = self.recomputed = self.per_layer_decodes = 0
        self.read_in_pass = 0  # checks whose reads went as the pass named them (``named_reads``)
        # steps whose first MoE call's reads went as it was built (``named_reads.look_first``),
        # and the running share of checked steps whose first MoE call missed
        self.first_call_reads, self.first_missed = 0, 0.0
        # how a decode call's mode is chosen (``share_limits.way``), and whether a token that
        # missed nowhere brings the running share down to the limit
        self.choice, limit, self.clean_retries = share_limits.way(
            state.cache.tuning.verify_choice, state.selector.backend
        )
        if limit is not None:
            self.limit = limit
        # the last verified step found complete, whose host work (``commit``) is still to do
        self.pending: Optional[VerifiedStep] = None
        # whether a miss reads the experts the pass beyond it named too (``load_together``), and
        # how many experts were read so, and how many of those the pass run again used
        self.together = state.cache.tuning.read_misses_together
        self.named = self.named_used = 0
        # running share of the experts so named that the pass run again used, scored from the
        # first miss, read or not: they are read once it reaches ``CacheTuning.
        # lookahead_min_precision`` (three good tokens from 0), as lookahead's guesses: a wrong
        # guess costs a read and evicts an expert the step may want (issue 40)
        self.guess_precision = 0.0
        self.min_precision = state.cache.tuning.lookahead_min_precision
        # decode-sized calls to run per layer whatever the share: the last prompt token's step
        # after a layer-major prefill (``layer_major.prefill``), whose banks keep only the
        # prompt's last waves: a verified step would miss in most layers and read, on the word of
        # passes beyond a miss, experts the step does not use, evicting some that it does
        self.per_layer_calls = 0
        # the thread whose decode call, set around it, hands its verified step back unchecked
        # (``held``) for it to ``check`` once the next token's graph is built
        # (``checked_late.generate``; None: none); the steps so checked, and the next tokens taken
        # back because the one before them missed
        self.defer: Optional[int] = None
        self.held: Optional[Held] = None
        self.checked_late = self.dropped = 0
        # the thread a held step's check runs on (``check_soon``), made at its first use; the
        # lock that keeps the steps' host work (``commit``) one at a time, in order
        self.checker: Optional[ThreadPoolExecutor] = None
        self.commit_lock = threading.RLock()
        tuning, cuda = state.cache.tuning, state.selector.backend == "cuda"
        # a check's ids joined by one kernel (``CacheTuning.join_kernel``: mlx-cuda only)
        self.join = tuning.cuda_only("join_kernel", cuda)
        self.check_thread = cuda if tuning.check_on_thread is None else tuning.check_on_thread
        # a miss's landings taken as the layers run again (``CacheTuning.replay_as_landed``)
        self.as_landed = cuda if tuning.replay_as_landed is None else tuning.replay_as_landed
        # a check's reads issued as its calls' ids come back (``CacheTuning.reads_in_pass``)
        self.in_pass = cuda if tuning.reads_in_pass is None else tuning.reads_in_pass
        # a first MoE call's reads issued as it is built (``CacheTuning.first_call_reads``)
        self.look_first = cuda if tuning.first_call_reads is None else tuning.first_call_reads

    def flush(self) -> None:
        """Do the host work of the last complete verified step (before any load can evict, and
        before the counters are read)."""
        with self.commit_lock:
            pending, self.pending = self.pending, None
            if pending is not None:
                pending.commit(self.state.cache)

    def wrap_layers(self, model) -> None:
        """Route the model's decoder layers (``model.layers``) through ``layer_call``."""
        layers = getattr(model, "layers", None)
        if not isinstance(layers, list):
            return
        for i, layer in enumerate(layers):
            mlx_shims.wrap_layer(layer, i, self.state.cache)
        self.layers = len(layers)

    def __call__(self, call, args, kwargs):
        """A model call (``mlx_shims.wrap_call``), in the mode chosen for it (``modes``): stock's
        graph where every bank is complete, else a verified step where one may run, else per
        layer."""
        cache = self.state.cache
        if cache.budget_due is not None:  # free memory moved the budget (``moving_budget``)
            cache.follow_budget()
        if cache.all_complete:  # every bank complete: stock's graph, nothing to verify
            if self.pending is not None:
                self.flush()
            if not cache.install(COMPLETE):
                return call(*args, **kwargs)  # (another thread's call runs: its mode stays)
            try:
                return call(*args, **kwargs)
            finally:
                cache.mode = PER_LAYER
        tokens, kv = mlx_shims.call_inputs(args, kwargs)
        if tokens is None or tokens > VERIFY_MAX_TOKENS:
            self.flush()
            return call(*args, **kwargs)
        if not self.moe:
            self.moe = max(1, len(cache.banks))
        if self.per_layer_calls or not self._may_verify(tokens, kv):
            self.per_layer_calls = max(0, self.per_layer_calls - 1)
            if self.pending is not None:
                self.flush()
            banks = cache.banks
            before = list(map(_MISSES, banks))  # (C loops: no Python call per bank)
            out = call(*args, **kwargs)
            missed = sum(map(operator.gt, map(_MISSES, banks), before))
            self.per_layer_decodes += 1
            share_limits.note_call(self, missed, False)
            return out
        return self._verified(call, args, kwargs, kv, tokens)

    def limit(self) -> float:
        """The running share of layers that missed up to which calls may be verified steps."""
        if self.together:
            gpu = share_limits.MAX_MISSED_SHARE_TOGETHER_GPU
        else:
            gpu = share_limits.MAX_MISSED_SHARE_GPU
        return share_limits.MAX_MISSED_SHARE.get(self.state.selector.backend, gpu)

    def defers(self, kv) -> bool:
        """Whether the next one-token call over ``kv`` would be a verified step that can be held
        with another token in flight after it (its caches rewindable by two tokens) and checked
        once, after its forward (``every``: no check inside it), while few recent calls missed
        (``CacheTuning.checked_late``: a held step that misses costs the next token's
        forward, where a clean one saves the host time of building it)."""
        cache = self.state.cache
        return (
            not cache.all_complete
            and self.missed_tokens <= cache.tuning.checked_late
            and not self.per_layer_calls
            and self._may_verify(2, kv)
            and self.every() >= (self.moe or len(self.state.cache.banks))
        )

    def _may_verify(self, tokens: int, kv) -> bool:
        cache = self.state.cache
        return (
            cache.tuning.verified_steps
            and self.state.pipeline is None
            and not cache.shared
            and self.missed_share <= self.limit()
            and mlx_shims.rewindable(kv, tokens)
        )

    def every(self) -> int:
        """MoE calls between two checks of a verified step: all of them while tokens miss nowhere;
        with ``m`` layers expected to miss, about ``layers / (1 + m)`` (each check that finds a
        miss runs the layers since the one that missed again)."""
        moe = self.moe or max(1, len(self.state.cache.banks))
        if self.together:  # the pass beyond a miss names the later misses: check once, at the end
            return moe
        return max(1, round(moe / (1 + self.missed_share * moe)))

    def _verified(self, call, args, kwargs, kv, tokens, held: Optional[Held] = None):
        """A verified step of this call, checked after its forward (or handed back unchecked,
        ``defer``); ``held``: a held step that missed, run again from the layer that missed
        (``redo``), its forward not run again here."""
        cache = self.state.cache
        if held is None:
            cache.enter_call()  # (for every layer call of the step: ``StreamingSwitchGLU``)
            step = VerifiedStep(self, kv, tokens, self.every())
        else:
            step = held.step
        if not cache.install(step):  # another thread's call runs: this one per layer
            if held is not None:
                step.caches.rewind_all()  # (every entry as it was before the step)
            return call(*args, **kwargs)
        missed = out = None
        hold = held is None and self.defer == get_ident() and step.every >= self.moe
        if hold:
            step.every = self.layers + 1  # checked once, after the forward, by ``check``
            step.look = False  # (a held step is one expected to hit)
        try:
            if held is None:
                out = call(*args, **kwargs)
            if step.kept and hold:
                step.hold()
                self.held = Held(step, call, args, kwargs)
                return out
            if step.kept:
                self.verified += 1
                while True:  # the check after the forward: a miss runs it again from its layer
                    try:
                        layer = step.read_missing(out)
                    except _Again as again:  # (its misses read: the call again whole, once)
                        if not again.whole:
                            raise
                        step.caches.rewind_all()
                        step.restart()
                        self.recomputed += 1
                        out = call(*args, **kwargs)
                        continue
                    if layer is None:
                        break
                    step.caches.rewind(layer, step.ran + 1)
                    step.replay_below = layer
                    self.replays += 1
                    out = call(*args, **kwargs)
                if self.pending is not None:  # (the first check did it, unless none ran)
                    self.flush()
                if cache.recorder is not None:
                    step.commit(cache)  # the routing record holds every token once its call ends
                else:
                    self.pending = step  # its host work: while the next step computes
        except _Again:
            cache.mode = PER_LAYER
            self.recomputed += 1
            missed = self.moe  # the per-layer schedule suits this model or cache better
            step.caches.rewind_all()  # every entry as it was before the step
            out = call(*args, **kwargs)
        finally:
            # (an error's reads: a run that ended well took every one)
            if step.later is not None or step.early is not None:
                step.land(error=True)
            if cache.mode is step:
                cache.mode = PER_LAYER
        if missed is None:
            # the MoE layers that missed: those loaded, and those a pass beyond a miss found missing
            missed = len(step.loaded | step.guessed.keys())
        share_limits.note_call(self, missed, True)
        return out

    def take_held(self) -> Optional[Held]:
        """The verified step the last call handed back unchecked, or None (it was checked, ran
        per layer or over complete banks)."""
        held, self.held = self.held, None
        return held

    def check(self, held: Held, soon: Optional[Future] = None) -> bool:
        """Whether the held step found every expert resident (one host sync: its calls' ids,
        evaluated with its output); if so its host work is done now, while the next token
        computes. False: ``redo`` it. ``soon``: ``check_soon``'s for this step, whose answer is
        taken here."""
        self.checked_late += 1
        if not (soon.result() if soon is not None else self._check(held)):
            return False
        self.verified += 1
        share_limits.note_call(self, 0, True)
        return True

    def check_soon(self, held: Held) -> Optional[Future]:
        """The held step's check started on the runner's own thread (``CacheTuning.
        check_on_thread``; else None): ``checked_late.generate`` starts it before it builds the
        next token, whose launch (MLX's evaluation lets the interpreter go) the check's wait and
        host work then overlap; ``check(held, soon)`` takes its answer. Nothing of the next
        token's graph depends on it: on a hit it only records uses (``commit``), on a miss
        nothing."""
        if not self.check_thread:
            return None
        if self.checker is None:
            self.checker = ThreadPoolExecutor(1, thread_name_prefix="mlx-lm-streaming-check")
        return self.checker.submit(self._check, held)

    def _check(self, held: Held) -> bool:
        """``check``'s wait and host work, on whichever thread runs it."""
        step = held.step
        # (one host sync: its calls' ids; the counts kept for ``first_miss`` on a miss)
        ids, step.held_ids = step.held_ids, None
        step.rows, step.counts = host_counts(step.calls, ids)
        step.rows_of, step.held = ids, True
        if step.counts.any():
            return False
        step.calls = []
        with self.commit_lock:  # (the step before's first, if the decode thread has not)
            if self.pending is not None:
                self.flush()
            step.commit(self.state.cache)  # (nothing evicts before the caller takes the answer)
        return True

    def redo(self, held: Held):
        """A held step that missed, run again from the layer that missed until nothing is
        missing (or again whole, per layer), as an unheld step is: its output. The caller has
        taken back what came after it (its caches, pending work that reads the slots)."""
        step = held.step
        out = self._verified(held.call, held.args, held.kwargs, None, 0, held)
        if self.pending is step:  # (its host work now: nothing of the next token is built)
            self.flush()
        return out
