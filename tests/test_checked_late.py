"""Decode with each token's check one token late (checked_late.py): token t+1 built on t's sample
before t's verified step is checked, t+1 taken back when t missed.

Every test runs mlx-lm's own ``generate_step`` (wrapped) against the stock function over the stock
model, greedy and sampled (temperature, top-p, a seed, a repetition penalty), with budgets that make
verified steps miss, and counts the path taken: steps checked late and next tokens taken back.
"""

import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from support import load_stock, with_slots

from mlx_lm_streaming.runtime import mlx_compat
from mlx_lm_streaming.runtime.decode import checked_late
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from synthetic import build_checkpoint

STEPS = 20
# a verified step wherever one may run, whatever the share limits say (``share_limits.way``), held
# for a late check whatever the share of tokens that missed
ALWAYS = CacheTuning(verify_choice="always", checked_late=1.0)


def generate_module():
    import mlx_lm.generate  # noqa: F401 (mlx_lm's __init__ shadows the name with a function)

    return sys.modules["mlx_lm.generate"]


def generated(model, prompt, seed=None, steps=STEPS, **kwargs):
    """Tokens and log-probabilities of ``generate_step`` (the wrapped one for a streaming model,
    the stock one else); ``seed``: sampled at temperature 0.9, top-p 0.9, a repetition penalty,
    MLX's random state seeded first."""
    generate = generate_module()
    step = generate.generate_step
    if not hasattr(model, "expert_streaming"):
        step = getattr(step, "stock", step)
    if seed is not None:
        mx.random.seed(seed)
        kwargs.setdefault("sampler", make_sampler(temp=0.9, top_p=0.9))
        kwargs.setdefault("logits_processors", make_logits_processors(repetition_penalty=1.3))
    return [
        (int(t), np.array(lp)) for t, lp in step(prompt, model, max_tokens=steps, **kwargs)
    ]


def assert_same(expected, got):
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(expected, got):
        assert np.array_equal(a, b)


def prompt_of(seed: int, n: int = 8) -> mx.array:
    """A random prompt: its tokens move where the verified steps miss."""
    return mx.array(np.random.default_rng(seed).integers(0, 512, n).astype(np.int32))


def cache_after(model, prompt, use, **kwargs):
    """The prompt cache's keys (each entry's, to its offset) after ``use(generator)`` of a
    ``generate_step`` over ``model`` (the wrapped one for a streaming model, stock's else) and a new
    cache, and what ``use`` returned."""
    step = generate_module().generate_step
    if not hasattr(model, "expert_streaming"):
        step = step.stock
    kv = make_prompt_cache(model)
    out = use(step(prompt, model, max_tokens=STEPS, prompt_cache=kv, **kwargs), kv)
    return [np.array(c.keys[..., : c.offset, :]) for c in kv], out


@pytest.fixture(scope="module")
def stock_q3(q3_path):
    return load_stock(q3_path)[0]


@pytest.mark.parametrize("slots", [3, 8, 15])
@pytest.mark.parametrize("seed", [None, 0, 5])
@pytest.mark.parametrize("prompt_seed", [1, 2])
def test_late_checks_are_stock_across_misses(q3_path, stock_q3, slots, seed, prompt_seed):
    # 3, 8, 15 of 16 experts per layer: tokens miss at positions set by the prompt; greedy and
    # sampled text, log-probabilities bit for bit
    prompt = prompt_of(prompt_seed)
    expected = generated(stock_q3, prompt, seed)
    model = with_slots(q3_path, slots, tuning=ALWAYS)
    assert_same(expected, generated(model, prompt, seed))
    runner = model.expert_streaming.steps
    assert runner.checked_late > 0
    if slots < 15:
        assert runner.dropped > 0  # a miss took the next token back
    assert runner.recomputed == 0


