"""Old import paths that plugin authors may use (their stores and kernels take these modules' types)
still import after runtime/ went in rooms (issue 50): each is the moved module itself, so a type
checked or a function patched through it is the runtime's own."""

import importlib

import pytest

OLD_PATHS = {
    "mlx_lm_streaming.runtime.index": "mlx_lm_streaming.runtime.reads.index",
    "mlx_lm_streaming.runtime.safetensors_header": "mlx_lm_streaming.runtime.reads.safetensors_header",
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_is_the_moved_module(old):
    moved = importlib.import_module(OLD_PATHS[old])
    assert importlib.import_module(old) is moved
    package, name = old.rsplit(".", 1)
    assert getattr(importlib.import_module(package), name) is moved  # from ...runtime import name
