"""The verified step: a forward whose experts are all resident runs with no host sync per layer.

mlx-lm's own ``SwitchGLU`` never waits for the host: the router's ids index the experts on the
device. The per-layer schedules (``switch.py``) read the ids back in every MoE layer, to make the
experts resident before the layer computes; on a GPU that wait, once per layer, costs more than the
layer itself. When every expert a forward picks is resident already, nothing needs the ids on the
host first. A verified step runs the whole forward with each layer's ids turned into slot ids on
the device (``LayerBank.device_map``) and a count of its missing experts, then reads the counts once:

- none missing: the forward computed every row from its expert's slot, which is the per-layer
  schedules' graph (gather over the slot bank, exact: docs/design.md). The host work the layers
  skipped (the policy's record of uses, the counters, the routing record) is done from the ids,
  which are on the host by then at no wait;
- some missing: rows of those layers came from the wrong slot, and every layer after took a wrong
  input. The KV-cache entries the forward wrote are taken back (``mlx_compat.rewind``) and the call
  runs again with the per-layer schedules, which read what is missing. The output is stock's again.

``StepRunner`` chooses per model call: a verified step for decode-sized calls while the last such
call read nothing (a miss makes the next calls per-layer until one reads nothing again), where the
caches can be rewound, on one calling thread, and not across pipeline stages; the per-layer
schedules otherwise.
"""

import threading
from typing import List, Optional

import mlx.core as mx
import numpy as np

from . import mlx_compat

# calls of up to this many tokens (decode, a draft model's verification) may be verified steps;
# longer ones (prefill) read most experts and are never worth the try
VERIFY_MAX_TOKENS = 16


class VerifiedStep:
    """One forward in which every MoE layer maps ids to slots on the device (``switch.py``)."""

    def __init__(self):
        # (bank, the layer's ids (lazy), its count of missing experts (lazy)), in call order
        self.calls: List[tuple] = []

    def add(self, bank, indices: mx.array, missing: mx.array) -> None:
        self.calls.append((bank, indices, missing))

    def missing(self) -> Optional[mx.array]:
        """The missing experts of each call, one lazy array; None if no layer was verified."""
        if not self.calls:
            return None
        return mx.stack([m for _, _, m in self.calls])

    def commit(self, cache) -> None:
        """The host work of a step with nothing missing: each layer's uses told to its policy and
        counted as hits, the routing recorded, identity banks' fill asked for."""
        hits = 0
        for bank, indices, _ in self.calls:
            idx = np.array(indices, copy=False).astype(np.int64)
            experts = np.unique(idx)
            with bank.lock:
                bank.table.admit(experts)  # nothing missing: the policy's record of a use
                bank.hits += len(experts)
            hits += len(experts)
            if cache.recorder is not None:
                cache.recorder.record(bank, idx)
            if bank.identity and not bank.complete:
                cache.request_fill(bank)
        cache.stats.start()
        cache.stats.add(hits, 0, 0)


class StepRunner:
    """Runs each call of a streaming model as a verified step or with the per-layer schedules."""

    def __init__(self, state):  # loading.StreamingState
        self.state = state
        self._local = threading.local()
        # whether the last decode-sized call read nothing (verified steps are tried only then)
        self.trusted = True
        # calls run as verified steps, and those of them that found a miss and ran again
        self.verified = 0
        self.recomputed = 0

    def current(self) -> Optional[VerifiedStep]:
        """The verified step this thread is running, or None."""
        return getattr(self._local, "step", None)

    def __call__(self, call, args, kwargs):
        inputs, kv = mlx_compat.call_inputs(args, kwargs)
        tokens = _tokens(inputs)
        cache = self.state.cache
        decode = tokens is not None and tokens <= VERIFY_MAX_TOKENS
        if not decode:
            return call(*args, **kwargs)
        if not self._may_verify(tokens, kv):
            misses = cache.stats.misses
            out = call(*args, **kwargs)
            self.trusted = cache.stats.misses == misses
            return out
        return self._verified(call, args, kwargs, kv, tokens)

    def _may_verify(self, tokens: int, kv) -> bool:
        cache = self.state.cache
        return (
            self.trusted
            and cache.tuning.verified_steps
            and self.state.pipeline is None
            and not cache.shared
            and mlx_compat.rewindable(kv, tokens)
        )

    def _verified(self, call, args, kwargs, kv, tokens):
        cache = self.state.cache
        cache.note_caller()
        step = self._local.step = VerifiedStep()
        try:
            out = call(*args, **kwargs)
        finally:
            self._local.step = None
        missing = step.missing()
        if missing is None:  # no layer could be verified: it ran per layer
            return out
        tl = cache.timeline
        start = tl.now() if tl else 0
        mx.async_eval(out)
        counts = np.array(missing, copy=False)  # the one host sync of the step
        if tl:
            tl.span("verify", start, "sync", layers=len(step.calls))
        self.verified += 1
        if not counts.any():
            step.commit(cache)
            return out
        # rows of the first layer with a miss came from wrong slots: undo and run per layer
        self.recomputed += 1
        self.trusted = False
        mlx_compat.rewind(kv, tokens)
        start = tl.now() if tl else 0
        out = call(*args, **kwargs)
        if tl:
            tl.span("recompute", start, "compute", layers=len(step.calls))
        return out


def _tokens(inputs) -> Optional[int]:
    """Tokens per sequence of a model call's ``inputs`` (``(batch, tokens)``), or None."""
    shape = getattr(inputs, "shape", None)
    if not shape:
        return None
    return int(shape[-1]) if len(shape) >= 2 else int(shape[0])
