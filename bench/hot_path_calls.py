"""The package's Python calls and host time per MoE layer call of one decode token (issues 29, 46).

    PYTHONPATH=. python bench/hot_path_calls.py [--by-function]

Prints JSON per case: calls into the package on the calling thread in one token (call and check),
host µs per MoE layer to build a token's graph (syncs too), to check it, and stock's build (each
built first in turn: right after an evaluation is slower); cases: docs/benchmarks/methods.md."""

import argparse
import collections
import contextlib
import json
import sys
import tempfile
import threading
from pathlib import Path
from time import perf_counter as now

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's, not installed

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import mlx_lm_streaming  # noqa: E402
from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning  # noqa: E402
from mlx_lm_streaming.tools import parity  # noqa: E402
from synthetic import build_checkpoint  # noqa: E402

PACKAGE = str(Path(mlx_lm_streaming.__file__).resolve().parent) + "/"
PROMPT = mx.array([[3, 17, 42, 5, 9, 101, 7, 64]])
MAX_TOKENS = 200
# decode tokens before any is counted: first calls of a row count choose their kernel once
WARMUP_TOKENS = 3
CASES = {"verified": (15, True), "per_layer_hit": (15, False), "per_layer_miss": (3, False),
         "complete": (16, True)}  # case -> (slots a layer, verified steps on); complete: stock's


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
    probe = parity.load_streaming(path, tuning=tuning)[0]
    budget, _ = parity.budget_of_slots(probe, slots), probe.expert_streaming.close()
    return parity.load_streaming(path, tuning=tuning, expert_cache_gb=budget)[0]


def count(model, case, stock):
    """The calls of the first decode token of ``case`` after the warm-up, by function; host
    seconds ``(build, check, stock's build)`` of the later ones."""
    runner, banks = model.expert_streaming.steps, model.expert_streaming.cache.banks
    kv, stock_kv, calls, times = make_prompt_cache(model), make_prompt_cache(stock), None, []
    mx.eval(model(PROMPT, cache=kv), stock(PROMPT, cache=stock_kv))
    for bank in banks if case == "complete" else ():  # every expert now, not by the fill
        bank.load(np.arange(bank.num_experts))
    clean_before = True
    for token in range(MAX_TOKENS):
        if case == "verified":  # as after tokens that missed nowhere (the CPU's rule), held
            runner.missed_share, runner.defer = 0.0, threading.get_ident()
        verified, replays, misses = runner.verified, runner.replays, [k.misses for k in banks]
        complete, counted = all(k.stock_call is not None for k in banks), collections.Counter()
        x = mx.array([[(37 * token + 11) % 512]])  # complete: every layer straight to stock's
        with counting(counted) if calls is None else contextlib.nullcontext():
            a, b = ((model, kv), (stock, stock_kv))[:: 1 - 2 * (token % 2)]  # each first in turn
            t = [now(), a[0](x, cache=a[1]), now(), b[0](x, cache=b[1]), now()]
            t = t if token % 2 == 0 else [t[2], t[3], t[4], t[1], t[4] + t[2] - t[0]]
            runner.defer, held = None, runner.take_held() if case == "verified" else None
            arrays = [t[1], *(held.arrays() if held else ()), t[3]]  # (as checked_late's)
            t += [mx.eval(*arrays), now()]
            if held is not None and not runner.check(held):
                runner.redo(held)
        t.append(now())
        missed = [b.misses > m for b, m in zip(banks, misses)]
        # a verified step that found every expert resident, after one that did too (its host work
        # is done at the next token's check: the token counted does one step's worth of it)
        clean = runner.verified == verified + 1 and runner.replays == replays and not any(missed)
        found = {"verified": clean and clean_before, "per_layer_hit": not any(missed),
                 "per_layer_miss": all(missed), "complete": complete}[case]  # fmt: skip
        if token >= WARMUP_TOKENS and found and calls is not None:
            times.append((t[2] - t[0], t[7] - t[6], t[4] - t[2]))  # build, check, stock's build
        elif token >= WARMUP_TOKENS and found:
            calls = dict(counted)
        clean_before = clean
    if not times:
        raise RuntimeError(f"fewer than two decode tokens of case {case} in {MAX_TOKENS}")
    return calls, np.median(times, axis=0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--by-function", action="store_true")
    args = parser.parse_args(argv)
    result = {"per_moe_layer_call": {}, "host_us_per_moe_layer": {}, "by_function": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "q3"
        build_checkpoint(path, "qwen3_moe", "affine4", num_layers=3, overrides={"experts": 16})
        stock = parity.load_stock(path)[0]
        for case, (slots, verified_steps) in CASES.items():
            model = load(path, slots, verified_steps)
            calls, seconds = count(model, case, stock)
            result["moe_layers"] = layers = len(model.expert_streaming.cache.banks)
            result["per_moe_layer_call"][case] = round(sum(calls.values()) / layers, 1)
            us = dict(zip(("build", "check", "stock_build"), np.round(seconds * 1e6 / layers, 1)))
            us["ours_over_stock"] = round((us["build"] + us["check"]) / us["stock_build"], 2)
            result["host_us_per_moe_layer"][case] = us
            result["by_function"][case] = dict(sorted(calls.items(), key=lambda c: (-c[1], c[0])))
            model.expert_streaming.close()
    args.by_function or result.pop("by_function")  # (its table only where asked for)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
