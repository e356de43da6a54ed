"""Hook specifications. Plugins implement these with ``@hookimpl``; each receives a ``register`` callback.

Every hook was added in 0.1.0.
"""

from typing import Callable

import pluggy

hookspec = pluggy.HookspecMarker("mlx_lm_streaming")
hookimpl = pluggy.HookimplMarker("mlx_lm_streaming")


@hookspec
def register_architectures(register: Callable) -> None:
    """Register architecture adapters: ``register(ArchitectureAdapter(...))``."""


@hookspec
def register_stores(register: Callable) -> None:
    """Register store backends: ``register(name, factory)``, factory(files, **options) -> ExpertStore."""


@hookspec
def register_kernels(register: Callable) -> None:
    """Register expert kernels: ``register(kernel)``, an ``ExpertKernel`` instance."""
