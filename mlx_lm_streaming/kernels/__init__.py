"""Expert kernels and the selector that chooses among them."""

from .base import ExpertKernel, backend

__all__ = ["ExpertKernel", "backend"]
