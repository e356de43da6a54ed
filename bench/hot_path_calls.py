"""The package's Python function calls per MoE layer call, on one decode token (issue 29, item 4).

A 3-layer qwen3_moe synthetic checkpoint (16 experts of top 2, affine 4-bit) on the CPU. For each
case, decode tokens until one is of the case, and count the calls into ``mlx_lm_streaming`` code
made on the calling thread during that token's model call (``sys.setprofile``: every Python
function called or generator resumed whose code lives in the package; C functions and mlx-lm's
own code not counted), divided by the MoE layers:

- ``verified``: a verified step that found every expert resident, after one that did too (its host
  work is done at the next token's check, so the token counted does one step's worth of it);
- ``per_layer_hit``: the per-layer schedule (verified steps off), no layer missed;
- ``per_layer_miss``: the per-layer schedule with 3 slots a layer, every layer missed.

Run from a checkout: ``PYTHONPATH=. python bench/hot_path_calls.py`` prints JSON; ``--by-function``
adds each case's calls by function.
"""

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, not an installed one

import mlx.core as mx  # noqa: E402
import mlx_lm.utils  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import mlx_lm_streaming  # noqa: E402
from mlx_lm_streaming.runtime.expert_cache import CacheTuning  # noqa: E402
from mlx_lm_streaming.integration.integration import install  # noqa: E402
from mlx_lm_streaming.option_table import GB  # noqa: E402
from synthetic import build_checkpoint  # noqa: E402

PACKAGE = os.path.dirname(os.path.abspath(mlx_lm_streaming.__file__)) + os.sep
PROMPT = mx.array([[3, 17, 42, 5, 9, 101, 7, 64]])
MAX_TOKENS = 200
# decode tokens before any is counted: first calls of a row count choose their kernel once
WARMUP_TOKENS = 3


class CallCounter:
    """Calls into the package's code on this thread while active, by function."""

    def __init__(self):
        self.calls = collections.Counter()

    def _profile(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(PACKAGE):
                name = code.co_filename[len(PACKAGE) :]
                self.calls[f"{name}:{code.co_qualname}"] += 1

    def __enter__(self):
        self.calls.clear()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        return False


def load(path, slots, **tuning):
    """The streaming model of ``path`` with ``slots`` slots a layer and these ``CacheTuning``
    settings."""
    install()
    options = {"tuning": CacheTuning(**tuning)}
    probe, _ = mlx_lm.utils.load_model(path, model_config={"streaming_experts": options})
    per_slot = sum(b.layer.expert_nbytes for b in probe.expert_streaming.cache.banks)
    probe.expert_streaming.close()
    options["expert_cache_gb"] = (slots * per_slot + 0.5) / GB
    model, _ = mlx_lm.utils.load_model(path, model_config={"streaming_experts": options})
    return model


def count(model, accept, prepare=None):
    """The calls of the first decode token ``accept(before, after)`` takes, by function, and the
    MoE layers. ``before`` / ``after``: the streaming counters around the token's call."""
    streaming = model.expert_streaming
    cache, runner = streaming.cache, streaming.steps
    banks = cache.banks
    kv = make_prompt_cache(model)
    mx.eval(model(PROMPT, cache=kv))
    counter = CallCounter()
    last = None
    for token in range(MAX_TOKENS):
        if prepare is not None:
            prepare(runner)
        before = (runner.verified, runner.replays, [b.misses for b in banks])
        tokens = mx.array([[(37 * token + 11) % 512]])
        with counter:
            out = model(tokens, cache=kv)
            mx.eval(out)
        after = (runner.verified, runner.replays, [b.misses for b in banks])
        if token >= WARMUP_TOKENS and accept(before, after, last):
            return dict(counter.calls), len(banks)
        last = (before, after)
    raise RuntimeError("no decode token of this case within MAX_TOKENS tokens")


def verified_clean(before, after, last=None):
    return (
        after[0] == before[0] + 1
        and after[1] == before[1]
        and after[2] == before[2]
        and (last is None or verified_clean(*last))
    )


def every_layer_missed(before, after, last):
    return all(a > b for a, b in zip(after[2], before[2]))


def no_layer_missed(before, after, last):
    return after[2] == before[2]


def allow_verified(runner):
    runner.missed_share = 0.0  # as after a run of tokens that missed nowhere (the CPU's rule)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--by-function", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(
            Path(tmp) / "q3", "qwen3_moe", "affine4", num_layers=3, overrides={"experts": 16}
        )
        cases = {
            "verified": (load(path, 15), verified_clean, allow_verified),
            "per_layer_hit": (load(path, 15, verified_steps=False), no_layer_missed, None),
            "per_layer_miss": (load(path, 3, verified_steps=False), every_layer_missed, None),
        }
        result = {"per_moe_layer_call": {}, "by_function": {}}
        for name, (model, accept, prepare) in cases.items():
            calls, layers = count(model, accept, prepare)
            result["per_moe_layer_call"][name] = round(sum(calls.values()) / layers, 1)
            result["moe_layers"] = layers
            if args.by_function:
                result["by_function"][name] = dict(
                    sorted(calls.items(), key=lambda kv: (-kv[1], kv[0]))
                )
            model.expert_streaming.close()
    if not args.by_function:
        del result["by_function"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
