"""Startup hook: patch mlx-lm when, and only when, it is imported.

``mlx_lm_streaming.pth`` (and, for Python >= 3.15, ``mlx_lm_streaming.start``, PEP 829) in
site-packages call ``install()`` at interpreter start. It puts ``MlxLmFinder`` first on
``sys.meta_path``; nothing else happens until a module in ``PATCHED`` is imported. The finder lets the
other finders find the real module, runs it through its own loader, and once it has executed, hands it
to ``mlx_lm_streaming.integration.integration.patch_module``, which asks ``mlx_compat`` about the mlx-lm
version and the shape of what it patches before it patches anything.

This module is stdlib only and imports nothing beyond ``sys``, ``os`` and our ``option_table`` (the
flags and variables it knows) at start-up. Whatever goes wrong in the patching, the module stays the
stock one and one line is written to stderr. ``MLX_LM_STREAMING_HOOK=0`` turns the hook off.
"""

import os
import sys

from .option_table import CLI_MODULES, ENABLED, FLAGS, HOOK_ENV, OFF_WORDS, ON_WORDS

# mlx-lm modules whose import triggers a patch (see integration.patch_module)
PATCHED = frozenset(("mlx_lm.utils",) + CLI_MODULES)
STREAMING_FLAGS = FLAGS
EXPERTS_ENV = ENABLED.env

_warned = False
_said = False


def _is_off(value: str) -> bool:
    return value.strip().lower() in OFF_WORDS


def hook_problem(environ=os.environ):
    """Why the value of ``MLX_LM_STREAMING_HOOK`` is not one it takes (the hook then stays on)."""
    value = environ.get(HOOK_ENV)
    if value is None or value.strip().lower() in ("",) + ON_WORDS + OFF_WORDS:
        return None
    return (
        f"{HOOK_ENV}={value!r} is neither on ({', '.join(ON_WORDS)}) nor off "
        f"({', '.join(OFF_WORDS)}); the startup hook stays on"
    )


def _run_module(orig_argv) -> str:
    """The module of ``python -m MODULE ...``, or ``""``."""
    args = list(orig_argv[1:])
    for i, arg in enumerate(args):
        if arg == "-m":
            return args[i + 1] if i + 1 < len(args) else ""
        if arg.startswith("-m"):
            return arg[2:]
        if not arg.startswith("-"):
            return ""
    return ""


def startup_problem(environ=os.environ, argv=None, orig_argv=None):
    """Why streaming, asked for by the environment or a flag, cannot happen in this process."""
    argv = getattr(sys, "argv", []) if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    flags = [a.split("=")[0] for a in argv[1:] if a.split("=")[0] in STREAMING_FLAGS]
    bad_hook = hook_problem(environ)
    if bad_hook:
        return bad_hook
    if _is_off(environ.get(HOOK_ENV, "1")):
        asked = environ.get(EXPERTS_ENV, "")
        if asked and not _is_off(asked):
            return (
                f"{EXPERTS_ENV}={asked} asks for streaming experts, but {HOOK_ENV}=0 turned the "
                "startup hook off: mlx-lm will load every expert into memory; unset "
                f"{HOOK_ENV} (or call mlx_lm_streaming.integration.install() before loading)"
            )
        if flags:
            return (
                f"{flags[0]} needs the startup hook, which {HOOK_ENV}=0 turned off, so mlx-lm "
                f"does not know the flag; unset {HOOK_ENV}"
            )
        return None
    module = _run_module(orig_argv)
    if module in CLI_MODULES and flags:
        command = module.split(".", 1)[1]
        return (
            f"`python -m {module}` (deprecated by mlx-lm) runs its file without our patch, so it "
            f"does not take {flags[0]}: use `{module}` or `python -m mlx_lm {command}` instead, "
            f"or {EXPERTS_ENV}=1"
        )
    return None


def say_startup_problem() -> None:
    """Write ``startup_problem()`` to stderr, once per process."""
    global _said
    if _said:
        return
    _said = True
    problem = startup_problem()
    if problem:
        sys.stderr.write(f"mlx-lm-streaming: {problem}\n")


def warn(exc: BaseException) -> None:
    """Say once, in one line, that mlx-lm runs stock because patching failed."""
    global _warned
    if _warned:
        return
    _warned = True
    try:
        sys.stderr.write(
            f"mlx-lm-streaming: not active, mlx-lm runs stock "
            f"({type(exc).__name__}: {exc}); set {HOOK_ENV}=0 to silence\n"
        )
    except Exception:
        pass


def apply(module) -> None:
    """Patch a freshly imported mlx-lm module; on any error leave it stock."""
    try:
        from mlx_lm_streaming.integration.integration import patch_module

        patch_module(module)
    except Exception as e:
        warn(e)


class PatchingLoader:
    """Runs the real loader, then ``apply``. The module keeps the real loader as its own."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        spec = module.__spec__
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        self.loader.exec_module(module)
        apply(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class MlxLmFinder:
    """A ``sys.meta_path`` finder that only ever answers for the names in ``PATCHED``."""

    # marks our finder even across copies of this module (reloads, shadowing installs)
    mlx_lm_streaming = True

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in PATCHED:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "mlx_lm_streaming", None) is True:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = PatchingLoader(spec.loader)
        return spec

    def invalidate_caches(self):
        pass


def install() -> None:
    """Put the finder first on ``sys.meta_path`` once; patch what is already imported."""
    try:
        say_startup_problem()
        if _is_off(os.environ.get(HOOK_ENV, "1")):
            return
        if any(getattr(f, "mlx_lm_streaming", None) is True for f in sys.meta_path):
            return
        sys.meta_path.insert(0, MlxLmFinder())
        # imported before us (the hook installed late, by hand): patch them now, parents first
        for name in sorted(n for n in PATCHED if n in sys.modules):
            apply(sys.modules[name])
    except Exception as e:
        warn(e)