@pytest.mark.parametrize("chunk", [2, 2048])
def test_the_first_tokens_step_is_held_too_and_the_prompts_progress_is_stocks(
    q3_path, stock_q3, chunk
):
    # the prompt's last token's step (stock's code up to its draw) is held like every later one,
    # so the second token is built before the first is checked, and the progress callback gets
    # stock's calls; after a layer-major prefill (chunks of 2) that step runs per layer
    # (``StepRunner.per_layer_calls``) and the callback counts the prefill's own way, its last
    # call stock's
    prompt = prompt_of(2)

    def run(model):
        calls = []
        out = generated(model, prompt, 0, prefill_step_size=chunk,
                        prompt_progress_callback=lambda *c: calls.append(c))  # fmt: skip
        return out, calls

    expected, stock_calls = run(stock_q3)
    model = with_slots(q3_path, 15, tuning=ALWAYS)
    got, calls = run(model)
    assert_same(expected, got)
    assert calls[-1] == stock_calls[-1] == (len(prompt), len(prompt))
    layer_major = model.expert_streaming.prefill.prompts == 1
    assert layer_major == (chunk == 2) and (calls == stock_calls) != layer_major
    # every step built held (the one built ahead of the last too), the first but after a prefill
    assert model.expert_streaming.steps.checked_late == STEPS + 1 - layer_major


@pytest.mark.parametrize("seed,in_pass", [(None, False), (5, False), (None, True), (5, True)])
def test_held_steps_redone_as_their_reads_land_are_stock(q3_path, stock_q3, seed, in_pass):
    # ``replay_as_landed``: a held step that missed is redone with each bank's landings taken by
    # its own layer as the layers run again (``in_pass``: the reads of the redo's later checks
    # issued as each call's ids come back); greedy and sampled text, log-probabilities bit for bit
    prompt = prompt_of(3)
    expected = generated(stock_q3, prompt, seed)
    tuning = CacheTuning(verify_choice="always", checked_late=1.0, replay_as_landed=True,
                         lookahead_min_precision=0.0, reads_in_pass=in_pass)  # fmt: skip
    model = with_slots(q3_path, 3, tuning=tuning)
    assert_same(expected, generated(model, prompt, seed))
    runner = model.expert_streaming.steps
    assert runner.checked_late > 0 and runner.dropped > 0 and runner.replays > 0
    assert runner.recomputed == 0


def test_without_the_random_key_put_back_sampled_text_is_not_stock(
    q3_path, stock_q3, monkeypatch
):
    # the test above can fail: a token run again after a miss must draw with the key of its first
    # draw, not the one after the dropped token's
    prompt = prompt_of(1)
    expected = generated(stock_q3, prompt, 0)
    monkeypatch.setattr(checked_late, "_put_back_key", lambda key: None)
    model = with_slots(q3_path, 3, tuning=ALWAYS)
    got = generated(model, prompt, 0)
    assert model.expert_streaming.steps.dropped > 0
    assert [t for t, _ in got] != [t for t, _ in expected]


def test_without_the_next_tokens_cache_taken_back_text_is_not_stock(
    q3_path, stock_q3, monkeypatch
):
    # and a dropped token's KV entries must go: left, the token run again attends to them
    prompt = prompt_of(1)
    expected = generated(stock_q3, prompt)
    monkeypatch.setattr(checked_late, "_take_back", lambda kv, token: None)
    model = with_slots(q3_path, 3, tuning=ALWAYS)
    got = generated(model, prompt)
    assert model.expert_streaming.steps.dropped > 0
    assert any(not np.array_equal(a, b) for (_, a), (_, b) in zip(expected, got))


@pytest.mark.parametrize("stop,end", [(1, "close"), (2, "close"), (3, "close"), (5, "close"),
                                      (8, "close"), (7, "throw")])  # fmt: skip
def test_a_closed_generator_leaves_the_prompt_cache_as_stock(q3_path, stock_q3, stop, end):
    # the server and chat keep the prompt cache: the step held when the caller stops (closes the
    # generator, or throws its own error in where it waits) must be checked, and run again if it
    # missed, before the cache is used again
    prompt = prompt_of(3)

    def run(model):
        def use(gen, kv):
            for _ in range(stop):
                next(gen)
            if end == "close":
                gen.close()
            else:
                with pytest.raises(KeyError, match="caller"):
                    gen.throw(KeyError("the caller's own error"))
            # the next generation over that cache
            return generated(model, mx.array([7]), steps=4, prompt_cache=kv)

        return cache_after(model, prompt, use)

    ref_keys, ref_after = run(stock_q3)
    model = with_slots(q3_path, 3, tuning=ALWAYS)
    keys, after = run(model)
    assert_same(ref_after, after)
    assert all(np.array_equal(a, b) for a, b in zip(ref_keys, keys))
    assert model.expert_streaming.steps.checked_late > 1


