"""Bit-exact parity for the hybrid families (recurrent or linear-attention state in ``ArraysCache``
entries beside attention and MoE layers) and for ``SwitchMLP`` experts (nemotron_h): the runner of
test_parity.py (prompt and decode log-probs equal to stock; batch 1 and 2; a budget of three
experts per layer and one holding every expert), from converted checkpoints and, where Hugging Face
stores experts one by one, from the raw layout."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from support import load_stock, with_slots
from test_parity import PREFILL_STEP, check_parity, generate_step_module, run_generate_step

from mlx_lm_streaming.runtime import mlx_shims
from mlx_lm_streaming.runtime.decode.verified_step import VerifiedStep
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from mlx_lm_streaming.tools.parity import difference
from synthetic import build_checkpoint

# converted checkpoints
HYBRIDS = [
    "qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "jamba", "lfm2_moe", "granitemoehybrid",
    "bailing_moe_linear", "bailing_hybrid", "bailing_moe_v3", "kimi_linear", "kimi_k3",
]  # fmt: skip
# raw Hugging Face layouts that store experts one by one (qwen3_5_moe and granitemoehybrid fuse
# them, qwen3_5's sanitize stacks none: converted checkpoints only)
RAW_HF = [a for a in HYBRIDS if a not in ("qwen3_5", "qwen3_5_moe", "granitemoehybrid")]
TABLE = [(a, "affine4") for a in HYBRIDS] + [(a, "float32_hf") for a in RAW_HF]


@pytest.mark.parametrize("arch,variant", TABLE, ids=[f"{a}-{v}" for a, v in TABLE])
def test_parity_hybrid(checkpoint, arch, variant):
    check_parity(checkpoint(arch, variant))


# SwitchMLP experts: nemotron_h (relu^2, no biases) and phixtral (GELU, biases), fc1 / fc2 at other
# bits and modes (mixed: per-module bits) through the same gather kernel, and phixtral's raw layout
SWITCH_MLP = [("nemotron_h", "mixed"), ("nemotron_h", "mxfp4"), ("phixtral", "affine4")]
SWITCH_MLP += [("phixtral", "mixed"), ("phixtral", "float32_hf")]


@pytest.mark.parametrize("arch,variant", SWITCH_MLP, ids=[f"{a}-{v}" for a, v in SWITCH_MLP])
def test_parity_switch_mlp(checkpoint, arch, variant):
    check_parity(checkpoint(arch, variant))


def test_parity_prism_hadamard_qwen35(tmp_path):
    """Qwen3.5 MoE with Hadamard-packed linear layers (mlx-lm 0.32.1+): uniform 2-bit affine at
    group size 128, one attention output projection taking rotated inputs; its experts are a
    plain 2-bit SwitchGLU and stream as qwen3_5's."""
    pytest.importorskip("mlx_lm.models.prism_hadamard_qwen35")
    from synthetic.prism import build_prism_checkpoint

    check_parity(build_prism_checkpoint(tmp_path / "prism"))


# -- the verified step over recurrent state ------------------------------------------------------

PROMPT = mx.array([3, 17, 42, 5, 9, 101, 7, 64])
STEPS = 12
# a Mamba-2 layer after each MoE layer but the last: a miss in one MoE layer runs a recurrent layer
# again, whose state must first be put back
NEMOTRON_LAYERS = ["mamba", "moe", "mamba", "moe", "attention", "moe"]


@pytest.fixture(scope="module")
def hybrid_paths(tmp_path_factory):
    """``hybrid_paths[arch]``: 4 layers (nemotron_h: ``NEMOTRON_LAYERS``) of 16 experts, built once.
    qwen3_next: linear attention in layers 0 and 2, full attention in 1 and 3, every layer MoE."""
    root = tmp_path_factory.mktemp("hybrid-steps")

    class Paths(dict):
        def __missing__(self, arch):
            layers, overrides = 4, {"experts": 16}
            if arch == "nemotron_h":
                layers, overrides = 6, {**overrides, "layer_types": NEMOTRON_LAYERS}
            if arch == "gemma4_text":  # (a window past the tokens: its caches can be taken back)
                overrides = {**overrides, "sliding_window": 64}
            self[arch] = build_checkpoint(
                root / arch, arch, num_layers=layers, overrides=overrides
            )
            return self[arch]

    return Paths()


