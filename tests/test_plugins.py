"""The plugin registry: built-ins through the entry-point group, third-party plugins, blocking."""

import gc
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from support import load_stock, load_streaming, registered

from mlx_lm_streaming import plugins
from mlx_lm_streaming.hookspecs import hookimpl
from mlx_lm_streaming.kernels.base import ExpertKernel
from mlx_lm_streaming.kernels.gather import GatherKernel
from mlx_lm_streaming.kernels.selector import MEMO_ROWS, KernelSelector
from mlx_lm_streaming.stores.memory import MemoryStore


class CountingKernel(GatherKernel):
    """The gather kernel, counting calls: proves the selector picked it up from the plugin."""

    name = "counting"

    def __init__(self):
        self.calls = 0
        self.banks = set()

    def priority(self, backend, bank, rows):
        return 100.0

    def __call__(self, x, slots, slots_np, bank):
        self.calls += 1
        self.banks.add(bank.path)
        return super().__call__(x, slots, slots_np, bank)


class UnavailableKernel(ExpertKernel):
    name = "unavailable"
    exact_on = ("cpu", "cuda", "metal")

    def available(self):
        return False


class CountingStore(MemoryStore):
    name = "counting"


class ThirdParty:
    def __init__(self):
        self.kernel = CountingKernel()

    @hookimpl
    def register_kernels(self, register):
        register(self.kernel)
        register(UnavailableKernel())

    @hookimpl
    def register_stores(self, register):
        register("counting", CountingStore)


@pytest.fixture
def third_party():
    with registered(ThirdParty(), "third-party-test") as plugin:
        yield plugin


def test_builtins_registered(checkpoint):
    pm = plugins.load_plugins()
    names = {name for name, _ in pm.list_name_plugin()}
    assert set(plugins.BUILTIN_PLUGINS) <= names
    assert {"gather", "per_expert"} <= set(plugins.kernels())
    assert {"safetensors", "memory"} <= set(plugins.stores())
    assert {"qwen3_moe", "mixtral", "deepseek_v3"} <= set(plugins.architectures())


def test_third_party_kernel_and_store_are_used(checkpoint, third_party):
    path = checkpoint("qwen3_moe")
    stock, _ = load_stock(path)
    model, _ = load_streaming(path, store="counting")
    assert isinstance(model.expert_streaming.store, CountingStore)
    tokens = mx.array([[5, 6, 7, 8]])
    assert mx.array_equal(stock(tokens), model(tokens)).item()
    # every MoE layer computed its experts with it (once per group of experts as they landed)
    assert len(third_party.kernel.banks) == 2


def test_unavailable_kernel_falls_back(checkpoint, third_party):
    path = checkpoint("qwen3_moe")
    model, _ = load_streaming(path, kernel="unavailable")
    with pytest.warns(UserWarning, match="cannot run on cpu"):
        mx.eval(model(mx.array([[1, 2]])))
    bank = model.expert_streaming.cache.banks[0]
    assert model.expert_streaming.selector.select(bank, 2).name == "counting"


def test_unregistered_plugin_is_gone(third_party):
    plugins.load_plugins().unregister(third_party)
    try:
        assert "counting" not in plugins.kernels()
    finally:
        plugins.load_plugins().register(third_party, name="third-party-test")


BLOCK_SCRIPT = """
from mlx_lm_streaming import plugins
pm = plugins.load_plugins()
print(sorted(n for n, _ in pm.list_name_plugin() if n), pm.is_blocked("evil"))
"""


def _install_fake_distribution(root):
    """A real (if tiny) installed distribution whose entry point names a plugin that must not load."""
    (root / "evil_plugin_for_test.py").write_text(
        "raise SystemExit('evil plugin was imported')\n"
    )
    info = root / "evil_plugin_for_test-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: evil-plugin-for-test\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[mlx_lm_streaming]\nevil = evil_plugin_for_test\n"
    )


@pytest.mark.parametrize("value,blocked", [("1", True), ("evil", True), ("other", False)])
def test_block_env_var(tmp_path, value, blocked):
    _install_fake_distribution(tmp_path)
    env = dict(os.environ, MLX_LM_STREAMING_BLOCK_PLUGINS=value)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_SCRIPT], capture_output=True, text=True, env=env
    )
    if blocked:
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().endswith("True")
        assert "architectures" in out.stdout and "kernels" in out.stdout
    else:
        assert "evil plugin was imported" in out.stderr


# -- the kernel selector's memo ------------------------------------------------------------------


class Bank:
    def __init__(self, special: bool):
        self.special = special
        self.path = "model.layers.0.mlp.switch_mlp"


class SpecialKernel(ExpertKernel):
    """Wants special banks only, and long prompts most."""

    name = "special"
    exact_on = ("cpu", "cuda", "metal")

    def supports(self, bank):
        return bank.special

    def priority(self, backend, bank, rows):
        return 2.0 if rows < 64 else 0.0


class PlainKernel(ExpertKernel):
    name = "plain"
    exact_on = ("cpu", "cuda", "metal")

    def priority(self, backend, bank, rows):
        return 1.0


def selector_of_two():
    selector = KernelSelector()
    selector.kernels = {"special": SpecialKernel(), "plain": PlainKernel()}
    return selector


def test_selector_choice_never_outlives_its_bank():
    """The memo was keyed by ``id(bank)``: a new bank at a freed bank's address got its choice."""
    selector = selector_of_two()
    bank = Bank(special=True)
    assert selector.select(bank, 1).name == "special"
    freed = id(bank)
    del bank
    gc.collect()
    assert len(selector._memo) == 0  # the entry left with its bank
    kept = []
    for _ in range(10_000):
        other = Bank(special=False)
        if id(other) == freed:
            break
        kept.append(other)
    # whether or not CPython gave a new bank the freed one's address (it usually does, not always
    # in a long run), no new bank inherits the freed bank's choice
    assert all(selector.select(b, 1).name == "plain" for b in kept + [other])


def test_selector_memo_is_bounded_and_keeps_choosing_by_rows():
    selector = selector_of_two()
    bank = Bank(special=True)
    for rows in range(1, 5000):  # a server sees prompts of every length
        want = "special" if rows < 64 else "plain"
        assert selector.select(bank, rows).name == want
    assert len(selector._memo[bank]) == MEMO_ROWS
    assert selector.select(bank, 1).name == "special"  # evicted long ago: chosen again
    assert selector.select(bank, 4000).name == "plain"
