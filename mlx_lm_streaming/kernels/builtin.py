"""Registers the built-in kernels. Loaded through the ``mlx_lm_streaming`` entry-point group."""

from ..hookspecs import hookimpl
from .gather import GatherKernel
from .per_expert import PerExpertKernel


@hookimpl(tryfirst=True)
def register_kernels(register):
    register(GatherKernel())
    register(PerExpertKernel())