def test_a_first_draw_that_raises_leaves_the_prompt_cache_as_stock(q3_path, stock_q3):
    # the first token's step is held: a sampler that raises at its first draw must not leave that
    # step's cache entries unchecked (three slots: the step misses)
    prompt = prompt_of(3)

    class Raises:  # (it says how to take draws back: late checks apply)
        def take_back(self, n):
            pass

        def __call__(self, logprobs):
            raise ValueError("the sampler's own error")

    raises = Raises()

    def use(gen, kv):
        with pytest.raises(ValueError, match="own error"):
            next(gen)

    want = cache_after(stock_q3, prompt, use, sampler=raises)[0]
    model = with_slots(q3_path, 3, tuning=ALWAYS)
    got = cache_after(model, prompt, use, sampler=raises)[0]
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(want, got))
    assert model.expert_streaming.steps.checked_late == 1


class TakesBack:
    """A sampler with state of its own (the draws it made), which says how to take draws back."""

    def __init__(self, take_back=True):
        self.draws = []
        if take_back:
            self.take_back = lambda n: self.draws.__delitem__(slice(len(self.draws) - n, None))

    def __call__(self, logprobs):
        self.draws.append(logprobs)
        return mx.argmax(logprobs, axis=-1)


def test_a_sampler_with_state_takes_its_draws_back_or_the_loop_is_stocks(q3_path, stock_q3):
    prompt = prompt_of(1)
    expected = generated(stock_q3, prompt)
    model = with_slots(q3_path, 3, tuning=ALWAYS)
    sampler = TakesBack()
    assert_same(expected, generated(model, prompt, sampler=sampler))
    assert model.expert_streaming.steps.dropped > 0
    # one draw per token yielded, the first step's and the one built ahead of the last included
    assert len(sampler.draws) == STEPS + 1
    for d, (_, lp) in zip(sampler.draws, expected):
        assert np.array_equal(np.array(d.squeeze(0)), lp)
    # one that cannot: each step checked in its own call, as before
    model = with_slots(q3_path, 3, tuning=ALWAYS)
    assert_same(expected, generated(model, prompt, sampler=TakesBack(take_back=False)))
    runner = model.expert_streaming.steps
    assert runner.checked_late == 0 and runner.verified > 0


def test_where_late_checks_do_not_apply(q3_path):
    model = with_slots(q3_path, 3)
    state = model.expert_streaming
    stock = generate_module().generate_step.stock
    a = dict(kv_bits=None, input_embeddings=None, max_tokens=4, sampler=None,
             logits_processors=None)  # fmt: skip
    assert checked_late.problem(stock, a, state) is None
    assert "quantized" in checked_late.problem(stock, {**a, "kv_bits": 4}, state)
    assert "embeddings" in checked_late.problem(stock, {**a, "input_embeddings": 1}, state)
    assert "state" in checked_late.problem(stock, {**a, "sampler": lambda lp: lp}, state)
    off = with_slots(q3_path, 3, tuning=CacheTuning(checked_late=None)).expert_streaming
    assert "off" in checked_late.problem(stock, a, off)
    # the loop it runs is stock's (mlx_compat.DECODE_LOOP_BODY); a changed one is named
    assert mlx_compat.decode_loop_problem(stock) is None

    def generate_step(prompt, model, stream=None, *, max_tokens=256, sampler=None,
                      logits_processors=None, max_kv_size=None, prompt_cache=None,
                      prefill_step_size=2048, kv_bits=None, prompt_progress_callback=None,
                      input_embeddings=None):  # fmt: skip
        yield model(prompt)

    assert "no longer does" in mlx_compat.decode_loop_problem(generate_step)


