"""Expert kernels and the selector that chooses among them."""

from ..runtime.devices import backend
from .base import ExpertKernel

__all__ = ["ExpertKernel", "backend"]
