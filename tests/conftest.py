"""Fixtures shared by the suite."""

import os
import sys

import mlx.core as mx
import pytest
from support import (
    KernelPlugin,
    decode,
    generate_cmd,
    generated_text,
    hook_installed,
    load_stock,
    registered,
    run,
)

from mlx_lm_streaming.kernels.gather import GatherKernel
from mlx_lm_streaming.runtime.memory import free_memory, report
from mlx_lm_streaming.runtime.options import ENV
from synthetic import build_checkpoint


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


@pytest.fixture(scope="module")
def require_hook():
    if not hook_installed():
        pytest.fail(
            f"{sys.executable}: mlx_lm_streaming.pth is not in site-packages; these tests need "
            "the package installed non-editable (bash tests/run.sh)"
        )


@pytest.fixture(scope="module")
def stock_text(checkpoint, tmp_path_factory):
    """``mlx_lm.generate`` output without any flag, once per architecture."""
    cwd = tmp_path_factory.mktemp("stock")
    texts = {}

    def get(arch):
        if arch not in texts:
            out = run(generate_cmd(checkpoint(arch)), cwd)
            texts[arch] = generated_text(out.stdout)
            assert "[streaming]" not in out.stderr
        return texts[arch]

    return get


@pytest.fixture(autouse=True)
def stats_lines_stay_in_their_test(monkeypatch):
    """A model loaded in this process with ``stats=True`` prints its stats line when the process
    exits, as it should for a user; in the suite that is after pytest's summary (issue 37, item
    14). Each test gets its own list of models to report at exit, dropped when it ends."""
    monkeypatch.setattr(report, "_REPORTING", [])


@pytest.fixture(autouse=True)
def free_memory_unknown(monkeypatch):
    """In the suite a cache's budget does not follow this machine's real free memory (other
    processes move it): its readers answer nothing, so a budget stays where it is. Tests of the
    moving budget give their own readings (``ExpertCache.memory_reader``)."""
    monkeypatch.setattr(free_memory, "read_host", lambda: None)
    monkeypatch.setattr(free_memory, "read_device", lambda: None)


@pytest.fixture
def environ():
    """Our variables removed for the test, and the environment restored after it."""
    saved = dict(os.environ)
    for name in ENV.values():
        os.environ.pop(name, None)
    try:
        yield os.environ
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def q3_path(tmp_path_factory):
    """3 MoE layers (qwen3_moe) of 16 experts each: small enough for many loads."""
    return build_checkpoint(
        tmp_path_factory.mktemp("q3") / "q3",
        "qwen3_moe",
        "affine4",
        num_layers=3,
        overrides={"experts": 16},
    )


@pytest.fixture(scope="module")
def q3(q3_path):
    """``q3_path``, two prompts, and stock's logits for them (``support.decode``)."""
    stock, _ = load_stock(q3_path)
    tokens = mx.array(
        [[(5 * i + 3) % 512 for i in range(12)], [(11 * i + 7) % 512 for i in range(12)]]
    )
    return q3_path, tokens, decode(stock, tokens)


class PaddedGather(GatherKernel):
    """The gather kernel as a kernel whose per-row bits depend on the row count everywhere (as
    gather_qmm's do on CUDA: no ``subset_exact_on``), counting the rows of each call."""

    name = "padded_gather"
    subset_exact_on = ()

    def __init__(self):
        self.counts = []

    def __call__(self, x, slots, slots_np, bank):
        self.counts.append(slots.size)
        return super().__call__(x, slots, slots_np, bank)


@pytest.fixture
def padded_gather():
    """``PaddedGather``, registered through the kernel plugin hook for the test."""
    with registered(KernelPlugin(PaddedGather()), "padded-gather-test") as plugin:
        yield plugin.kernel
