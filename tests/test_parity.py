"""Bit-exact parity: one runner, a table of architectures x variants.

Each checkpoint is built with stock mlx-lm classes (random weights, quantized as mlx-lm quantizes, saved
in 2 shards with an index) and loaded both stock and streaming. Logits must be exactly equal for a prompt
and 8 greedy decode steps with a KV cache, at batch 1 and batch 2, with a cache budget below one layer's
experts (evictions mid-forward, waves) and with a budget that holds every expert.
"""

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from support import held_out_env, load_streaming

from mlx_lm_streaming.runtime.decode import schedules
from mlx_lm_streaming.runtime.memory.expert_cache import PHASE_MIN_BYTES
from mlx_lm_streaming.tools.parity import GB, budget_of_slots, compare, difference
from synthetic import build_checkpoint
from synthetic import configs as synthetic_configs

ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "kimi_k2"]
VARIANTS = ["affine4", "mixed", "affine8", "mxfp4", "float32_hf"]
TABLE = [(a, v) for a in ARCHS for v in VARIANTS] + [
    ("deepseek_v41", "affine4"),
    ("deepseek_v41", "mixed"),
    ("deepseek_v41", "mxfp4"),
    ("qwen3_moe", "nvfp4"),
    ("deepseek_v3", "nvfp4"),
    ("deepseek_v41", "float32_hf"),
]
# generic SwitchGLU adapters: each architecture enabled only once it passes here
GENERIC = ["olmoe", "glm4_moe", "ernie4_5_moe", "phimoe", "minimax", "granitemoe", "gpt_oss", "llama4"]
RAW_HF = ["olmoe", "glm4_moe", "ernie4_5_moe", "phimoe", "minimax"]
TABLE += [(a, "affine4") for a in GENERIC] + [(a, "float32_hf") for a in RAW_HF]
# issue 38's families (synthetic/families.py), wrappers included; the raw Hugging Face layout
# where Hugging Face stores experts one by one
FAMILIES = [
    "gemma4_text", "gemma4", "deepseek_v32", "glm4_moe_lite", "mistral4", "mistral3",
    "minimax_m3_vl", "Klear", "afmoe", "bailing_moe", "deepseek", "dots1", "exaone_moe",
    "hunyuan", "laguna", "longcat_flash", "mellum", "mimo_v2_flash", "step3p5",
    "qwen3_vl_moe", "kimi_k25", "kimi_vl", "glm_moe_dsa", "solar_open", "longcat_flash_ngram",
]  # fmt: skip
FAMILIES_RAW_HF = [a for a in FAMILIES if a not in synthetic_configs._NO_HF_LAYOUT]
TABLE += [(a, "affine4") for a in FAMILIES] + [(a, "float32_hf") for a in FAMILIES_RAW_HF]
# other variants of the families users run most, with -m slow
SLOW = [(a, v) for a in ("gemma4", "deepseek_v32", "glm4_moe_lite", "mistral4", "minimax_m3_vl")
        for v in ("mixed", "mxfp4")]  # fmt: skip


def check_parity(path, **options):
    """``parity.compare`` at a budget holding every expert and at three experts per layer (below
    one layer's experts: calls evict and run in waves), batch 1 and 2; plus what each budget must
    have done."""
    full, _ = load_streaming(path, **options)
    assert not [k for k, _ in tree_flatten(full.parameters()) if "switch_mlp" in k]
    assert all(b.num_experts > 3 for b in full.expert_streaming.cache.banks)
    budgets = {
        "all": (full.expert_streaming.cache.total_expert_bytes + 0.5) / GB,
        "small": budget_of_slots(full, 3),
    }
    full.expert_streaming.close()
    del full

    def inspect(name, model):
        cache = model.expert_streaming.cache
        banks = cache.banks
        chosen = model.expert_streaming.selector.select(banks[0], 2)
        assert chosen.name == options.get("kernel", "gather")
        if name == "small":
            assert all(bk.slots == 3 for bk in banks)
            assert cache.stats.evictions > 0
            assert cache.resident_bytes <= budgets[name] * GB
        else:
            assert all(bk.slots == bk.num_experts for bk in banks)
        assert cache.stats.misses > 0

    with held_out_env():
        rows = compare(path, budgets, on_model=inspect, **options)
    for row in rows:
        assert row["difference"] is None, f"{path.name} {options} {row}"