def test_steps_are_held_while_few_recent_tokens_missed(q3_path, stock_q3):
    # three slots of 16: nearly every token misses; after the first misses the steps are checked in
    # their own calls again (a held step that misses costs the next token's forward), still stock
    prompt = prompt_of(1)
    expected = generated(stock_q3, prompt, 0)
    model = with_slots(q3_path, 3, tuning=CacheTuning(verify_choice="always"))
    assert_same(expected, generated(model, prompt, 0))
    runner = model.expert_streaming.steps
    assert 0 < runner.checked_late < STEPS // 2
    assert runner.missed_tokens > CacheTuning().checked_late


def test_late_checks_off_check_each_step_in_its_call(q3_path, stock_q3):
    prompt = prompt_of(1)
    expected = generated(stock_q3, prompt, 0)
    tuning = CacheTuning(verify_choice="always", checked_late=None)
    model = with_slots(q3_path, 3, tuning=tuning)
    assert_same(expected, generated(model, prompt, 0))
    runner = model.expert_streaming.steps
    assert runner.checked_late == runner.dropped == 0 and runner.replays > 0


@pytest.mark.parametrize("seed", [None, 0])
def test_checks_on_the_runners_thread_take_the_same_path_as_on_the_decode_thread(
    q3_path, stock_q3, monkeypatch, seed
):
    # 8 slots of 16: held steps hit and miss; the host work of those that hit runs on the
    # runner's thread, and every count of the path taken is the one the decode thread's checks
    # give, the text stock's
    from mlx_lm_streaming.runtime.decode.verified_step import VerifiedStep

    threads, commit = set(), VerifiedStep.commit

    def recorded(step, cache):
        threads.add(threading.get_ident())
        return commit(step, cache)

    monkeypatch.setattr(VerifiedStep, "commit", recorded)
    prompt = prompt_of(2)
    expected = generated(stock_q3, prompt, seed)
    counts = []
    for on_thread in (True, False):
        threads.clear()
        tuning = CacheTuning(verify_choice="always", checked_late=1.0, check_on_thread=on_thread)
        model = with_slots(q3_path, 8, tuning=tuning)
        assert_same(expected, generated(model, prompt, seed))
        runner = model.expert_streaming.steps
        counts.append((runner.checked_late, runner.dropped, runner.verified, runner.replays))
        assert bool(threads - {threading.get_ident()}) == on_thread
        assert (runner.checker is not None) == on_thread
        assert model.expert_streaming.cache.stats.hits > 0
        model.expert_streaming.close()  # (the check's thread too)
        assert runner.checker is None or runner.checker._shutdown
    assert counts[0] == counts[1] and counts[0][0] > counts[0][1] > 0


def test_the_checks_thread_and_landings_as_the_layers_run_are_mlx_cudas_unless_said():
    # None: on mlx-cuda only (measured there: docs/benchmarks/streaming-path.md); said: as said
    from types import SimpleNamespace as NS

    from mlx_lm_streaming.runtime.decode.runner import StepRunner

    for backend, said, want in [("cuda", None, True), ("cpu", None, False), ("metal", None, False),
                                ("cpu", True, True), ("cuda", False, False)]:
        for field, attr in [("check_on_thread", "check_thread"), ("replay_as_landed", "as_landed"),
                            ("reads_in_pass", "in_pass"), ("first_call_reads", "look_first")]:
            state = NS(cache=NS(tuning=CacheTuning(**{field: said})), selector=NS(backend=backend))
            assert getattr(StepRunner(state), attr) is want, (field, backend, said)


# -- other architectures, hybrids among them -------------------------------------------------------

# qwen3_next: linear attention (ArraysCache) in layers 0 and 2; nemotron_h: Mamba-2 layers between
# MoE layers; the others attention only, with shared experts (deepseek_v3, qwen2_moe) or not
# (gemma-4's layers give tuples and are run again from the layer that missed; with KV-shared
# layers, or kimi_k3 with residual blocks, a miss reads and runs the call again whole)
ARCHS = ["mixtral", "deepseek_v3", "qwen2_moe", "qwen3_next", "nemotron_h", "gemma4_text",
         "gemma4_text-kv-shared", "kimi_k3-attn-res"]  # fmt: skip
