"""Registers the built-in stores. Loaded through the ``mlx_lm_streaming`` entry-point group."""

from ..hookspecs import hookimpl
from .memory import MemoryStore
from .packed import PackedStore
from .safetensors import SafetensorsStore


@hookimpl(tryfirst=True)
def register_stores(register):
    register(SafetensorsStore.name, SafetensorsStore)
    register(MemoryStore.name, MemoryStore)
    register(PackedStore.name, PackedStore)
