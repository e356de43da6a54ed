"""Loading: no routed-expert bytes read, memory at load, the Python API, and bad input."""

import json
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
import mlx_lm.utils
from support import build_dbrx_checkpoint, held_out_env, install, load_streaming

import mlx_lm_streaming
from mlx_lm_streaming.errors import CheckpointError, ConfigurationError, UnsupportedModelError
from synthetic import build_checkpoint


def test_load_reads_no_expert_bytes(checkpoint):
    model, _ = load_streaming(checkpoint("qwen3_moe", "affine4"))
    state = model.expert_streaming
    assert state.store.stats.bytes_read == 0 and state.cache.stats.misses == 0
    params = dict(tree_flatten(model.parameters()))
    assert not [k for k in params if "switch_mlp" in k or ".experts." in k]
    mx.eval(model(mx.array([[1, 2, 3]])))
    assert state.store.stats.bytes_read > 0
    assert state.store.stats.bytes_read % state.cache.banks[0].layer.expert_nbytes == 0


def test_the_slot_banks_are_made_at_load_and_a_lazy_load_leaves_them_to_the_first_call(checkpoint):
    # stock's load makes its weights' memory; ours makes the budget's slot banks then (no bytes
    # read), so the first prompt does not wait for them; a lazy load (mlx-lm's pipeline loads)
    # plans at the first call, once the stage's banks are known
    install()
    path = checkpoint("qwen3_moe", "affine4")
    with held_out_env():
        model, _ = mlx_lm.utils.load_model(path, model_config={"streaming_experts": {}})
        lazy, _ = mlx_lm.utils.load_model(path, lazy=True, model_config={"streaming_experts": {}})
    cache = model.expert_streaming.cache
    assert cache.planned and all(b.slots > 0 for b in cache.banks)
    assert cache.resident_bytes == sum(b.slots * b.layer.expert_nbytes for b in cache.banks)
    assert model.expert_streaming.store.stats.bytes_read == 0
    assert not lazy.expert_streaming.cache.planned
    mx.eval(lazy(mx.array([[1, 2, 3]])))
    assert lazy.expert_streaming.cache.planned
    model.expert_streaming.close()
    lazy.expert_streaming.close()


def test_a_pipeline_stage_after_a_load_that_was_not_lazy_gives_its_banks_the_budget(checkpoint):
    # mlx-lm's pipeline loads are lazy (planned at the first call); a model loaded whole, then
    # split by hand, planned every layer at load: the split drops the other stages' banks and the
    # stage's are planned again at its first call, for its budget
    path = checkpoint("qwen3_moe", "affine4")
    probe, _ = load_streaming(path)
    per_layer = sum(b.layer.expert_nbytes for b in probe.expert_streaming.cache.banks[:1])
    probe.expert_streaming.close()
    model, _ = load_streaming(path, expert_cache_gb=(4 * per_layer + 0.5) / 1e9)
    cache = model.expert_streaming.cache
    layers = len(cache.banks)
    assert cache.planned and layers > 1
    before = [b.slots for b in cache.banks]

    class Group:
        rank, size = staticmethod(lambda: 0), staticmethod(lambda: 2)

    model.model.pipeline(Group())
    assert 0 < len(cache.banks) < layers and not cache.planned
    cache.ensure_planned()  # (what the stage's first call does)
    assert [b.slots for b in cache.banks] == cache.plan_slots()
    assert sum(cache.plan_slots()) > sum(before[: len(cache.banks)])  # the budget, on fewer layers
    assert cache.resident_bytes <= cache.budget_bytes
    model.expert_streaming.close()


def test_python_api_returns_what_mlx_lm_load_returns(checkpoint):
    path = checkpoint("mixtral", "affine4")
    with held_out_env():
        model, tokenizer = mlx_lm_streaming.load(str(path), expert_cache_gb=0.001)
        model2, tokenizer2, config = mlx_lm_streaming.load(
            str(path), kernel="per_expert", store="memory", return_config=True
        )
    assert model.expert_streaming.options.expert_cache_gb == 0.001
    assert type(tokenizer) is type(tokenizer2)
    assert config["model_type"] == "mixtral" and "streaming_experts" not in config
    assert model2.expert_streaming.store.name == "memory"
    text = tokenizer.decode(tokenizer.encode("hello world"))
    assert "hello" in text


