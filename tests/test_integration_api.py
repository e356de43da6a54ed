"""In-process: mlx-lm's own Python API with a streaming model, and the ``load_model`` wrapper."""

import os

import mlx_lm
import mlx_lm.utils
import pytest
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from support import build_dense_checkpoint

from mlx_lm_streaming.integration.integration import _wrap_load_model, install
from mlx_lm_streaming.runtime.options import ENV

PROMPTS = ["Tell me a story", "Why is the sky blue? Explain in detail please", "Hi"]


@pytest.fixture(scope="module")
def models(checkpoint):
    """(stock model, streaming model with 3 of 8 experts per layer, tokenizer)."""
    install()
    path = checkpoint("qwen3_moe")
    saved = {k: os.environ.pop(k) for k in ENV.values() if k in os.environ}
    try:
        stock, tokenizer = mlx_lm.load(str(path))
        streaming, _ = mlx_lm.load(
            str(path),
            model_config={"streaming_experts": {"expert_cache_gb": 46080 / 1e9}},
        )
    finally:
        os.environ.update(saved)
    assert streaming.expert_streaming.cache.slots_for_budget() == 3
    return stock, streaming, tokenizer


def test_stream_generate(models):
    stock, streaming, tokenizer = models
    texts = [
        "".join(
            r.text
            for r in mlx_lm.stream_generate(m, tokenizer, PROMPTS[1], max_tokens=24)
        )
        for m in (stock, streaming)
    ]
    assert texts[0] and texts[0] == texts[1]


def test_batch_generate(models):
    stock, streaming, tokenizer = models
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    texts = [
        mlx_lm.batch_generate(m, tokenizer, prompts, max_tokens=16).texts
        for m in (stock, streaming)
    ]
    assert texts[0] == texts[1]
    assert len(set(texts[0])) > 1


def test_saved_and_loaded_prompt_cache(models, tmp_path):
    stock, streaming, tokenizer = models
    texts = []
    for name, model in (("stock", stock), ("streaming", streaming)):
        cache = make_prompt_cache(model)
        # prefill the cache with the first prompt, save it, load it, continue from it
        for _ in mlx_lm.stream_generate(
            model, tokenizer, PROMPTS[1], max_tokens=1, prompt_cache=cache
        ):
            pass
        save_prompt_cache(str(tmp_path / f"{name}.safetensors"), cache)
        loaded = load_prompt_cache(str(tmp_path / f"{name}.safetensors"))
        texts.append(
            mlx_lm.generate(
                model, tokenizer, " and then?", max_tokens=16, prompt_cache=loaded
            )
        )
    assert texts[0] and texts[0] == texts[1]


def test_model_config_forms(checkpoint, environ):
    path = checkpoint("mixtral")
    model, _ = mlx_lm.load(str(path), model_config={"streaming_experts": True})
    assert model.expert_streaming.options.store == "safetensors"
    model, _ = mlx_lm.load(
        str(path),
        model_config={"streaming_experts": {"store": "memory", "kernel": "gather"}},
    )
    assert model.expert_streaming.options.store == "memory"
    environ[ENV["enabled"]] = "1"
    model, _, config = mlx_lm.load(
        str(path), model_config={"streaming_experts": False}, return_config=True
    )
    assert not hasattr(model, "expert_streaming")
    # mlx-lm never sees our key
    assert "streaming_experts" not in config


def test_stock_call_is_passed_through_unchanged(environ):
    calls = []

    def stock(model_path, lazy=False, strict=True, model_config=None, **kwargs):
        calls.append((model_path, lazy, strict, model_config, kwargs))
        return "model", "config"

    wrapped = _wrap_load_model(stock)
    config = {"quantize_activations": False}
    assert wrapped("p", True, False, model_config=config) == ("model", "config")
    # nothing added (get_model_classes and trust_remote_code left to the stock defaults);
    # model_config the same object
    assert calls[-1] == ("p", True, False, config, {})
    assert calls[-1][3] is config
    marker = object()
    wrapped("p", get_model_classes=marker, trust_remote_code=True)
    assert calls[-1][4] == {"trust_remote_code": True, "get_model_classes": marker}


def test_wrapper_takes_what_an_older_load_model_takes(environ):
    # mlx-lm 0.30/0.31: no trust_remote_code. The wrapper forwards only what it is given, and a
    # bad call fails as the stock one does
    calls = []

    def stock(model_path, lazy=False, strict=True, model_config=None, get_model_classes=None):
        calls.append((model_path, lazy, strict, model_config, get_model_classes))
        return "model", "config"

    wrapped = _wrap_load_model(stock)
    assert wrapped("p") == ("model", "config")
    assert wrapped("p", False, True, {}, None) == ("model", "config")
    assert calls == [("p", False, True, None, None), ("p", False, True, {}, None)]
    with pytest.raises(TypeError, match="trust_remote_code"):
        wrapped("p", trust_remote_code=True)


@pytest.fixture(scope="module")
def dense_checkpoint(checkpoint, tmp_path_factory):
    """A tiny dense llama checkpoint (no experts to stream), with a synthetic tokenizer."""
    return build_dense_checkpoint(tmp_path_factory.mktemp("dense"), checkpoint("qwen3_moe"))


NOT_MOE = "is not a Mixture-of-Experts model: loaded as stock mlx-lm would"


@pytest.mark.parametrize("asked", ["environment", "model_config"])
def test_a_model_without_experts_loads_as_stock_with_one_line(dense_checkpoint, environ, capfd,
                                                              asked):
    """Whether the environment or the code asks for streaming, a dense model loads as stock does
    and one line says why (issue 38: it said "has no streaming adapter", and code got an error)."""
    config = None
    if asked == "environment":
        environ[ENV["enabled"]] = "1"
    else:
        config = {"streaming_experts": True}
    model, tokenizer = mlx_lm.load(str(dense_checkpoint), model_config=config)
    assert not hasattr(model, "expert_streaming")
    (line,) = capfd.readouterr().err.splitlines()
    assert line == f"mlx-lm-streaming: {dense_checkpoint}: model_type 'llama' {NOT_MOE}"
    stock, _ = mlx_lm.load(str(dense_checkpoint))
    text = mlx_lm.generate(model, tokenizer, "hi", max_tokens=4)
    assert text == mlx_lm.generate(stock, tokenizer, "hi", max_tokens=4)
