"""Ships the startup hook: hooks/*.pth and hooks/*.start go to the root of the wheel (site-packages).

Everything else is in pyproject.toml.
"""

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HOOKS = Path(__file__).resolve().parent / "hooks"
HOOK_FILES = ("mlx_lm_streaming.pth", "mlx_lm_streaming.start")


class build_py_with_hooks(build_py):
    """``build_py`` that also copies the startup hook files into the build root."""

    def run(self):
        super().run()
        for name in HOOK_FILES:
            src = HOOKS / name
            if not src.is_file():
                raise FileNotFoundError(
                    f"{src}: startup hook file missing; a wheel without it would not patch "
                    "mlx-lm (restore hooks/ from the repository)"
                )
            self.copy_file(str(src), os.path.join(self.build_lib, name))

    def get_outputs(self, include_bytecode=True):
        hooks = [os.path.join(self.build_lib, name) for name in HOOK_FILES]
        return super().get_outputs(include_bytecode) + hooks


setup(cmdclass={"build_py": build_py_with_hooks})