RSS_SCRIPT = textwrap.dedent(
    """
    import sys, mlx_lm.utils
    from mlx_lm_streaming.integration.integration import install
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    install()
    import mlx.core as mx
    mx.eval(mx.zeros(1))
    before = rss()
    model, _ = mlx_lm.utils.load_model(
        __import__("pathlib").Path(sys.argv[1]),
        model_config={"streaming_experts": {"expert_cache_gb": 0.05}},
    )
    after = rss()
    state = model.expert_streaming
    print(after - before, state.cache.total_expert_bytes, state.store.stats.bytes_read)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_load_memory_with_a_gigabyte_of_experts(tmp_path):
    # 3 layers x 128 float32 experts of 3 x 512 x 512: 1.2 GB of routed experts
    path = build_checkpoint(
        tmp_path / "big",
        "qwen3_moe",
        "float32_hf",
        num_layers=3,
        overrides={"hidden": 512, "moe_intermediate": 512, "experts": 128, "top_k": 2},
    )
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("MLX_LM_STREAMING")},
    )
    growth, expert_bytes, read = map(int, out.stdout.split())
    assert expert_bytes >= 1 << 30
    assert read == 0
    assert growth < 0.10 * expert_bytes, (growth, expert_bytes)


def _rewrite_shard(path, drop=None):
    """Rewrite the shard holding tensor ``drop`` without it (index updated)."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = path / index["weight_map"].pop(drop)
    weights = mx.load(str(shard))
    del weights[drop]
    mx.save_safetensors(str(shard), weights, metadata={"format": "mlx"})
    index_file.write_text(json.dumps(index))


def _fresh(tmp_path, arch="qwen3_moe", variant="affine4"):
    return build_checkpoint(tmp_path / f"{arch}-{variant}", arch, variant)


def test_missing_stacked_expert_tensor_is_named(tmp_path):
    path = _fresh(tmp_path)
    name = "model.layers.1.mlp.switch_mlp.up_proj.scales"
    _rewrite_shard(path, drop=name)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_streaming(path)


def test_missing_raw_expert_tensor_is_named(tmp_path):
    path = _fresh(tmp_path, "mixtral", "float32_hf")
    name = "model.layers.0.block_sparse_moe.experts.5.w3.weight"
    _rewrite_shard(path, drop=name)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_streaming(path)


def test_truncated_shard_is_named(tmp_path):
    path = _fresh(tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=shard.name):
        load_streaming(path)


def test_shape_disagreeing_with_config_names_file_and_tensor(tmp_path):
    path = _fresh(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["moe_intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model-0000\d-of-00002\.safetensors.*switch_mlp"):
        load_streaming(path)


def test_an_moe_that_cannot_stream_names_model_type_and_why(tmp_path):
    with pytest.raises(UnsupportedModelError, match="'dbrx' cannot stream: its experts are a list"):
        load_streaming(build_dbrx_checkpoint(tmp_path))


def test_budget_below_one_expert_per_layer_is_an_error(checkpoint):
    with pytest.raises(ConfigurationError, match="expert_cache_gb"):
        load_streaming(checkpoint("qwen3_moe"), expert_cache_gb=1e-9)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"store": "nope"}, "unknown expert store 'nope'"),
        ({"kernel": "nope"}, "unknown expert kernel 'nope'"),
        ({"expert_cache_gb": -1}, "expert_cache_gb -1: the budget must be positive"),
        ({"cache": 1}, r"unknown streaming_experts option\(s\) \['cache'\]"),
    ],
)
def test_bad_options_are_named(checkpoint, options, match):
    with pytest.raises(ConfigurationError, match=match):
        load_streaming(checkpoint("qwen3_moe"), **options)


def test_streaming_off_is_stock(checkpoint, monkeypatch):
    import mlx_lm.utils

    from mlx_lm_streaming.integration.integration import install

    install()
    monkeypatch.setenv("MLX_LM_STREAMING_EXPERTS", "1")
    model, config = mlx_lm.utils.load_model(
        checkpoint("qwen3_moe"), model_config={"streaming_experts": False}
    )
    assert not hasattr(model, "expert_streaming")
    assert any("switch_mlp" in k for k, _ in tree_flatten(model.parameters()))


