"""The verified step: a forward runs with no host sync per MoE layer, its experts checked once.

mlx-lm's own ``SwitchGLU`` never waits for the host: the router's ids index the experts on the
device. The per-layer schedule (``switch.py``) reads the ids back in every MoE layer, to make the
experts resident before the layer computes; on a GPU that wait, once per layer, costs more than the
layer itself. Nothing needs it while the experts a forward picks are resident already. A verified
step runs the forward with each MoE layer's ids turned into slot ids on the device
(``LayerBank.device_map``) and a count of its missing experts, then reads the counts once:

- none missing: every row came from its expert's slot: the per-layer schedule's graph (gather over
  the slot bank, exact: docs/design.md), so stock's bits. The host work the layers skipped (the
  policy's record of uses, the counters, the routing record) is done from the ids, which are on the
  host by then at no wait;
- some missing: the first MoE layer with a miss computed rows from the wrong slot, and every layer
  after it took a wrong input; the layers before it are right. Its ids are right (its input is), so
  its missing experts are read, the KV-cache entries written from that decoder layer on are taken
  back (``mlx_compat.rewind``), and the forward runs again, each decoder layer before that one
  giving back its recorded output (``layer_call``) instead of computing. Repeated until nothing is
  missing: one host sync per token plus one per layer that missed, instead of one per layer.

Where layers cannot be replayed (``model.layers`` not one decoder layer per cache entry), a miss
rewinds every cache entry and runs the whole call per layer instead. ``StepRunner`` chooses per
model call: verified steps for calls of up to ``VERIFY_MAX_TOKENS`` tokens, over caches that can be
rewound, on one calling thread, outside pipeline stages, while recent tokens missed in few layers
(``MAX_MISSED_SHARE``); the per-layer schedule otherwise (prefill, cold caches).
"""

import threading
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from . import mlx_compat

# calls of up to this many tokens (decode, a draft model's verification of its 3 default drafts) may
# be verified steps; longer ones (prefill) read most experts and take the per-layer schedule
VERIFY_MAX_TOKENS = 4
# verified steps while recent tokens missed in at most this share of the MoE layers: each layer
# that misses costs a host sync and the forward's rest again, so with misses in most layers the
# per-layer schedule (one sync per layer, nothing computed twice) is cheaper
MAX_MISSED_SHARE = 0.25
# weight of the newest token in the running mean of layers that missed
MISSED_WEIGHT = 0.25


