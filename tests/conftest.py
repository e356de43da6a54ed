"""Fixtures shared by the suite."""

import pytest

from mlx_lm_streaming.synthetic import build_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(arch, variant, **kwargs) -> Path``: built once per session and arguments."""
    built = {}

    def get(arch, variant="affine4", **kwargs):
        key = (arch, variant, tuple(sorted(kwargs.items())))
        if key not in built:
            name = "-".join([arch, variant] + [f"{k}{v}" for k, v in sorted(kwargs.items())])
            built[key] = build_checkpoint(
                tmp_path_factory.mktemp("ckpt") / name, arch, variant, **kwargs
            )
        return built[key]

    return get