@pytest.mark.parametrize("failure", ["raises", "unsupported"])
def test_unknown_memory_size_is_said_once(monkeypatch, capsys, failure):
    """The default budget assumed 16 GB without a word where the OS does not give the RAM size."""
    from mlx_lm_streaming.runtime.memory import machine as memory

    def sysconf(name):
        if failure == "raises":
            raise ValueError(f"unrecognized configuration name {name!r}")
        return -1

    monkeypatch.setattr(memory.os, "sysconf", sysconf)
    monkeypatch.setattr(memory, "_memory_warned", False)
    assert memory.physical_memory_bytes() == memory.ASSUMED_MEMORY_BYTES == 16 * 10**9
    assert memory.physical_memory_bytes() == memory.ASSUMED_MEMORY_BYTES
    # the check of a given budget asks the same probe: no memory to check against
    assert memory.memory_and_swap() is None
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert "cannot read this machine's memory size" in lines[0]
    assert "assumes 16 GB" in lines[0] and "--expert-cache-gb" in lines[0]
    if failure == "raises":
        assert "ValueError: unrecognized configuration name" in lines[0]


def test_the_default_budget_is_a_share_of_the_memory_the_experts_live_in(monkeypatch):
    """CUDA: a share of the GPU's memory (the expert cache lives there, the page cache does not);
    elsewhere half of the machine's RAM. Both after the resident weights."""
    from types import SimpleNamespace

    from mlx_lm_streaming.integration import loading
    from mlx_lm_streaming.runtime.memory import machine as memory

    bank = SimpleNamespace(layer=SimpleNamespace(expert_nbytes=10**6))
    cache = SimpleNamespace(banks=[bank, bank], total_expert_bytes=10**15)
    state = SimpleNamespace(cache=cache, resident_bytes=10**9)
    monkeypatch.setattr(memory, "physical_memory_bytes", lambda: 64 * 10**9)
    monkeypatch.setattr(memory, "cuda_memory_bytes", lambda: None)
    assert loading.default_budget(state) == (int(0.5 * 63 * 10**9), 63 * 10**9)
    assert memory.budget_base()[2] == "memory"
    monkeypatch.setattr(memory, "cuda_memory_bytes", lambda: 24 * 10**9)
    budget, free = loading.default_budget(state)
    assert free == 23 * 10**9 and budget == int(memory.CUDA_CACHE_SHARE * free)
    assert memory.budget_base()[1:] == (memory.CUDA_CACHE_SHARE, "GPU memory")


def test_no_cuda_memory_off_cuda():
    from mlx_lm_streaming.runtime.memory import machine as memory

    assert memory.cuda_memory_bytes() is None  # this CPU box: the machine's RAM


def _write_safetensors(path, arrays, dtypes):
    """``arrays`` (name -> numpy array) as a safetensors file, with ``dtypes[name]`` written in the
    header where given (an fp8 dtype mlx cannot save)."""
    import struct

    header, offset = {}, 0
    for name, a in arrays.items():
        kind = {"float32": "F32", "uint8": "U8"}[str(a.dtype)]
        header[name] = {
            "dtype": dtypes.get(name, kind),
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for a in arrays.values():
            f.write(a.tobytes())


def test_raw_fp8_experts_are_refused_by_name(tmp_path):
    # DeepSeek V3.2's published experts are fp8 that mlx-lm's sanitize dequantizes: streaming their
    # bytes as they are on disk would not be stock's computation. The header names the tensor and
    # its dtype before anything is read (convert with mlx_lm.convert first)
    import numpy as np

    path = _fresh(tmp_path, "deepseek_v32", "float32_hf")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    shard = path / index["weight_map"][name]
    arrays = {k: np.array(v) for k, v in mx.load(str(shard)).items()}
    arrays[name] = np.zeros(arrays[name].shape, dtype=np.uint8)
    _write_safetensors(shard, arrays, {name: "F8_E4M3"})
    culprit = rf"{name.replace('.', '[.]')}.*unsupported dtype 'F8_E4M3'"
    with pytest.raises(CheckpointError, match=culprit):
        load_streaming(path)