# a verified step wherever one may run, whatever the share limits say (``share_limits.way``)
ALWAYS = CacheTuning(verify_choice="always")


def generated(model, every_call_verified=False):
    """Tokens and log-probabilities of greedy decoding through mlx-lm's ``generate_step`` (which
    builds step t+1's graph before step t is evaluated); ``every_call_verified``: a verified step
    tried at every call, whatever the misses of the calls before."""
    runner = getattr(model, "expert_streaming", None)
    out = []
    for (token, logprobs), _ in zip(generate_step(PROMPT, model, max_tokens=STEPS), range(STEPS)):
        if every_call_verified:
            runner.steps.missed_share = 0.0
        out.append((int(token), np.array(logprobs)))
    return out


def put_backs(monkeypatch):
    """Count ``mlx_shims.put_back`` calls by what they put back (``arrays``: a recurrent state)."""
    seen = {"arrays": 0, "kv": 0}
    real = mlx_shims.put_back

    def spy(entry, marked):
        seen["arrays" if isinstance(marked, list) else "kv"] += 1
        return real(entry, marked)

    monkeypatch.setattr(mlx_shims, "put_back", spy)
    return seen



@pytest.mark.parametrize("arch", HYBRIDS + ["phixtral"])
def test_a_verified_step_that_misses_puts_recurrent_state_back(hybrid_paths, arch, monkeypatch):
    # three slots of 16 experts: verified steps miss mid-step; each miss puts the recurrent and KV
    # entries of the layers from the one that missed back as they were and runs them again
    path = hybrid_paths[arch]
    stock, _ = load_stock(path)
    expected = generated(stock)
    model = with_slots(path, 3, tuning=ALWAYS)
    assert mlx_shims.rewindable(make_prompt_cache(model), 1)
    seen = put_backs(monkeypatch)
    got = generated(model, every_call_verified=True)
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(expected, got):
        assert np.array_equal(a, b)
    runner = model.expert_streaming.steps
    assert runner.verified >= STEPS // 2
    # run again from the layer that missed, never whole (kimi_k3's layers give (h, None) here:
    # no residual blocks, so the next layer takes h alone)
    assert runner.replays > 0 and runner.recomputed == 0
    assert seen["arrays"] > 0 or arch not in HYBRIDS  # recurrent states were put back



def _greedy_against_stock(path, monkeypatch, tuning=ALWAYS):
    """The streaming model of ``path`` (3 slots a layer, a verified step at every call) decoded
    against stock, every token and log-probabilities' bits equal; ``(its runner, restarts)``."""
    expected = generated(load_stock(path)[0])
    model = with_slots(path, 3, tuning=tuning)
    restarts = []
    real = VerifiedStep.restart
    monkeypatch.setattr(VerifiedStep, "restart", lambda step: restarts.append(1) or real(step))
    got = generated(model, every_call_verified=True)
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(expected, got):
        assert np.array_equal(a, b)
    return model.expert_streaming.steps, restarts


def test_layers_that_give_tuples_are_replayed_from_the_layer_that_missed(hybrid_paths, monkeypatch):
    # gemma-4's decoder layers give (h, keys and values, offset); the next takes h: a miss runs
    # the layers again from the one that missed, as for layers that give h alone
    runner, restarts = _greedy_against_stock(hybrid_paths["gemma4_text"], monkeypatch)
    assert runner.verified >= STEPS // 2 and runner.replays > 0
    assert runner.recomputed == 0 and not restarts


