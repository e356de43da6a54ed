"""Plugin registry: one pluggy ``PluginManager`` for architectures, stores and kernels.

Plugins are found through the ``mlx_lm_streaming`` entry-point group; our own built-ins are registered
through that same group (see pyproject.toml). From a source checkout that was never installed the group is
empty, so the built-in modules are registered by name instead.

``MLX_LM_STREAMING_BLOCK_PLUGINS`` blocks external plugins: ``1`` or ``all`` blocks every plugin that is
not built in; a comma-separated list blocks those entry-point names only.
"""

import importlib
import os
import threading
from typing import Dict

import pluggy

from . import hookspecs
from .errors import ConfigurationError
from .option_table import BLOCK_PLUGINS_ENV

GROUP = "mlx_lm_streaming"
BUILTIN_PLUGINS = {
    "architectures": "mlx_lm_streaming.architectures.builtin",
    "stores": "mlx_lm_streaming.stores.builtin",
    "kernels": "mlx_lm_streaming.kernels.builtin",
}
BLOCK_ENV = BLOCK_PLUGINS_ENV

pm = pluggy.PluginManager(GROUP)
pm.add_hookspecs(hookspecs)

_loaded = False
_lock = threading.Lock()


def _blocked_names():
    from importlib.metadata import entry_points

    value = os.environ.get(BLOCK_ENV, "").strip()
    if not value:
        return set()
    if value.lower() in ("1", "all", "true", "yes"):
        return {
            ep.name for ep in entry_points(group=GROUP) if ep.value not in BUILTIN_PLUGINS.values()
        }
    return {name.strip() for name in value.split(",") if name.strip()} - set(BUILTIN_PLUGINS)


def load_plugins() -> pluggy.PluginManager:
    """Register built-ins and entry-point plugins once; later calls return the same manager."""
    global _loaded
    with _lock:
        if _loaded:
            return pm
        for name in _blocked_names():
            pm.set_blocked(name)
        pm.load_setuptools_entrypoints(GROUP)
        for name, module in BUILTIN_PLUGINS.items():
            if pm.get_plugin(name) is None and not pm.is_blocked(name):
                pm.register(importlib.import_module(module), name=name)
        pm.check_pending()
        _loaded = True
        return pm


def _collect(hook_name: str, key):
    found: Dict[str, object] = {}

    def register(*args):
        item = args[-1]
        found[key(*args)] = item

    getattr(load_plugins().hook, hook_name)(register=register)
    return found


def architectures():
    """model_type -> ArchitectureAdapter, from every registered plugin."""
    found = {}

    def register(adapter):
        for model_type in adapter.model_types:
            found[model_type] = adapter

    load_plugins().hook.register_architectures(register=register)
    return found


def stores():
    """store name -> factory."""
    return _collect("register_stores", lambda name, factory: name)


def kernels():
    """kernel name -> ExpertKernel."""
    return _collect("register_kernels", lambda kernel: kernel.name)


def blocked_plugins():
    """Entry-point plugins installed here that ``MLX_LM_STREAMING_BLOCK_PLUGINS`` blocks."""
    from importlib.metadata import entry_points

    blocked = _blocked_names()
    return sorted({ep.name for ep in entry_points(group=GROUP)} & blocked)


def unknown_name(what: str, name: str, registered, where: str) -> str:
    """Why ``name`` is not a registered ``what``: blocked plugins are named as such."""
    listed = ", ".join(sorted(registered))
    blocked = blocked_plugins()
    if blocked:
        return (
            f"{what} {name!r} ({where}) is not available: the plugin(s) {', '.join(blocked)} "
            f"are blocked by {BLOCK_ENV}={os.environ.get(BLOCK_ENV, '')!r} (unset it to use "
            f"them); registered: {listed}"
        )
    return f"unknown {what} {name!r} ({where}); registered: {listed}"


def _store_factory(name: str):
    available = stores()
    if name not in available:
        raise ConfigurationError(
            unknown_name(
                "expert store",
                name,
                available,
                "--expert-store / MLX_LM_STREAMING_STORE / store=",
            )
        )
    return available[name]


def store_option_names(factory) -> set:
    """The options a store takes: its ``known_options`` where it declares them, else the keyword
    parameters of the factory after ``files`` (a ``**options`` catch-all names none)."""
    declared = getattr(factory, "known_options", None)
    if declared is not None:
        return set(declared)
    import inspect

    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters[1:] if p.kind in kinds}


def check_store_options(name: str, options: dict) -> None:
    """``ConfigurationError`` naming the first option the store ``name`` does not take, or the
    first value its ``option_checks`` refuse (``threads=abc``, ``threads=0``)."""
    factory = _store_factory(name)
    known = store_option_names(factory)
    unknown = sorted(set(options) - known)
    if unknown:
        listed = ", ".join(sorted(known)) or "none"
        raise ConfigurationError(
            f"store_options: the {name} store has no option {unknown[0]!r} (misspelt?); its "
            f"options: {listed}"
        )
    checks = getattr(factory, "option_checks", None) or {}
    for key in sorted(options):
        if key in checks:
            try:
                checks[key](options[key])
            except ConfigurationError as e:
                raise ConfigurationError(f"store option {e} ({name} store)") from None


def make_store(name: str, files, **options):
    check_store_options(name, options)
    return _store_factory(name)(files, **options)