VARIANTS = {"gemma4_text": {"sliding_window": 64},  # (a window past the tokens: caches rewind)
            "gemma4_text-kv-shared": {"sliding_window": 64, "num_kv_shared_layers": 2},
            "kimi_k3-attn-res": {"attn_res_block_size": 2}}  # fmt: skip


@pytest.fixture(scope="module")
def arch_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("checked-late")

    class Paths(dict):
        def __missing__(self, arch):
            layers, overrides = 4, {"experts": 16, **VARIANTS.get(arch, {})}
            if arch == "nemotron_h":
                layers = 6
                overrides["layer_types"] = ["mamba", "moe", "mamba", "moe", "attention", "moe"]
            name = arch.split("-")[0]
            self[arch] = build_checkpoint(root / arch, name, num_layers=layers, overrides=overrides)
            return self[arch]

    return Paths()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [None, 3])
def test_late_checks_are_stock_across_architectures(arch_paths, arch, seed):
    path = arch_paths[arch]
    stock, _ = load_stock(path)
    prompt = prompt_of(4)
    expected = generated(stock, prompt, seed, steps=12)
    model = with_slots(path, 3, tuning=ALWAYS)
    assert_same(expected, generated(model, prompt, seed, steps=12))
    runner = model.expert_streaming.steps
    assert runner.checked_late > 0 and runner.dropped > 0


def test_stream_generate_sampled_with_a_prompt_cache_is_stock(q3_path, stock_q3):
    # the chat and server path: stream_generate with a sampler, a seed and a prompt cache kept
    # across two turns
    from mlx_lm import stream_generate
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(q3_path)

    def turns(model):
        kv, out = make_prompt_cache(model), []
        for prompt in ([3, 17, 42, 5], [9, 101, 7]):
            mx.random.seed(11)
            for r in stream_generate(model, tokenizer, prompt, max_tokens=10, prompt_cache=kv,
                                     sampler=make_sampler(temp=1.0, top_p=0.95)):  # fmt: skip
                out.append((r.token, np.array(r.logprobs)))
        return out

    expected = turns(stock_q3)
    model = with_slots(q3_path, 8, tuning=ALWAYS)
    assert_same(expected, turns(model))
    runner = model.expert_streaming.steps
    assert runner.checked_late > 0 and runner.dropped > 0


@pytest.mark.parametrize("at,thread", [(3, False), (6, False), (11, False), (6, True)])
def test_a_later_draw_that_raises_leaves_the_prompt_cache_as_stock(q3_path, stock_q3, at, thread):
    # a sampler that raises at a later draw (draws taken back with the tokens dropped, as
    # ``TakesBack``): the steps held then (the token before, and the step whose draw raised) are
    # settled before the error goes on, so every entry the prompt cache keeps is stock's; where the
    # token before missed, the raising step's entries go with its draw (one entry short of stock's);
    # ``thread``: the token before's check started on the runner's thread (mlx-cuda's way)
    prompt = prompt_of(3)

    class RaisesAt:
        def __init__(self):
            self.draws = 0

        def take_back(self, n):
            self.draws -= n

        def __call__(self, logprobs):
            self.draws += 1
            if self.draws == at:
                raise ValueError("the sampler's own error")
            return mx.argmax(logprobs, axis=-1)

    def use(gen, kv):
        with pytest.raises(ValueError, match="own error"):
            for _ in gen:
                pass

    want = cache_after(stock_q3, prompt, use, sampler=RaisesAt())[0]
    tuning = CacheTuning(verify_choice="always", checked_late=1.0, check_on_thread=thread)
    model = with_slots(q3_path, 3, tuning=tuning)
    got = cache_after(model, prompt, use, sampler=RaisesAt())[0]
    assert model.expert_streaming.steps.checked_late > 1
    assert len(got) == len(want)
    for a, b in zip(want, got):
        assert b.shape[-2] in (a.shape[-2], a.shape[-2] - 1)
        assert np.array_equal(a[..., : b.shape[-2], :], b)