@pytest.mark.parametrize("in_pass,first", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("arch", ["gemma4_text", "qwen3_next", "nemotron_h"])
def test_landings_taken_as_the_layers_run_again_in_hybrids(
    hybrid_paths, arch, monkeypatch, in_pass, first
):
    # ``replay_as_landed``: each bank's reads taken by its own MoE call as the layers run again
    # (tuple layers, recurrent states put back), the reads issued after the check or (``in_pass``,
    # ``reads_in_pass``) as the check reads each call's ids, or (``first``, ``first_call_reads``,
    # every step looking) the first MoE call's as it is built: stock's bits, replayed, never whole
    from mlx_lm_streaming.runtime.decode import verified_step

    monkeypatch.setattr(verified_step, "LOOK_SHARE", 0.0)
    tuning = CacheTuning(verify_choice="always", replay_as_landed=True, lookahead_min_precision=0,
                         reads_in_pass=in_pass, first_call_reads=first)  # fmt: skip
    runner, restarts = _greedy_against_stock(hybrid_paths[arch], monkeypatch, tuning)
    assert runner.replays > 0 and runner.recomputed == 0 and not restarts
    assert (runner.first_call_reads > 0) == first


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("arch", ["kimi_k3-attn-res", "gemma4_text-kv-shared"])
def test_a_miss_where_layers_cannot_be_replayed_is_read_then_the_call_runs_again_verified(
    arch, monkeypatch, tmp_path, first
):
    # a layer given what another layer gave beside its output (kimi_k3's residual blocks, a
    # KV-shared gemma-4 layer's keys and values) would get the first pass's again in a replay: a
    # miss reads its experts (and those the pass beyond it named), puts every entry back and runs
    # the call again whole as a verified step, once (``restart``); only a miss in that run, per
    # layer. ``first``: the first MoE call's reads issued as it was built (``first_call_reads``,
    # every step looking), before a later layer showed the step cannot run again from it
    name, overrides = arch.split("-")[0], {  # (gemma-4: the last two layers take the first two's)
        "kimi_k3-attn-res": {"attn_res_block_size": 2},
        "gemma4_text-kv-shared": {"sliding_window": 64, "num_kv_shared_layers": 2},
    }[arch]
    path = build_checkpoint(tmp_path / name, name, num_layers=4, overrides={"experts": 16,
                                                                         **overrides})
    from mlx_lm_streaming.runtime.decode import verified_step

    monkeypatch.setattr(verified_step, "LOOK_SHARE", 0.0)
    tuning = CacheTuning(verify_choice="always", first_call_reads=first)
    runner, restarts = _greedy_against_stock(path, monkeypatch, tuning)
    assert len(restarts) > 0 and runner.recomputed >= len(restarts) and runner.replays == 0
    assert runner.named > 0  # (read with the first miss's experts, whatever the guesses scored)
    # (kimi_k3's blocks are given from its second layer, before its first MoE call: no look)
    assert (runner.first_call_reads > 0) == (first and name == "gemma4_text")

def test_a_recurrent_state_left_as_the_missed_pass_wrote_it_is_not_stock(hybrid_paths, monkeypatch):
    # the test above can fail: a miss whose recurrent states are not put back computes the layers
    # run again from a state that took this step's token twice
    path = hybrid_paths["qwen3_next"]
    stock, _ = load_stock(path)
    expected = generated(stock)
    real = mlx_shims.put_back
    monkeypatch.setattr(
        mlx_shims, "put_back", lambda e, m: None if isinstance(m, list) else real(e, m)
    )
    got = generated(with_slots(path, 3, tuning=ALWAYS), every_call_verified=True)
    assert any(not np.array_equal(a, b) for (_, a), (_, b) in zip(expected, got))


def test_recurrent_state_marks_and_put_back():
    arrays = ArraysCache(size=2)
    assert mlx_shims.rewindable([arrays, KVCache()], 4)
    arrays[0], arrays[1] = mx.zeros((1, 3)), mx.ones((1, 2))
    marked = mlx_shims.mark(arrays)
    before = list(arrays.cache)
    arrays[1] = arrays[1] + 1  # as a step writes it: a new array in the slot
    assert mlx_shims.changed(arrays, marked)
    mlx_shims.put_back(arrays, marked)
    assert all(a is b for a, b in zip(arrays.cache, before))
    assert not mlx_shims.changed(arrays, marked)
    arrays.prepare(lengths=[3])  # a batch's prepared lengths change in place: not rewound
    assert not mlx_shims.rewindable([arrays], 1)


# decoder layers given an array mask (kimi_linear, bailing_hybrid, bailing_moe_v3) or an offset
# (bailing_moe_linear) that the model makes from the caches before layer 0, or a (h, blocks) pair
# to unpack (kimi_k3): chunk by chunk, as stock, with the reason said
PREFILL_FALLS_BACK = {
    "kimi_linear": "makes from the caches",
    "bailing_moe_v3": "makes from the caches",
    "bailing_hybrid": "makes from the caches",
    "bailing_moe_linear": "makes from the caches",
    "kimi_k3": "cannot run with its layers skipped",
}


@pytest.mark.parametrize("sets", [True, False], ids=["layer_sets", "waves"])
@pytest.mark.parametrize("arch", HYBRIDS + ["phixtral"])
def test_hybrid_layer_major_prefill(hybrid_paths, arch, sets):
    # a prompt of six chunks, three slots of 16 experts: layer-major over the recurrent layers
    # (each layer once per chunk over its whole expert set; in waves, each one's state put back
    # between its two runs of a chunk) gives stock's log-probabilities and caches, or falls back
    # with the reason said
    path = hybrid_paths[arch]
    generate = generate_step_module()
    prompt = mx.array([(7 * i + 3) % 512 for i in range(6 * PREFILL_STEP + 1)])
    stock, _ = load_stock(path)
    ref, ref_cache = run_generate_step(stock, generate.generate_step.stock, prompt)
    tuning = CacheTuning(layer_sets=sets)
    model = with_slots(path, 3, layer_major_prefill=True, tuning=tuning)
    out, cache = run_generate_step(model, generate.generate_step, prompt)
    assert difference(ref, out) is None, difference(ref, out)
    for a, b in zip(ref_cache, cache):
        for x, y in zip(tree_flatten(a.state), tree_flatten(b.state)):
            assert (x[1] is None and y[1] is None) or mx.array_equal(x[1], y[1])
    stats = model.expert_streaming.prefill
    if arch in PREFILL_FALLS_BACK:
        assert stats.fallbacks == 1 and PREFILL_FALLS_BACK[arch] in stats.why, stats.why
    else:
        assert stats.fallbacks == 0 and stats.prompts == 1 and stats.chunks == 6, stats
        assert (stats.set_experts_read > 0) == sets and (stats.waves_why is None) == sets, stats


@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3_next"])
def test_verified_steps_of_several_tokens_run_layers_again_with_their_first_arguments(
    hybrid_paths, arch
):
    # calls of 3 tokens (a draft model's verification): kimi_linear's layers get an array mask made
    # from an attention entry's offset before layer 0; a layer run again after a miss gets the
    # mask of its first call (made again, it would see the entries of the layers before written:
    # a wrong shape)
    path = hybrid_paths[arch]
    runs = []
    for model in (load_stock(path)[0], with_slots(path, 6, tuning=ALWAYS)):
        kv = make_prompt_cache(model)
        mx.eval(model(mx.array([[1, 2, 3, 4, 5, 6]]), cache=kv))
        logits = []
        for t in range(8):
            if hasattr(model, "expert_streaming"):
                model.expert_streaming.steps.missed_share = 0.0
            logits.append(np.array(model(mx.array([[7 + t, 40 + t, 100 + t]]), cache=kv)))
        runs.append(logits)
    assert all(np.array_equal(a, b) for a, b in zip(*runs))
    runner = model.expert_streaming.steps
    assert runner.verified == 8 and runner.replays > 0 and runner.recomputed == 0
