"""The package's Python function calls per MoE layer call, on one decode token (issue 29, item 4).

    PYTHONPATH=. python bench/hot_path_calls.py [--by-function]

Prints JSON: for a verified step, a per-layer step that hit and one that missed, the calls into
``mlx_lm_streaming`` code on the calling thread during one decode token, divided by the MoE layers
(``--by-function``: each case's calls by function too); a 3-layer qwen3_moe checkpoint on the CPU.
The counts are deterministic. Each case: docs/benchmarks/methods.md (hot_path_calls.py).
"""

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, not an installed one

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import mlx_lm_streaming  # noqa: E402
from mlx_lm_streaming.runtime.expert_cache import CacheTuning  # noqa: E402
from mlx_lm_streaming.tools import parity  # noqa: E402
from synthetic import build_checkpoint  # noqa: E402

PACKAGE = os.path.dirname(os.path.abspath(mlx_lm_streaming.__file__)) + os.sep
PROMPT = mx.array([[3, 17, 42, 5, 9, 101, 7, 64]])
MAX_TOKENS = 200
# decode tokens before any is counted: first calls of a row count choose their kernel once
WARMUP_TOKENS = 3
# case -> (slots a layer, verified steps on)
CASES = {"verified": (15, True), "per_layer_hit": (15, False), "per_layer_miss": (3, False),
         "complete": (16, True)}  # (every bank complete: stock's graph)


@contextlib.contextmanager
def counting(calls):
    """Counts into ``calls`` the calls into the package's code on this thread, by function."""

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(PACKAGE):
            calls[f"{code.co_filename[len(PACKAGE):]}:{code.co_qualname}"] += 1

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


def load(path, slots, verified_steps):
    """The streaming model of ``path`` with ``slots`` slots a layer."""
    tuning = CacheTuning(verified_steps=verified_steps)
    probe, _ = parity.load_streaming(path, tuning=tuning)
    budget = parity.budget_of_slots(probe, slots)
    probe.expert_streaming.close()
    return parity.load_streaming(path, tuning=tuning, expert_cache_gb=budget)[0]


def count(model, case):
    """The calls of the first decode token of ``case`` after the warm-up, by function."""
    runner, banks = model.expert_streaming.steps, model.expert_streaming.cache.banks
    kv = make_prompt_cache(model)
    mx.eval(model(PROMPT, cache=kv))
    if case == "complete":  # every expert read now, not by the background fill (timing-free)
        for bank in banks:
            bank.load(np.arange(bank.num_experts))
    clean_before = True
    for token in range(MAX_TOKENS):
        if case == "verified":
            runner.missed_share = 0.0  # as after tokens that missed nowhere (the CPU's rule)
        verified, replays, misses = runner.verified, runner.replays, [b.misses for b in banks]
        stock = all(b.stock_call is not None for b in banks)  # every layer straight to stock's
        calls = collections.Counter()
        with counting(calls):
            mx.eval(model(mx.array([[(37 * token + 11) % 512]]), cache=kv))
        missed = [b.misses > m for b, m in zip(banks, misses)]
        # a verified step that found every expert resident, after one that did too (its host work
        # is done at the next token's check: the token counted does one step's worth of it)
        clean = runner.verified == verified + 1 and runner.replays == replays and not any(missed)
        found = {"verified": clean and clean_before, "per_layer_hit": not any(missed),
                 "per_layer_miss": all(missed), "complete": stock}[case]  # fmt: skip
        if token >= WARMUP_TOKENS and found:
            return dict(calls)
        clean_before = clean
    raise RuntimeError(f"no decode token of case {case} within MAX_TOKENS tokens")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--by-function", action="store_true")
    args = parser.parse_args(argv)
    result = {"per_moe_layer_call": {}, "by_function": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "q3"
        build_checkpoint(path, "qwen3_moe", "affine4", num_layers=3, overrides={"experts": 16})
        for case, (slots, verified_steps) in CASES.items():
            model = load(path, slots, verified_steps)
            calls = count(model, case)
            layers = len(model.expert_streaming.cache.banks)
            result["per_moe_layer_call"][case] = round(sum(calls.values()) / layers, 1)
            result["moe_layers"] = layers
            ranked = sorted(calls.items(), key=lambda kv: (-kv[1], kv[0]))
            result["by_function"][case] = dict(ranked)
            model.expert_streaming.close()
    if not args.by_function:
        del result["by_function"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
