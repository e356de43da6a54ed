"""Train the small demo MoE in docs/demo-model/ (what `bash docs/demo.sh` runs).

A Qwen3-MoE (mlx-lm's own ``qwen3_moe`` classes): 4 layers, hidden 256, 8 routed experts per layer,
top-2, a 1024-token byte-level BPE tokenizer. The text is the docstrings of the Python standard
library that this interpreter ships (modules, classes and functions, read with ``ast``, nothing is
imported), so it needs no network; Python and its standard library are under the PSF License
(``LICENSE.txt`` next to the stdlib). Trained with mlx: AdamW, next-token cross-entropy plus a small
load-balancing loss on the routers (so all experts get used, as in a real MoE), on the CPU in about
ten minutes. Saved 4-bit affine (group 64) with ``mlx_lm.utils.quantize_model`` / ``save_model`` /
``save_config``, the way ``mlx_lm.convert -q`` writes a model.

    .venv/bin/python docs/train_demo_model.py [OUT_DIR] [--minutes 10] [--seed 0]

The result depends on the Python version (its docstrings), on mlx and on how many steps fit the
time; docs/demo-model/README.md records the run that made the committed model. The Linux CPU wheel of
mlx multiplies with the reference BLAS: preloading OpenBLAS (Debian's libopenblas0-pthread,
``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0``) made its matmuls ~15x
faster here and is how the committed model was trained (371 steps in 10 minutes).
"""

import argparse
import ast
import json
import math
import pathlib
import platform
import sys
import sysconfig
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_moe
from mlx_lm.models.activations import swiglu
from mlx_lm.utils import quantize_model, save_config, save_model

HERE = pathlib.Path(__file__).resolve().parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML over the special tokens, so that mlx_lm.chat and the server's /v1/chat/completions take the
# model (the model was trained on plain text: the template frames a prompt, it teaches no dialogue)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VOCAB = 1024
CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 512,  # unused: every layer is MoE (decoder_sparse_step 1)
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
# stdlib folders left out: tests, the IDLE / turtle / tk GUIs, vendored or generated code
SKIP = {
    "test",
    "tests",
    "idlelib",
    "turtledemo",
    "tkinter",
    "lib2to3",
    "ensurepip",
    "site-packages",
}


