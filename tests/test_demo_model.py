"""The committed demo model (docs/demo-model/, trained by docs/train_demo_model.py on the docstrings of
Python's standard library): it writes readable text, streams it bit for bit like stock mlx-lm with
experts evicted and read again, and routes the way a trained model does, where the random-weight
checkpoints of the rest of the suite route uniformly."""

import ast
import re
from pathlib import Path

import mlx.core as mx
import mlx_lm.utils
import pytest
from mlx_lm.models import qwen3_moe
from mlx_lm.models.cache import make_prompt_cache
from support import (
    BIN,
    generate_cmd,
    generated_text,
    load_stock,
    load_streaming,
    per_slot,
    run,
    with_slots,
)

from mlx_lm_streaming.runtime.memory.expert_cache import CacheTuning
from synthetic import build_checkpoint

DEMO = Path(__file__).resolve().parent.parent / "docs" / "demo-model"
PROMPT = "The"
# common English words of documentation: readable text uses several of them, noise almost none
COMMON = set(
    "the a an of to in is are be for and or not if it this that with as by on from "
    "return returns value object function file string list name default".split()
)
WORD = re.compile(r"[(\"'`]*[A-Za-z][a-z]*[)\"'`]*[.,:;]?")


def reads_as_text(text: str) -> bool:
    """Mostly printable ASCII, mostly words, several distinct common English words."""
    if not text:
        return False
    printable = sum(
        c.isascii() and (c.isprintable() or c in "\n\t") for c in text
    ) / len(text)
    words = text.split()
    wordlike = sum(bool(WORD.fullmatch(w)) for w in words)
    common = {w.strip("()\"'`.,:;").lower() for w in words} & COMMON
    return (
        printable >= 0.95
        and len(words) >= 10
        and wordlike >= 0.7 * len(words)
        and len(common) >= 4
    )