class VerifiedStep:
    """One model call run as a verified step: its MoE layers' calls and decoder layers' outputs."""

    def __init__(self, kv, tokens: int, layers: int):
        self.kv = kv
        self.tokens = tokens
        self.layers = layers  # decoder layers that ``layer_call`` saw in the model, or 0
        # the decoder layer running now (``layer_call``), and each one's output in this step
        self.layer: Optional[int] = None
        self.outputs: Dict[int, object] = {}
        # decoder layers below this give back their recorded output (a forward run again)
        self.replay_below = 0
        # whether every decoder layer got its own cache entry, in order: replay is exact then
        self.replayable = kv is None or len(kv) == layers
        # MoE calls of the forward being run: (decoder layer, bank, ids, missing count), lazy
        self.calls: List[tuple] = []
        # id(bank) -> (bank, ids) of the call kept for each MoE layer; banks whose experts a load
        # in this step made resident (counted there)
        self.kept: Dict[int, tuple] = {}
        self.loaded: set = set()

    def add(self, bank, indices: mx.array, missing: mx.array) -> None:
        self.calls.append((self.layer, bank, indices, missing))
        self.kept[id(bank)] = (bank, indices)

    def layer_call(self, i: int, call, args, kwargs):
        """Decoder layer ``i`` of the model (``mlx_compat.wrap_call``)."""
        if i < self.replay_below:
            return self.outputs[i]
        cache = args[2] if len(args) > 2 else kwargs.get("cache")
        if self.kv is not None and (i >= len(self.kv) or cache is not self.kv[i]):
            self.replayable = False
        self.layer = i
        out = call(*args, **kwargs)
        self.outputs[i] = out
        return out

    def first_miss(self) -> Optional[int]:
        """The index in ``calls`` of the first MoE call with a missing expert, or None: the one
        host sync of a forward."""
        if not self.calls:
            return None
        counts = np.array(mx.stack([m for *_, m in self.calls]), copy=False)
        hit = np.nonzero(counts)[0]
        return int(hit[0]) if len(hit) else None

    def commit(self, cache) -> None:
        """The host work of a step found complete: each kept MoE call's uses told to its policy and
        counted as hits (unless a load in this step counted them), the routing recorded, identity
        banks' fill asked for."""
        hits = 0
        for key, (bank, indices) in self.kept.items():
            idx = np.array(indices, copy=False).astype(np.int64)
            if key not in self.loaded:
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
    """Runs each call of a streaming model as a verified step or with the per-layer schedule."""

    def __init__(self, state):  # loading.StreamingState
        self.state = state
        self._local = threading.local()
        self.layers = 0  # decoder layers wrapped (``wrap_layers``)
        # running mean of the share of MoE layers that missed, per decode-sized call
        self.missed_share = 0.0
        # calls run as verified steps; forwards run again after a miss (replays); calls that ran
        # again whole and per layer
        self.verified = 0
        self.replays = 0
        self.recomputed = 0

    def current(self) -> Optional[VerifiedStep]:
        """The verified step this thread is running, or None."""
        return getattr(self._local, "step", None)

    def wrap_layers(self, model) -> None:
        """Route the model's decoder layers (``model.layers``) through ``layer_call``."""
        layers = getattr(model, "layers", None)
        if not isinstance(layers, list):
            return
        for i, layer in enumerate(layers):
            mlx_compat.wrap_call(layer, self._layer_around(i))
        self.layers = len(layers)

    def _layer_around(self, i: int):
        def around(call, args, kwargs):
            step = self.current()
            if step is None:
                return call(*args, **kwargs)
            return step.layer_call(i, call, args, kwargs)

        return around

    def __call__(self, call, args, kwargs):
        inputs, kv = mlx_compat.call_inputs(args, kwargs)
        tokens = _tokens(inputs)
        if tokens is None or tokens > VERIFY_MAX_TOKENS:
            return call(*args, **kwargs)
        if not self._may_verify(tokens, kv):
            banks = self.state.cache.banks
            before = [b.misses for b in banks]
            out = call(*args, **kwargs)
            missed = sum(b.misses > m for b, m in zip(banks, before))
            self._missed(missed / max(1, len(banks)))
            return out
        return self._verified(call, args, kwargs, kv, tokens)

    def _missed(self, share: float) -> None:
        self.missed_share += MISSED_WEIGHT * (share - self.missed_share)

    def _may_verify(self, tokens: int, kv) -> bool:
        cache = self.state.cache
        return (
            self.missed_share <= MAX_MISSED_SHARE
            and cache.tuning.verified_steps
            and self.state.pipeline is None
            and not cache.shared
            and mlx_compat.rewindable(kv, tokens)
        )

    def _verified(self, call, args, kwargs, kv, tokens):
        cache = self.state.cache
        cache.note_caller()
        tl = cache.timeline
        step = self._local.step = VerifiedStep(kv, tokens, self.layers)
        missed = 0
        try:
            out = call(*args, **kwargs)
            if not step.calls:  # no layer could be verified: it ran per layer
                return out
            self.verified += 1
            while True:
                start = tl.now() if tl else 0
                mx.async_eval(out)
                first = step.first_miss()
                if tl:
                    tl.span("verify", start, "sync", calls=len(step.calls))
                if first is None:
                    break
                missed += 1
                layer, bank, indices, _ = step.calls[first]
                experts = np.unique(np.array(indices, copy=False).astype(np.int64))
                if not step.replayable or layer is None or len(experts) > bank.slots:
                    self._local.step = None
                    return self._again(call, args, kwargs, kv, tokens)
                mx.eval(out)  # no pending work reads a slot the load may write
                start = tl.now() if tl else 0
                bank.load(experts)  # reads what is missing; counts the call's hits and misses
                step.loaded.add(id(bank))
                if tl:
                    tl.span("verify load", start, "read", layer=bank.path, experts=len(experts))
                mlx_compat.rewind(kv[layer:] if kv is not None else None, tokens)
                step.replay_below = layer
                step.calls = []
                self.replays += 1
                out = call(*args, **kwargs)
            step.commit(cache)
            return out
        finally:
            self._local.step = None
            self._missed(missed / max(1, len(cache.banks)))

    def _again(self, call, args, kwargs, kv, tokens):
        """A miss where the step cannot be replayed from the layer that missed: every cache entry
        rewound, the call run again per layer."""
        self.recomputed += 1
        mlx_compat.rewind(kv, tokens)
        return call(*args, **kwargs)


def _tokens(inputs) -> Optional[int]:
    """Tokens per sequence of a model call's ``inputs`` (``(batch, tokens)``), or None."""
    shape = getattr(inputs, "shape", None)
    if not shape:
        return None
    return int(shape[-1]) if len(shape) >= 2 else int(shape[0])
