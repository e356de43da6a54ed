"""Shared test helpers: load a checkpoint stock or streaming, with the environment held out."""

import os
from contextlib import contextmanager

import mlx.core as mx
import mlx_lm.utils

from mlx_lm_streaming.integration import install
from mlx_lm_streaming.options import ENV


@contextmanager
def clean_env():
    """No MLX_LM_STREAMING_* variable from the caller's shell leaks into a test."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k in ENV.values()}
    try:
        yield
    finally:
        os.environ.update(saved)


def load_stock(path):
    install()
    with clean_env():
        model, config = mlx_lm.utils.load_model(path)
    assert not hasattr(model, "expert_streaming")
    return model, config


def load_streaming(path, **options):
    install()
    with clean_env():
        return mlx_lm.utils.load_model(path, model_config={"streaming_experts": options})


def assert_exact(stock_out, stream_out, what):
    """Every step's logits are finite and bit-identical. NaN or inf on both sides is a failure, not
    a match: a model that computes NaN proves nothing about parity."""
    for step, (a, b) in enumerate(zip(stock_out, stream_out, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape
        for side, x in (("stock", a), ("streaming", b)):
            bad = x.size - mx.isfinite(x).sum().item()
            assert bad == 0, f"{what}: {bad} non-finite logits in {side} at step {step}"
        diff = mx.abs(a - b).max().item()
        assert mx.array_equal(a, b).item(), f"{what}: logits differ at step {step} (max {diff})"
