"""The slot banks: one MoE layer's expert arrays, made ``slots`` experts deep, and the writes of
expert bytes into them. A unit: other modules use ``LayerBank``'s public methods and attributes,
never its modules' insides.

Each MoE layer owns a ``LayerBank`` (layer_bank.py): for every tensor of an expert
(``gate_proj.weight``, ``gate_proj.scales``, ...) one array of shape ``(slots, *expert_shape)``.
The stock mlx-lm ``SwitchGLU`` of the layer keeps its own code, activation and quantization
settings; only its arrays are swapped for the banks. The router's expert ids become slot ids
(``slot_of[expert]``, from the bank's ``policy.SlotTable``) passed to ``gather_qmm`` as data, so
nothing is stacked or rebuilt per token.

``LayerBank.reads`` starts making a call's experts resident: it never evicts an expert the call
pins (the experts it is about to compute), issues the reads of the others into their slots, and
returns their landings, which the caller takes as they land (reads/bank_reads.py: ``landings``, a generator,
as ``concurrent.futures.as_completed``); ``load`` does the same and waits; ``load_together`` runs several banks' loads at once (a verified
step's misses). A bank with a slot per
expert (``slots == num_experts``) maps expert ``e`` to slot ``e`` (identity): once every expert of
the layer is resident the bank is ``complete``, and the layer passes the router's indices straight
to the kernel with no host sync, the same graph as stock. ``stage`` starts background reads
(lookahead, next wave, fill) into staging buffers (reads/prefetch.py); only a load writes them into the
bank, on the thread that calls the layer.

Demand reads go straight into the banks (direct reads) through host views of the bank's memory
(reads/host_views.py). Writing bank memory behind MLX's back is safe only when no pending MLX work reads
the slot being written: the victims are never slots the call uses, and every call that used the
bank was submitted (``mx.async_eval``) on the same stream before this call's host sync, which waits
for it (a call on another stream first synchronizes that one). Where that cannot be known (a second
thread uses the model) or MLX memory has no host view, reads go through staging buffers and MLX's
own copy-on-write slice updates.

A long prompt's prefill holds every expert of one layer at once in a ``LayerSets`` (layer_set.py):
two sets of arrays ``(num_experts, *expert_shape)`` taking turns, each chunk's MoE call stock's
own over them, the next layer's set read while one computes, the slot bank given the most used
experts from the set after its layer.

The room also holds a layer's slot bank: ``layer_bank`` (the slots, their table and a layer call's loads),
``layer_set`` (a layer's every expert for a long prompt), ``waves`` (a call's rows computed as
their experts land), ``cuda_copy`` (copies into device slots on mlx-cuda), ``device_copy``
(a prompt's call over a device copy of a bank in host memory: two tiers) and ``compiled_glu`` (a
decode-sized call's graph built once, ``mx.compile``).

May import: runtime, reads
"""

from .layer_bank import LayerBank, load_together, note_hits
from .layer_set import LayerSets

__all__ = ["LayerBank", "LayerSets", "load_together", "note_hits"]