# one architecture per family, run under every supported mlx-lm release (`-m core`, .ci/run)
CORE = {"qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "olmoe"}


def _param(arch, variant):
    marks = [pytest.mark.core] if arch in CORE and variant != "nvfp4" else []
    return pytest.param(arch, variant, marks=marks, id=f"{arch}-{variant}")


@pytest.mark.parametrize(
    "arch,variant",
    [_param(a, v) for a, v in TABLE]
    + [pytest.param(a, v, marks=pytest.mark.slow, id=f"{a}-{v}") for a, v in SLOW],
)
def test_parity(checkpoint, arch, variant):
    check_parity(checkpoint(arch, variant))


# half-precision activations and scales (quantized; CPU gather_mm is float32 only)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_parity_half_precision(checkpoint, dtype):
    check_parity(checkpoint("qwen3_moe", "affine4", dtype=dtype))


# the per-expert kernel is exact on CPU; chosen by name it must match stock too
@pytest.mark.parametrize("variant", ["affine4", "mixed", "mxfp4", "float32_hf"])
def test_parity_per_expert_kernel(checkpoint, variant):
    check_parity(checkpoint("mixtral", variant), kernel="per_expert")


# without direct reads (the default on GPUs; on the CPU when several threads call): staged reads
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_parity_staged_reads(checkpoint, arch):
    check_parity(checkpoint(arch), direct_reads=False)


def count_schedules(monkeypatch):
    """Count the schedules ``schedules.choose`` picks, by class name (docs/design.md's table)."""
    ran = {}
    real = schedules.choose

    def choose(*args):
        schedule = real(*args)
        name = type(schedule).__name__
        ran[name] = ran.get(name, 0) + 1
        return schedule

    monkeypatch.setattr(schedules, "choose", choose)
    return ran


def big_experts(tmp_path):
    """A checkpoint whose experts are of PHASE_MIN_BYTES (16 MiB) and more, and its budget of 3
    slots of 4 experts: each forward pass costs ~0.4 s here."""
    path = build_checkpoint(
        tmp_path / "big",
        "mixtral",
        "affine4",
        num_layers=2,
        overrides={"hidden": 2048, "moe_intermediate": 4608, "experts": 4},
    )
    probe, _ = load_streaming(path)
    assert all(b.layer.expert_nbytes >= PHASE_MIN_BYTES for b in probe.expert_streaming.cache.banks)
    budgets = {"small": budget_of_slots(probe, 3)}
    probe.expert_streaming.close()
    return path, budgets


def test_parity_table_reaches_every_schedule(checkpoint, tmp_path, monkeypatch, padded_gather):
    # the table's budgets and prompts, with its options, reach every schedule class: a new one
    # without a parity case here fails
    ran = count_schedules(monkeypatch)
    check_parity(checkpoint("qwen3_moe"))
    check_parity(checkpoint("qwen3_moe"), direct_reads=False)
    # a call per wave is what backends whose partial calls are padded (GPUs) do: a gather kernel
    # registered through the kernel plugin hook as one
    check_parity(checkpoint("qwen3_moe"), kernel=padded_gather.name)
    # experts of PHASE_MIN_BYTES and more are read a projection at a time (the default): one prompt
    # row, a few decode steps
    path, budgets = big_experts(tmp_path)
    with held_out_env():
        rows = compare(path, budgets, batches=(1,), steps=3)
    assert [r["difference"] for r in rows] == [None]
    assert set(ran) == schedules.names(), ran


def test_parity_big_experts_read_a_projection_at_a_time(tmp_path, monkeypatch):
    # experts of PHASE_MIN_BYTES (16 MiB) and more are read a projection at a time (the default)
    ran = count_schedules(monkeypatch)
    path, budgets = big_experts(tmp_path)
    with held_out_env():
        rows = compare(path, budgets, batches=(1,), steps=3)
    assert [r["difference"] for r in rows] == [None]
    assert ran.get("ByProjection", 0) > 0, ran


def test_non_finite_logits_are_a_difference():
    # NaN on both sides used to pass (array_equal with equal_nan): parity must be on finite logits
    good = mx.array([[0.5, -1.0]])
    for bad in (float("nan"), float("inf")):
        same = mx.array([[bad, -1.0]])
        assert "non-finite logits in stock" in difference([same], [same])
        assert "non-finite logits in streaming" in difference([good], [same])
    assert "differ" in difference([good], [good + 1])
    assert difference([good], [mx.array(good)]) is None


def test_verify_command(checkpoint, tmp_path):
    # the parity runner as users run it: exit 0 and "exact" for every budget and batch
    ckpt = checkpoint("qwen3_moe")
    with held_out_env():
        done = subprocess.run(
            [sys.executable, "-m", "mlx_lm_streaming", "verify", ckpt, "--steps", "2"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4 and all(line.endswith(": exact") for line in lines), done.stdout
    assert "every expert" in lines[0] and "3 experts per layer" in lines[2]


def test_verify_fails_on_a_difference(checkpoint, monkeypatch, capsys):
    from argparse import Namespace

    from mlx_lm_streaming.tools import parity

    real = parity.run

    def off_by_one_when_streaming(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        return [o + 1 for o in out] if hasattr(model, "expert_streaming") else out

    monkeypatch.setattr(parity, "run", off_by_one_when_streaming)
    args = Namespace(
        model=str(checkpoint("qwen3_moe")), expert_cache_gb=[1.0], steps=1, prompt_by_token=False
    )
    with held_out_env():
        assert parity.run_verify(args) == 1
    out = capsys.readouterr().out
    assert "budget 1 GB, batch 1: DIFFERENT: step 0: logits differ" in out


# -- layer-major prefill (layer_major.py): generate_step's chunks through layer L before L+1 ------

# every architecture of the table once; those whose KV cache is not all KVCache fall back
LAYER_MAJOR = ARCHS + ["deepseek_v41"] + GENERIC + FAMILIES
LAYER_MAJOR_FALLS_BACK = {"gpt_oss": "RotatingKVCache", "llama4": "ChunkedKVCache",
                          "deepseek_v41": "LayerCache"}
# issue 38's families: sliding windows (a RotatingKVCache once the prompt passes the window),
# MLA with an indexer or a second attention (CacheList), layers that share an entry (mistral4),
# a forward that needs every layer (hunyuan); docs/architectures.md says the same
LAYER_MAJOR_FALLS_BACK.update(
    dict.fromkeys(("gemma4_text", "gemma4", "afmoe", "exaone_moe", "laguna", "mellum",
                   "mimo_v2_flash", "step3p5"), "RotatingKVCache"),
    **dict.fromkeys(("deepseek_v32", "glm_moe_dsa", "minimax_m3_vl", "longcat_flash",
                     "longcat_flash_ngram"), "CacheList"),
    mistral4="one cache entry each",
    mistral3="one cache entry each",
    hunyuan="cannot run with its layers skipped",
)  # fmt: skip
PREFILL_STEP = 8  # a 42-token prompt: 5 chunks of 8 and 1 of 1, then the last token's step


def generate_step_module():
    import mlx_lm.generate  # noqa: F401 (mlx_lm's __init__ shadows the name with a function)

    return sys.modules["mlx_lm.generate"]


def run_generate_step(model, generate_step, prompt, tokens=4):
    """Every step's log-probabilities and the KV cache after them, with a repetition penalty (its
    processor must see the whole prompt)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_logits_processors

    cache = make_prompt_cache(model)
    out = [
        lp
        for _, lp in generate_step(
            prompt,
            model,
            max_tokens=tokens,
            prefill_step_size=PREFILL_STEP,
            prompt_cache=cache,
            logits_processors=make_logits_processors(repetition_penalty=1.5),
        )
    ]
    mx.eval(out)
    return out, cache


def check_layer_major(path, waves=False, **options):
    """mlx-lm's generate_step over the streaming model (wrapped: layer-major prefill) against the
    stock function over the stock model, same chunks: log-probabilities and KV caches bit for bit,
    at three experts per layer (layer-major: each layer over its whole expert set, or with
    ``waves`` through the slots) and with a slot per expert (chunk by chunk: nothing to save)."""
    from dataclasses import replace

    from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

    if waves:
        options["tuning"] = replace(CacheTuning(), layer_sets=False)
    from support import load_stock

    generate = generate_step_module()
    assert getattr(generate.generate_step, "mlx_lm_streaming", False)
    config_vocab = 64
    prompt = mx.array([(7 * i + 3) % config_vocab for i in range(42)])
    stock, _ = load_stock(path)
    ref, ref_cache = run_generate_step(stock, generate.generate_step.stock, prompt)
    del stock
    options = {"layer_major_prefill": True, **options}  # (auto: off)
    probe, _ = load_streaming(path, **options)
    budgets = [budget_of_slots(probe, 3), (probe.expert_streaming.cache.total_expert_bytes + 0.5) / GB]
    probe.expert_streaming.close()
    for budget in budgets:
        model, _ = load_streaming(path, expert_cache_gb=budget, **options)
        state = model.expert_streaming
        out, cache = run_generate_step(model, generate.generate_step, prompt)
        assert difference(ref, out) is None, (path.name, budget, difference(ref, out))
        for a, b in zip(ref_cache, cache):
            for (_, x), (_, y) in zip(tree_flatten(a.state), tree_flatten(b.state)):
                # a CacheList's state holds its entries' class names beside their arrays
                same = mx.array_equal(x, y) if isinstance(x, mx.array) else x == y
                assert same, path.name
        arch = path.name.split("-")[0]
        if budget == budgets[-1]:
            # a slot per expert: chunk by chunk reads each expert once already; stock's prefill
            assert (state.prefill.prompts, state.prefill.fallbacks) == (0, 0)
        elif arch in LAYER_MAJOR_FALLS_BACK:
            assert state.prefill.prompts == 0 and state.prefill.fallbacks == 1
            assert LAYER_MAJOR_FALLS_BACK[arch] in state.prefill.why
        else:
            prefill = state.prefill
            assert (prefill.prompts, prefill.chunks, prefill.fallbacks) == (1, 6, 0)
            if waves:
                # attention ran once per chunk and layer: given back its output when run again
                assert prefill.parts_given > 0 and prefill.attention_run == 0, (
                    arch, prefill.parts_given, prefill.attention_run)
            else:  # each layer over its whole set, once per chunk: nothing given back
                assert prefill.waves_why is None, (arch, prefill.waves_why)
                assert prefill.set_experts_read > 0 and prefill.parts_given == 0, arch
        state.close()


@pytest.mark.parametrize("arch", LAYER_MAJOR)
def test_parity_layer_major_prefill(checkpoint, arch):
    check_layer_major(checkpoint(arch))


def test_parity_layer_major_prefill_staged_reads(checkpoint):
    check_layer_major(checkpoint("mixtral"), direct_reads=False)


# where two layers' sets do not fit beside the budget: waves through the slots, expert-major
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3", "qwen2_moe"])
def test_parity_layer_major_prefill_waves(checkpoint, arch):
    check_layer_major(checkpoint(arch), waves=True)


def test_parity_layer_major_prefill_waves_staged_reads(checkpoint):
    check_layer_major(checkpoint("mixtral"), waves=True, direct_reads=False)


def test_layer_major_prefill_reads_each_expert_once(checkpoint):
    # a 97-token prompt in six 16-token chunks, four experts per layer cached: chunk by chunk
    # reads the uncached experts several times over, layer-major about once
    from dataclasses import replace

    from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

    path = checkpoint("qwen3_moe")
    generate = generate_step_module()
    prompt = mx.array([(5 * i + 1) % 64 for i in range(97)])
    probe, _ = load_streaming(path)
    budget = budget_of_slots(probe, 4)
    probe.expert_streaming.close()
    read = {}
    for on, sets in ((False, False), (True, False), (True, True)):
        tuning = replace(CacheTuning(), lookahead=False, layer_sets=sets)
        model, _ = load_streaming(
            path, expert_cache_gb=budget, tuning=tuning, layer_major_prefill=on
        )
        cache = model.expert_streaming.cache
        every = cache.total_expert_bytes
        for _ in generate.generate_step(prompt, model, max_tokens=0, prefill_step_size=16):
            pass
        read[on, sets] = cache.store.stats.bytes_read
        model.expert_streaming.close()
    # every expert is read once (the prompt uses them all, the cache starts empty), and the
    # last token's step (stock's) reads again some that the last wave (or the kept) lacks
    for key in ((True, False), (True, True)):
        assert read[key] <= 1.25 * every, (key, read)
        assert read[False, False] >= 2.5 * read[key], read


def test_layer_major_prefill_falls_back_in_one_line(checkpoint, tmp_path):
    # a rotating KV cache (max_kv_size): today's chunked prefill, said once under --streaming-stats
    path = checkpoint("qwen3_moe")
    probe, _ = load_streaming(path)
    budget = budget_of_slots(probe, 3)  # (a slot per expert would take stock's prefill silently)
    probe.expert_streaming.close()
    code = (
        "import sys, mlx.core as mx, mlx_lm.generate\n"
        "from pathlib import Path\nfrom mlx_lm_streaming.tools.parity import load_streaming\n"
        "g = sys.modules['mlx_lm.generate']\n"
        f"m, _ = load_streaming(Path({str(path)!r}), stats=True, expert_cache_gb={budget!r},\n"
        "                      layer_major_prefill=True)\n"
        "for _ in range(2):\n"
        "    for _ in g.generate_step(mx.array(list(range(40))), m, max_tokens=2,\n"
        "                             prefill_step_size=8, max_kv_size=64):\n"
        "        pass\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = [l for l in done.stderr.splitlines() if "layer-major prefill does not apply" in l]
    assert len(lines) == 1, done.stderr
    assert "RotatingKVCache" in lines[0] and "chunk by chunk" in lines[0]


def test_layer_major_prefill_falls_back_after_a_chunk(checkpoint, monkeypatch):
    # a forward that stops being layer-major at the second chunk: the chunks so far layer-major,
    # the rest chunk by chunk, and the result stock's bits, with the reason said once
    from support import load_stock

    from mlx_lm_streaming.runtime.prefill import layer_major

    path = checkpoint("qwen3_moe")
    generate = generate_step_module()
    prompt = mx.array([(7 * i + 3) % 64 for i in range(42)])
    stock, _ = load_stock(path)
    ref, ref_cache = run_generate_step(stock, generate.generate_step.stock, prompt)
    del stock
    seen = []
    real = layer_major.Recorder.problem

    def problem(self, layers, kv):
        seen.append(1)
        return "injected at the second chunk" if len(seen) == 2 else real(self, layers, kv)

    monkeypatch.setattr(layer_major.Recorder, "problem", problem)
    probe, _ = load_streaming(path)
    budget = budget_of_slots(probe, 3)
    probe.expert_streaming.close()
    model, _ = load_streaming(path, expert_cache_gb=budget, layer_major_prefill=True)
    out, cache = run_generate_step(model, generate.generate_step, prompt)
    assert difference(ref, out) is None, difference(ref, out)
    for a, b in zip(ref_cache, cache):
        for x, y in zip(tree_flatten(a.state), tree_flatten(b.state)):
            assert (x[1] is None and y[1] is None) or mx.array_equal(x[1], y[1])
    state = model.expert_streaming
    assert state.prefill.fallbacks == 1 and "injected" in state.prefill.why
    assert state.prefill.chunks == 1  # the first chunk went layer-major
    state.close()


def test_parity_layer_major_prefill_attention_run_again(checkpoint, monkeypatch):
    # where a part's arguments differ from those routed, it runs again: the attention then writes
    # the same KV entries again, at the chunk's own offset
    from dataclasses import replace

    from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
    from mlx_lm_streaming.runtime.prefill import layer_pass

    monkeypatch.setattr(layer_pass, "_same", lambda a, b: False)
    waves = replace(CacheTuning(), layer_sets=False)  # (layer sets run each layer once anyway)
    path = checkpoint("qwen3_moe")
    generate = generate_step_module()
    prompt = mx.array([(7 * i + 3) % 64 for i in range(42)])
    from support import load_stock

    stock, _ = load_stock(path)
    ref, ref_cache = run_generate_step(stock, generate.generate_step.stock, prompt)
    probe, _ = load_streaming(path, layer_major_prefill=True)
    budget = budget_of_slots(probe, 3)
    probe.expert_streaming.close()
    model, _ = load_streaming(
        path, expert_cache_gb=budget, layer_major_prefill=True, tuning=waves
    )
    out, cache = run_generate_step(model, generate.generate_step, prompt)
    assert difference(ref, out) is None, difference(ref, out)
    for a, b in zip(ref_cache, cache):
        assert all(mx.array_equal(x, y) for x, y in zip(a.state, b.state))
    prefill = model.expert_streaming.prefill
    assert prefill.prompts == 1 and prefill.parts_given == 0 and prefill.attention_run == 12
    model.expert_streaming.close()


def test_layer_major_prefill_batched_and_speculative_fall_back(checkpoint, capsys):
    # mlx-lm's BatchGenerator (the server's batched requests) and a draft model's
    # speculative_generate_step prefill without generate_step: their long prompts prefill as
    # stock (the same tokens as the stock model's), each reason said once in one line
    from support import load_stock

    generate = generate_step_module()
    assert getattr(generate.speculative_generate_step, "mlx_lm_streaming", False)
    path = checkpoint("qwen3_moe")
    prompts = [[(7 * i + 3 + j) % 64 for i in range(40)] for j in range(2)]
    probe, _ = load_streaming(path)
    budget = budget_of_slots(probe, 3)
    probe.expert_streaming.close()
    stock, _ = load_stock(path)
    model, _ = load_streaming(path, expert_cache_gb=budget, layer_major_prefill=True, stats=True)

    def batched(m):
        gen = generate.BatchGenerator(m, max_tokens=3, prefill_step_size=8)
        uids = gen.insert(prompts)
        out = {u: [] for u in uids}
        while any(len(t) < 3 for t in out.values()):
            for r in gen.next_generated():
                out[r.uid].append(r.token)
        gen.close()
        return list(out.values())

    def speculative(m, draft):
        steps = generate.speculative_generate_step(
            mx.array(prompts[0]), m, draft, max_tokens=3, prefill_step_size=8
        )
        return [int(t) for t, *_ in steps]

    assert batched(model) == batched(stock)
    assert speculative(model, stock) == speculative(stock, stock)
    state = model.expert_streaming
    assert state.prefill.prompts == 0 and state.prefill.fallbacks == 3
    lines = [l for l in capsys.readouterr().err.splitlines() if "does not apply" in l]
    assert len(lines) == 2, lines
    assert "BatchGenerator" in lines[0] and "draft model" in lines[1], lines
    # a prompt of one chunk: nothing to reorder, nothing said
    generate.BatchGenerator(model, prefill_step_size=64).insert([prompts[0]])
    assert state.prefill.fallbacks == 3
    state.close()


def test_layer_major_prefill_auto_is_on_with_every_backend():
    # auto: on with every backend (each layer over its whole expert set: stock's own calls);
    # asked for, as asked (the option alone: a benchmark's or test's tuning holds no such switch)
    from mlx_lm_streaming.runtime.options import StreamingOptions

    auto = StreamingOptions()
    assert [auto.use_layer_major_prefill(b) for b in ("cpu", "cuda", "metal")] == [True] * 3
    assert StreamingOptions(layer_major_prefill=True).use_layer_major_prefill("cpu")
    assert not StreamingOptions(layer_major_prefill="off").use_layer_major_prefill("cuda")


@pytest.mark.parametrize("sets", [True, False], ids=["layer_sets", "waves"])
def test_parity_layer_major_prefill_in_groups(checkpoint, sets):
    # held states bounded (CacheTuning.prefill_hold_bytes): the prompt's chunks go layer-major in
    # groups, each group's experts read once, and the result is still stock's bits
    from dataclasses import replace

    from support import load_stock

    from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning

    path = checkpoint("qwen3_moe")
    generate = generate_step_module()
    prompt = mx.array([(7 * i + 3) % 64 for i in range(42)])
    stock, _ = load_stock(path)
    ref, ref_cache = run_generate_step(stock, generate.generate_step.stock, prompt)
    probe, _ = load_streaming(path)
    budget = budget_of_slots(probe, 3)
    probe.expert_streaming.close()
    tuning = replace(CacheTuning(), prefill_hold_bytes=1, layer_sets=sets)
    model, _ = load_streaming(path, expert_cache_gb=budget, tuning=tuning, layer_major_prefill=True)
    out, cache = run_generate_step(model, generate.generate_step, prompt)
    assert difference(ref, out) is None, difference(ref, out)
    for a, b in zip(ref_cache, cache):
        assert all(mx.array_equal(x, y) for x, y in zip(a.state, b.state))
    prefill = model.expert_streaming.prefill
    # a group per chunk: the bound is met at every chunk
    assert (prefill.prompts, prefill.chunks, prefill.groups) == (1, 6, 6)
    model.expert_streaming.close()