def greedy(model, tokenizer, steps=48):
    """Greedy decoding from PROMPT: the logits of every step and the generated text."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokenizer.encode(PROMPT)]), cache=cache)[:, -1]
    out, ids = [logits], []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        ids.append(token.item())
        logits = model(token[None], cache=cache)[:, -1]
        out.append(logits)
    mx.eval(out)
    return out, tokenizer.decode(ids)


@pytest.fixture(scope="module")
def tokenizer():
    return mlx_lm.utils.load_tokenizer(DEMO)


@pytest.fixture(scope="module")
def stock(tokenizer):
    model, _ = load_stock(DEMO)
    return greedy(model, tokenizer)


def test_the_demo_model_reads(stock):
    _, text = stock
    assert reads_as_text(text), text


def test_random_weights_do_not_read(tokenizer):
    """The check above fails on the same architecture with random weights (what the demo had)."""
    config = mlx_lm.utils.load_config(DEMO)
    config.pop("quantization")
    config.pop("quantization_config", None)
    mx.random.seed(0)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    _, text = greedy(model, tokenizer)
    assert not reads_as_text(text), text


def test_streaming_with_evictions_is_bit_identical(stock, tokenizer):
    want, text = stock
    model = with_slots(DEMO, 4)  # half of each layer's 8 experts
    got, streamed = greedy(model, tokenizer)
    assert streamed == text
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got))
    s = model.expert_streaming.stats()
    assert s["evictions"] > 0 and s["misses"] > 0
    model.expert_streaming.close()


def test_cli_streams_the_same_text(tmp_path, require_hook):
    stock_out = run(generate_cmd(DEMO, prompt=PROMPT), tmp_path)
    streamed = run(
        generate_cmd(
            DEMO,
            "--streaming-experts",
            "--expert-cache-gb",
            "0.002",
            "--streaming-stats",
            prompt=PROMPT,
        ),
        tmp_path,
    )
    assert generated_text(streamed.stdout) == generated_text(stock_out.stdout)
    assert reads_as_text(generated_text(stock_out.stdout))
    assert "[streaming] hit rate" in streamed.stderr


def with_lookahead(path):
    """Half the experts of each layer in memory, room to stage lookahead reads, default threshold."""
    probe, _ = load_streaming(path)
    # the per-layer schedule, whose host sync the lookahead rides on (verified steps have none)
    tuning = CacheTuning(staging_bytes=4 * per_slot(probe), verified_steps=False)
    probe.expert_streaming.close()
    return with_slots(path, 4, tuning=tuning)


# the random-weight checkpoint of the demo model's shape
RANDOM_DEMO = {
    "hidden_size": 256,
    "moe_intermediate_size": 256,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 1024,
    "head_dim": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_lookahead_pays_on_learned_routing(stock, tokenizer, tmp_path):
    """Layer L+1's router applied to layer L's input guesses well on a trained model (measured 0.74
    here), so with the default threshold its guesses are read; on random weights of the same shape
    the guesses are no better than chance (0.19; 2 in 8 is 0.25), and are seldom read (3 reads, at the
    start). Exact either way."""
    want, text = stock
    model = with_lookahead(DEMO)
    got, streamed = greedy(model, tokenizer)
    s = model.expert_streaming.stats()
    staged = model.expert_streaming.cache.prefetch_stats.staged["lookahead"]
    model.expert_streaming.close()
    assert streamed == text
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got))
    assert s["lookahead_precision"] >= 0.6 and staged > 0, s

    path = build_checkpoint(
        tmp_path / "random", "qwen3_moe", num_layers=4, overrides=RANDOM_DEMO
    )
    model = with_lookahead(path)
    greedy(model, mlx_lm.utils.load_tokenizer(path))
    s = model.expert_streaming.stats()
    model.expert_streaming.close()
    assert s["lookahead_precision"] < 0.4, s


def test_the_chat_template_frames_messages_in_the_special_tokens(tokenizer):
    # the template is the one docs/train_demo_model.py writes, read by the tokenizer mlx-lm loads
    messages = [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "What does open return?"},
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = (
        "<|im_start|>system\nAnswer in one line.<|im_end|>\n"
        "<|im_start|>user\nWhat does open return?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(ids) == want
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(start) == 3 and ids.count(end) == 2  # each one token, not spelt out
    assert end in tokenizer.eos_token_ids  # a reply ends at its <|im_end|>
    script = (DEMO.parent / "train_demo_model.py").read_text()
    assert "CHAT_TEMPLATE" in script and tokenizer.chat_template in _template_of(script)


def _template_of(script: str) -> str:
    """The value of CHAT_TEMPLATE in the training script, which writes the tokenizer's config."""
    for node in ast.parse(script).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CHAT_TEMPLATE":
            return ast.literal_eval(node.value)
    return ""


def test_chat_streams_the_same_reply(tmp_path, require_hook):
    # mlx_lm.chat applies the template (it failed without one, stock too)
    chat = [
        BIN / "mlx_lm.chat", "--model", DEMO, "--max-tokens", "24", "--temp", "0",
    ]
    turns = "Return the value of the file\nq\n"
    stock_out = run(chat, tmp_path, input=turns)
    streamed = run(
        chat + ["--streaming-experts", "--expert-cache-gb", "0.002", "--streaming-stats"],
        tmp_path,
        input=turns,
    )
    assert "Traceback" not in stock_out.stderr + streamed.stderr

    def reply(out):  # the screen less its speed line
        return [line for line in out.splitlines() if "tok/s" not in line]

    assert reply(streamed.stdout) == reply(stock_out.stdout)
    # the reply: after the first prompt mark, up to the speed line, escape codes left out
    screen = re.sub(r"\x1b\[[0-9;]*[A-Za-z]|[\x01\x02]", "", stock_out.stdout)
    answer = screen.split("\u203a", 1)[1].split("tok/s", 1)[0].rsplit("\n", 1)[0]
    assert reads_as_text(answer), answer
    assert "[streaming] hit rate" in streamed.stderr