def corpus() -> str:
    """Every docstring of at least 40 characters in the stdlib's .py files, in path order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in SKIP or p.startswith(("test", "config-")) for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, kinds) else None
            if doc and len(doc) >= 40 and doc.isascii():
                docs.append(doc)
    return "\n\n".join(docs) + "\n"


def build_tokenizer(text: str, out: pathlib.Path):
    """A byte-level BPE of VOCAB ids trained on the text, saved as mlx-lm loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.split("\n\n"), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special = {
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[2],
        "pad_token": SPECIALS[0],
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return tok


class TrainingMoE(qwen3_moe.Qwen3MoeSparseMoeBlock):
    """The stock block's function with one plain matmul per expert, keeping the router logits.

    The CPU backend's ``gather_mm`` (what ``SwitchGLU`` runs) is several times slower than BLAS
    matmuls, so training sorts the tokens by expert and multiplies each expert's rows at once: the
    same top-k routing, normalised scores, SwiGLU and parameters. The logits go to ``self.record``
    for the load-balancing loss.
    """

    record = None  # a Record, set before training

    def __call__(self, x):
        logits = self.gate(x)
        self.record.logits.append(logits)
        gates = mx.softmax(logits, axis=-1, precise=True)
        k, n = self.top_k, self.num_experts
        inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        # expert-major: sort the (token, slot) pairs by expert, one BLAS matmul per expert
        flat = x.reshape(-1, x.shape[-1])
        pairs = inds.reshape(-1)
        order = mx.argsort(pairs)
        counts = np.bincount(np.array(pairs), minlength=n)  # host sync: the chunk sizes
        xs = flat[order // k]
        mlp, chunks, start = self.switch_mlp, [], 0
        for e, count in enumerate(counts.tolist()):
            xe = xs[start : start + count]
            start += count
            h = swiglu(xe @ mlp.gate_proj.weight[e].T, xe @ mlp.up_proj.weight[e].T)
            chunks.append(h @ mlp.down_proj.weight[e].T)
        y = mx.concatenate(chunks)[mx.argsort(order)].reshape(*inds.shape, -1)
        return mx.sum(y * scores[..., None], axis=-2)


class Record:
    """The routers' logits of one forward pass (a plain object: mlx modules treat lists as parameters)."""

    def __init__(self):
        self.logits = []


def balance_loss(logits: list, k: int) -> mx.array:
    """Switch-Transformer load balancing: E * sum(fraction routed * mean probability) per layer."""
    total = 0.0
    for y in logits:
        probs = mx.softmax(y.reshape(-1, y.shape[-1]).astype(mx.float32), axis=-1)
        n = probs.shape[-1]
        top = mx.stop_gradient(mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k])
        routed = mx.sum(top[:, :, None] == mx.arange(n), axis=1).astype(mx.float32)
        total = total + n * mx.sum(mx.mean(routed, axis=0) / k * mx.mean(probs, axis=0))
    return total / len(logits)


def train(
    ids: np.ndarray, minutes: float, seed: int, log=lambda *a: print(*a, flush=True)
):
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    args = qwen3_moe.ModelArgs.from_dict(CONFIG)
    model = qwen3_moe.Model(args)
    record = TrainingMoE.record = Record()
    for layer in model.layers:
        layer.mlp.__class__ = TrainingMoE
    seq, batch, lr = 128, 16, 3e-3
    opt = optim.AdamW(learning_rate=lr, weight_decay=0.01)
    held = ids[-20000:]  # last 20k tokens: held out, for the validation loss
    train_ids = ids[:-20000]

    def loss_fn(model, x, y):
        record.logits = []
        out = model(x)
        ce = nn.losses.cross_entropy(out, y, reduction="mean")
        return ce + 0.01 * balance_loss(record.logits, args.num_experts_per_tok), ce

    step_fn = nn.value_and_grad(model, loss_fn)

    def sample():
        starts = rng.integers(0, len(train_ids) - seq - 1, batch)
        xy = np.stack([train_ids[s : s + seq + 1] for s in starts])
        return mx.array(xy[:, :-1]), mx.array(xy[:, 1:])

    start, step = time.time(), 0
    while time.time() - start < minutes * 60:
        x, y = sample()
        # warm up over 100 steps, then a cosine down to lr / 20 at the end of the time budget
        done = (time.time() - start) / (minutes * 60)
        cosine = lr / 20 + (lr - lr / 20) * 0.5 * (
            1 + math.cos(math.pi * min(done, 1.0))
        )
        opt.learning_rate = min(1.0, (step + 1) / 100) * cosine
        (loss, ce), grads = step_fn(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, ce)
        step += 1
        if step % 50 == 0:
            log(f"step {step} {time.time() - start:.0f}s loss {ce.item():.3f}")
    for layer in model.layers:  # back to the stock block
        layer.mlp.__class__ = qwen3_moe.Qwen3MoeSparseMoeBlock
    x = mx.array(held[: (len(held) // (seq + 1)) * (seq + 1)].reshape(-1, seq + 1))
    val = nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:], reduction="mean").item()
    log(
        f"trained {step} steps ({step * batch * seq} tokens) in {time.time() - start:.0f}s, "
        f"held-out loss {val:.3f}"
    )
    return model, {
        "steps": step,
        "tokens": step * batch * seq,
        "heldout_loss": round(val, 3),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", default=str(HERE / "demo-model"))
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bits", type=int, default=4, help="0 keeps float32")
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    out = pathlib.Path(args.out)

    text = corpus()
    tok = build_tokenizer(text, out)
    ids = np.array(tok.encode(text).ids, dtype=np.int32)
    print(f"corpus: {len(text)} characters, {len(ids)} tokens")
    model, run = train(ids, args.minutes, args.seed)

    config = dict(CONFIG)
    if args.bits:
        model, config = quantize_model(
            model, config, group_size=64, bits=args.bits, mode="affine"
        )
    for old in out.glob("model*.safetensors"):
        old.unlink()
    save_model(out, model)
    save_config(config, config_path=out / "config.json")
    run.update(
        python=platform.python_version(),
        mlx=mx.__version__,
        mlx_lm=mlx_lm.__version__,
        corpus_characters=len(text),
        corpus_tokens=len(ids),
        minutes=args.minutes,
        seed=args.seed,
        bits=args.bits or 32,
        parameters=sum(v.size for _, v in tree_flatten(model.parameters())),
    )
    (out / "training.json").write_text(json.dumps(run, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
