"""Check that streaming gives the stock model's logits bit for bit: ``mlx_lm_streaming verify MODEL``.

The same prompts and greedy decode (with a KV cache) run through the stock model and through a
streaming one at each budget asked for; every step's logits must be finite and exactly equal. For a
model that fits in memory twice over (both are loaded), on the machine and backend you will use. The
test suite's parity table and the GPU benchmarks run this code too.
"""

from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from ..option_table import GB

DECODE_STEPS = 8


def load_stock(path):
    """The stock model, whatever the environment asks for."""
    import mlx_lm.utils

    from ..integration.integration import install

    install()
    return mlx_lm.utils.load_model(path, model_config={"streaming_experts": False})


def load_streaming(path, **options):
    import mlx_lm.utils

    from ..integration.integration import install

    install()
    return mlx_lm.utils.load_model(path, model_config={"streaming_experts": options})


def vocab_size(config: dict) -> int:
    return config.get("vocab_size") or config["text_config"]["vocab_size"]


def prompts(batch: int, vocab: int) -> mx.array:
    """``batch`` rows of 24 tokens: at batch 2 and top-k >= 2, 64 or more indices take mlx-lm's
    sorted gather path; decode steps take the unsorted one."""
    rows = [[(7 * i + 13 * b + 1) % vocab for i in range(24)] for b in range(batch)]
    return mx.array(rows)


def run(model, tokens, steps: int = DECODE_STEPS, by_token: bool = False) -> List[mx.array]:
    """Prompt logits, then greedy decode with a KV cache; every step's logits. ``by_token``: the
    prompt is fed one token at a time (stock mlx-cuda 0.32.4 is deterministic only so)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if by_token:
        logits = mx.concatenate(
            [model(tokens[:, i : i + 1], cache=cache) for i in range(tokens.shape[1])], axis=1
        )
    else:
        logits = model(tokens, cache=cache)
    out = [logits]
    for _ in range(steps):
        nxt = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        logits = model(nxt, cache=cache)
        out.append(logits)
    mx.eval(out)
    return out


def difference(stock_out: Sequence[mx.array], stream_out: Sequence[mx.array]) -> Optional[str]:
    """None if every step's logits are finite and bit-identical, else the first difference in words.
    NaN or inf on both sides is a difference: a model that computes NaN proves nothing."""
    if len(stock_out) != len(stream_out):
        return f"{len(stock_out)} steps from stock, {len(stream_out)} from streaming"
    for step, (a, b) in enumerate(zip(stock_out, stream_out)):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"step {step}: {a.dtype}{a.shape} from stock, {b.dtype}{b.shape} from streaming"
        for side, x in (("stock", a), ("streaming", b)):
            bad = x.size - mx.isfinite(x).sum().item()
            if bad:
                return f"step {step}: {bad} non-finite logits in {side}"
        if not mx.array_equal(a, b).item():
            return f"step {step}: logits differ (max abs diff {mx.abs(a - b).max().item()})"
    return None


def budget_of_slots(model, slots: int) -> float:
    """The budget in GB that holds ``slots`` experts of every MoE layer."""
    banks = model.expert_streaming.cache.banks
    return (slots * sum(b.layer.expert_nbytes for b in banks) + 0.5) / GB


def compare(
    path,
    budgets: Dict[str, Optional[float]],
    batches: Sequence[int] = (1, 2),
    steps: int = DECODE_STEPS,
    by_token: bool = False,
    on_model=None,
    **options,
) -> List[dict]:
    """Stock against streaming at each named budget (GB; None: the default one). Returns one row per
    (budget, batch): ``{"budget", "batch", "difference"}`` (``difference`` None where exact).
    ``on_model(name, model)``: called with each streaming model after its runs (tests inspect it)."""
    stock, config = load_stock(path)
    vocab = vocab_size(config)
    expected = {b: run(stock, prompts(b, vocab), steps, by_token) for b in batches}
    del stock
    rows = []
    for name, budget in budgets.items():
        model, _ = load_streaming(path, expert_cache_gb=budget, **options)
        for b in batches:
            got = run(model, prompts(b, vocab), steps, by_token)
            rows.append({"budget": name, "batch": b, "difference": difference(expected[b], got)})
        if on_model is not None:
            on_model(name, model)
        model.expert_streaming.close()
    return rows


# -- the subcommand ------------------------------------------------------------------------------


def _budget_gb(value: str) -> float:
    import argparse

    from ..errors import ConfigurationError
    from ..runtime.options import check_budget_gb

    try:
        return check_budget_gb(value)
    except ConfigurationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(value: str) -> int:
    import argparse

    try:
        steps = int(value)
    except ValueError:
        steps = 0
    if steps < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: give a whole number of steps, 1 or more")
    return steps


def add_arguments(parser) -> None:
    parser.add_argument("model", help="model directory")
    parser.add_argument(
        "--expert-cache-gb",
        type=_budget_gb,
        action="append",
        metavar="GB",
        help="budget to check (repeatable); default: every expert, and 3 experts per layer "
        "(evictions within a call)",
    )
    parser.add_argument(
        "--steps", type=_positive_int, default=DECODE_STEPS, help="greedy decode steps (1 or more)"
    )
    parser.add_argument(
        "--prompt-by-token", action="store_true", help="feed the prompt one token at a time"
    )


def run_verify(args) -> int:
    from pathlib import Path

    from ..integration.integration import load_to_stream
    from ..runtime.options import StreamingOptions
    from ..runtime.sizes import gb_as_given

    path = Path(args.model)
    # as plan and pack: a model that cannot stream is our one-line error here (a load that asks
    # for streaming would load a dense model as stock, or suggest a flag verify does not take)
    probe, _ = load_to_stream(path, StreamingOptions())
    if args.expert_cache_gb:
        budgets = {f"{gb_as_given(gb)} GB": gb for gb in args.expert_cache_gb}
    else:
        cache = probe.expert_streaming.cache
        smallest = min(b.num_experts for b in cache.banks)
        budgets = {"every expert": (cache.total_expert_bytes + 0.5) / GB}
        if smallest > 3:
            budgets["3 experts per layer"] = budget_of_slots(probe, 3)
    probe.expert_streaming.close()
    del probe
    rows = compare(path, budgets, steps=args.steps, by_token=args.prompt_by_token)
    for row in rows:
        verdict = "exact" if row["difference"] is None else f"DIFFERENT: {row['difference']}"
        print(f"budget {row['budget']}, batch {row['batch']}: {verdict}")
    return 0 if all(r["difference"] is None for r in rows) else 1
