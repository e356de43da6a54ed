"""Generate text with the model split across MLX distributed ranks, routed experts streamed per rank.

``mlx_lm.generate`` runs in one process only. This is the same generation through stock mlx-lm APIs
(``sharded_load(path, pipeline_group=group)``, then ``stream_generate``), to be started by ``mlx.launch``::

    mlx.launch -n 2 --backend ring --python "$(which python)" -- \\
        -m mlx_lm_streaming.pipeline_generate --model PATH --prompt "Tell me a story" \\
        --streaming-experts --expert-cache-gb 4 --streaming-stats

(``--python PY`` makes each rank run ``PY -m mlx_lm_streaming.pipeline_generate ...``; the ``--`` keeps
``mlx.launch`` from reading the flags that follow.) Run without ``mlx.launch``, it is one rank holding
every layer.

mlx-lm splits the layers evenly, the first ones to the highest rank: with 2 ranks and 4 layers, rank 1
runs layers 0-1 and rank 0 layers 2-3. With ``--streaming-experts`` each rank streams the experts of its
own layers only, within its own ``--expert-cache-gb``. Rank 0 prints the text the way
``mlx_lm.generate`` does; with ``--streaming-stats`` every rank prints one line to stderr at exit:
``[streaming] hit rate ..., experts read ..., GB read, ..., pipeline rank R/N (layers A-B)``.
``--stats-json PATH`` writes each rank's text and counters as JSON (``{rank}`` in PATH becomes the
rank), for scripts and tests.
"""

import argparse
import json
import re
import sys

import mlx.core as mx

from .integration.cli import add_streaming_arguments, export_streaming_arguments
from .integration.integration import install

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Pipeline-parallel generation over mlx.launch ranks, experts streamed per rank."
    )
    parser.add_argument(
        "--model", required=True, help="Model directory or Hugging Face repo."
    )
    parser.add_argument("--prompt", "-p", default="hello", help="Message to the model.")
    parser.add_argument("--max-tokens", "-m", type=int, default=100)
    parser.add_argument("--temp", type=float, default=0.0, help="Sampling temperature.")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Random seed, the same on every rank so that sampling agrees (default: 0).",
    )
    parser.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="Use the raw prompt, without the tokenizer's chat template.",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        help="Run on this device instead of MLX's default.",
    )
    parser.add_argument(
        "--stats-json",
        metavar="PATH",
        help="Write this rank's text and streaming counters as JSON; '{rank}' in PATH becomes "
        "the rank.",
    )
    add_streaming_arguments(parser)
    return parser


def format_prompt(tokenizer, prompt: str, use_chat_template: bool = True) -> list:
    """Token ids of ``prompt``, made as ``mlx_lm.generate`` makes them (chat template if any)."""
    use_chat_template = use_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
        )
    return tokenizer.encode(prompt, add_special_tokens=not use_chat_template)


def layer_number(path: str) -> int:
    return int(LAYER.search(path).group(1))


def rank_report(model, group) -> dict:
    """What this rank ran and, when streaming, what it read."""
    inner = model.model
    start = getattr(inner, "start_idx", 0)
    end = getattr(inner, "end_idx", None)
    if end is None:
        end = len(inner.layers)
    report = {"rank": group.rank(), "size": group.size(), "layers": [start, end]}
    state = getattr(model, "expert_streaming", None)
    if state is None:
        return report
    banks = state.cache.banks
    store = state.store
    report.update(
        streamed_layers=[layer_number(b.path) for b in banks],
        slots={b.path: b.slots for b in banks},
        expert_bytes={b.path: b.layer.expert_nbytes for b in banks},
        expert_files=sorted({str(f) for b in banks for f in b.layer.files()}),
        bytes_read=store.stats.bytes_read,
        budget_bytes=state.cache.budget_bytes,
        **state.stats(),
    )
    # the files the store opened for expert reads (the safetensors store keeps one fd per file)
    if hasattr(store, "_fds"):
        report["files_opened"] = sorted(str(f) for f in store._fds)
    return report


def main(argv=None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    export_streaming_arguments(parser, args)
    if args.device is not None:
        # before mlx_lm.generate is imported: it makes its stream on the default device
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)

    install()
    from mlx_lm import stream_generate
    from mlx_lm.generate import generation_stream
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init()
    rank = group.rank()
    mx.random.seed(args.seed)
    model, tokenizer = sharded_load(args.model, pipeline_group=group)

    prompt = format_prompt(tokenizer, args.prompt, not args.ignore_chat_template)
    sampler = make_sampler(args.temp)
    text, tokens, last = "", [], None
    for response in stream_generate(
        model, tokenizer, prompt, max_tokens=args.max_tokens, sampler=sampler
    ):
        text += response.text
        tokens.append(response.token)
        last = response
    # stream_generate computes one step ahead; let every rank finish it before any rank exits,
    # or the peers of a rank that left fail on their pending sends and receives
    mx.synchronize(generation_stream)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))

    if rank == 0:
        print("=" * 10)
        print(text)
        print("=" * 10)
        if last is not None:
            print(
                f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec"
            )
            print(
                f"Generation: {last.generation_tokens} tokens, "
                f"{last.generation_tps:.3f} tokens-per-sec"
            )
            print(f"Peak memory: {last.peak_memory:.3f} GB")
        sys.stdout.flush()

    if args.stats_json:
        report = rank_report(model, group)
        report.update(
            text=text,
            tokens=tokens,
            prompt_tokens=len(prompt),
            prompt_tps=last.prompt_tps if last else None,
            generation_tps=last.generation_tps if last else None,
        )
        with open(args.stats_json.replace("{rank}", str(rank)), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
