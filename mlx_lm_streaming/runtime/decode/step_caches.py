"""``StepCaches``: a verified step's cache entries as they were before it, and who wrote them.

A verified step that misses runs its decoder layers again from the first one that missed
(verified_step.py). Before that, each of those layers' cache entries must be as it was before the
step: a KV entry's tokens of this step taken back (``trim``), a recurrent or linear-attention
state (hybrids' ``ArraysCache``) given back its arrays. MLX arrays are values and a model's step
replaces a state's arrays rather than writing into them, so the references kept before the step
are that state (``mlx_shims.mark``; ``rewindable`` says where that holds).

Layers run again only where each decoder layer got a cache entry of its own or none (nemotron_h's
MoE and MLP layers have none), and nothing but the layers wrote one: else the call runs again whole.

Imports: ``mlx_shims`` only.
"""

from typing import Dict

from .. import mlx_shims


class StepCaches:
    """The cache entries of one model call (``kv``: the model's list of entries, or None)."""

    def __init__(self, kv):
        self.kv = kv
        # id(entry) -> what puts it back as it was before the step (``mlx_shims.marks``)
        self.marks = mlx_shims.marks(kv)
        # decoder layer -> its entry (None: it has none), as its call got it; id(entry) -> layer
        # (filled by ``VerifiedStep.layer_call`` as each layer is called)
        self.entries: Dict[int, object] = {}
        self.owners: Dict[int, int] = {}

    def rewind(self, first: int, end: int) -> None:
        """The entries of decoder layers ``first`` to ``end - 1`` back as they were before the
        step (no cache: nothing to put back)."""
        if self.kv is None:
            mlx_shims.rewind(None, self.marks)
            return
        mlx_shims.rewind([self.entries.get(i) for i in range(first, end)], self.marks)

    def rewind_all(self) -> None:
        """Every entry back as it was before the step (those the step did not write are)."""
        mlx_shims.rewind(list(self.kv) if self.kv is not None else None, self.marks)

    def unclaimed_changed(self) -> bool:
        """Whether the step wrote an entry that no decoder layer got: something other than the
        layers writes it, so running layers again would not put it right."""
        if self.kv is None:
            return False
        return any(
            id(c) not in self.owners and mlx_shims.changed(c, self.marks[id(c)]) for c in self.kv
        )
