"""The mode of one model call: what each of its MoE layer calls does, chosen once for the call.

A ``StreamingSwitchGLU`` call is ``cache.mode.moe_call(layer, x, indices)``: the mode is an
attribute of the model's ``ExpertCache``, put there for the length of one model call by whoever
chose it (``ExpertCache.running``), and ``PER_LAYER`` between calls. The modes:

- ``PER_LAYER`` (``PerLayer``): each MoE layer call on its own, its schedule picked by
  ``schedules.choose`` (one host sync and the layer's reads; stock's graph for a complete bank).
  Prefill, cold caches, a second calling thread;
- ``COMPLETE`` (``Complete``): every bank complete (``ExpertCache.all_complete``): each layer
  straight to stock's ``SwitchGLU`` over its bank (``LayerBank.stock_call``), nothing of ours
  between;
- a verified step (``verified_step.VerifiedStep``): the router's ids mapped to slot ids on the
  device, no host sync per layer, every layer's misses counted once after the forward; its
  decoder layers' calls recorded (``wraps``) so a miss can run them again;
- layer-major prefill: one chunk's forward with its decoder layers skipped
  (``layer_major.Recorder``), then one decoder layer over a group of chunks
  (``layer_pass.LayerPass``), its MoE calls recorded, then answered with rows computed
  expert-major.

``StepRunner.__call__`` (verified_step.py) chooses among the first three once per decode call;
``layer_major.prefill`` installs the last two. A mode that keeps state for its call has an
``owner``, the thread of that call: another thread's layer calls meanwhile run ``PER_LAYER``
(its model call could not install a mode of its own: ``running`` installs one only over
``PER_LAYER``), so no call ever joins another's state, without a thread-local.
"""

from threading import get_ident

from ..bank import device_copy
from . import schedules


class Mode:
    """A model call's way through its MoE layers (module docstring). ``owner``: the thread whose
    call it is (None: any thread's call may take it); ``wraps``: whether its decoder layers'
    calls go to ``layer_call(i, call, args, kwargs)`` (``mlx_shims.wrap_layer``)."""

    owner = None
    wraps = False

    def moe_call(self, layer, x, indices):
        """Layer ``layer``'s (a ``StreamingSwitchGLU``) output for ``x`` and the router's
        ``indices``: one schedule, chosen for this call by its bank's state and size."""
        bank = layer.bank
        complete = bank.stock_call  # a complete bank: stock's graph, nothing to choose
        if complete is not None:
            return complete(x, indices)
        cache = bank.cache
        # (``enter_call``'s checks inline: once a thread has entered a planned cache, nothing is
        # left to do)
        if not cache.planned or get_ident() not in cache.callers:
            cache.enter_call()  # before the choice: a second calling thread turns direct reads off
        if cache.tiers is not None:  # two tiers: a prompt's call completes its bank first
            device_copy.complete(bank, indices)
        return schedules.choose(layer, x, indices).run()

    def layer_call(self, i: int, call, args, kwargs):
        return call(*args, **kwargs)


class PerLayer(Mode):
    """Each MoE layer call on its own (``Mode.moe_call``): stateless, any thread's."""


class Complete(Mode):
    """Every bank complete: each layer straight to stock's ``SwitchGLU`` over its bank, once
    ``schedules.choose`` has given the bank its ``stock_call`` (its first call); stateless."""

    def moe_call(self, layer, x, indices):
        complete = layer.bank.stock_call
        if complete is not None:
            return complete(x, indices)
        return Mode.moe_call(self, layer, x, indices)


PER_LAYER = PerLayer()
COMPLETE = Complete()
