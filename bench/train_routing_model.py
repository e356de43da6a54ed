"""Train the routing model: a Qwen3-MoE whose routing and hidden states prediction is judged on.

Random-weight checkpoints route unlike any trained model, and the real traces in
tests/data/routing/ hold expert ids only, so no predictor can run on them. This script makes a
trained MoE on the H200 in one device call (issue 28), which ``bench/routing_model_figures.py`` then
records and measures (its trace: tests/data/routing/trained-qwen3moe-16x64.jsonl).

- The model: transformers' ``Qwen3MoeForCausalLM`` (the stock class; experts through its
  ``grouped_mm`` implementation), 16 MoE layers (every layer), 64 experts, top-8 with normalised
  top-k weights, hidden 768, expert width 384, 12 query / 4 KV heads of 64, tied embeddings, a
  16,384-token byte-level BPE tokenizer trained here. Loss: next-token cross-entropy plus
  transformers' own load-balancing loss (``router_aux_loss_coef`` 0.01, the Switch-Transformer
  loss real MoEs use).
- The text: the sources and documentation (``.py .md .rst .txt``) of the Python packages installed
  where it runs (site-packages and the standard library), read in sorted order, up to
  ``--corpus-mb``; one file in 64 (by a hash of its path) is held out for the held-out loss and the
  prompts.
- The dense model beside it: transformers' ``Qwen3ForCausalLM`` of the same active size (the same
  attention, an MLP of 8 x 384 = 3072), trained on the same batches for the same steps.
- Training: bf16 weights for the forward and backward, fp32 master weights in AdamW (lr 1e-3, 100
  warm-up steps, cosine to 10%), gradients clipped at 1.0, batches of 32 x 512 tokens at seeded
  offsets. Fixed steps (``--steps``), so a run's length does not depend on the machine's speed; a
  time guard (``--max-minutes``) stops early and says so in ``training.json``.
- Saved as a Hugging Face checkpoint with one tensor per expert (``mlp.experts.E.gate_proj.weight``,
  the layout of Qwen's own checkpoints), then converted by mlx-lm's own converter
  (``mlx_lm.convert(..., quantize=True)``, 4-bit affine, group 64) into ``OUT/mlx``.

Seeded: the tokenizer, the data order, the batches and the initial weights are the same each run.
The weights are the same to within the GPU's non-deterministic reductions (the experts' scatter-adds
in the backward); the figures it gives are reproducible to that extent, not bit for bit.

    python3 bench/train_routing_model.py --out /root/routing-model [--steps 900] [--seed 0]

Writes ``OUT/hf`` (the Hugging Face checkpoint), ``OUT/mlx`` (4-bit, what the benchmarks load),
``OUT/heldout.json`` (held-out prompts: text the model never trained on) and ``OUT/training.json``
(losses, timings, the dense model's held-out loss). The weights are not committed: this makes them.
"""

import argparse
import hashlib
import json
import math
import os
import pathlib
import sysconfig
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
DEVICE = "cuda"  # "cpu" only to try the script out (``--cpu``)

SUFFIXES = (".py", ".md", ".rst", ".txt")
HOLD_OUT = 64  # one file in this many (by a hash of its path) is held out
EOS = "<|endoftext|>"
SPECIALS = [EOS, "<|im_start|>", "<|im_end|>"]

MOE = dict(
    hidden_size=768,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=384,
    intermediate_size=3072,  # the dense model's MLP (8 x 384); unused by the MoE (every layer MoE)
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    router_aux_loss_coef=0.01,
)


def corpus(cap_bytes: int):
    """``(train texts, held-out texts, roots)``: every source and documentation file under this
    interpreter's package folders, sorted, until ``cap_bytes``."""
    paths = sysconfig.get_paths()
    roots = sorted({paths["purelib"], paths["platlib"], paths["stdlib"]})
    train, held, total = [], [], 0
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                if not name.endswith(SUFFIXES):
                    continue
                path = os.path.join(folder, name)
                try:
                    if not 200 <= os.path.getsize(path) <= 512_000:
                        continue
                    text = open(path, encoding="utf-8").read()
                except (OSError, UnicodeDecodeError):
                    continue
                rel = os.path.relpath(path, root)
                bucket = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HOLD_OUT
                (held if bucket == 0 else train).append(text)
                total += len(text)
                if total >= cap_bytes:
                    return train, held, roots
    return train, held, roots


def make_tokenizer(texts, vocab: int, sample_bytes: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample, size = [], 0
    for t in texts:
        sample.append(t)
        size += len(t)
        if size >= sample_bytes:
            break
    tok.train_from_iterator(sample, trainer=trainer)
    return tok


def encode(tok, texts):
    import numpy as np

    eos = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.array(ids, dtype=np.int32)


def batches(data, steps: int, batch: int, seq: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        yield np.stack([data[s : s + seq] for s in starts])


def build(kind: str, vocab: int, eos: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, attn_implementation="sdpa")
    if kind == "moe":
        config = Qwen3MoeConfig(**MOE, output_router_logits=True, **common)
        model = Qwen3MoeForCausalLM._from_config(config, experts_implementation="grouped_mm")
    else:
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "tie_word_embeddings")
        config = Qwen3Config(**{k: MOE[k] for k in keys}, **common)
        model = Qwen3ForCausalLM._from_config(config)
    return model.to(device=DEVICE, dtype=torch.bfloat16)


def train(model, data, args, log):
    """Train ``model`` (bf16) with fp32 master weights; returns the per-step losses (every 25)."""
    import numpy as np
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(master, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    warm, steps = 100, args.steps

    def lr_at(step):
        if step < warm:
            return args.lr * (step + 1) / warm
        t = (step - warm) / max(1, steps - warm)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    losses, start, done = [], time.time(), 0
    model.train()
    for step, x in enumerate(batches(data, steps, args.batch, args.seq, args.seed + 1)):
        if time.time() - start > args.max_minutes * 60:
            log(f"time guard: stopped after {step} of {steps} steps")
            break
        ids = torch.from_numpy(x.astype(np.int64)).to(DEVICE)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = [p.grad.float() if p.grad is not None else torch.zeros_like(m)
                 for p, m in zip(params, master)]
        torch.nn.utils.clip_grad_norm_(grads, 1.0)
        for m, g in zip(master, grads):
            m.grad = g
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
                p.grad = None
        done = step + 1
        if step % 25 == 0 or step == steps - 1:
            aux = getattr(out, "aux_loss", None)
            losses.append({"step": step, "loss": float(out.loss),
                           "aux": float(aux) if aux is not None else None})
            log(f"step {step}: loss {float(out.loss):.3f} ({time.time() - start:.0f} s)")
    return losses, done, time.time() - start


def heldout_loss(model, data, args) -> float:
    """Mean next-token cross-entropy (without the load-balancing term) on held-out text."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for x in batches(data, 24, args.batch, args.seq, args.seed + 7):
            ids = torch.from_numpy(x.astype(np.int64)).to(DEVICE)
            logits = model(input_ids=ids).logits.float()
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   ids[:, 1:].reshape(-1))
            total, n = total + float(loss), n + 1
    return total / n


def save_hf(model, tok, out: pathlib.Path, vocab: int, eos: int) -> None:
    """A Hugging Face checkpoint in the per-expert layout of Qwen's own (transformers keeps the
    experts stacked; ``mlx_lm``'s ``qwen3_moe.sanitize`` stacks per-expert tensors itself)."""
    import torch
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    inter = MOE["moe_intermediate_size"]
    tensors = {}
    for name, value in model.state_dict().items():
        value = value.detach().to(torch.bfloat16).contiguous().cpu()
        if name == "lm_head.weight":
            continue  # tied
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(value.shape[0]):
                tensors[f"{base}{e}.gate_proj.weight"] = value[e, :inter].clone()
                tensors[f"{base}{e}.up_proj.weight"] = value[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(value.shape[0]):
                tensors[f"{base}{e}.down_proj.weight"] = value[e].clone()
        else:
            tensors[name] = value
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in MOE.items() if k != "router_aux_loss_coef"}
    config.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=vocab,
                  bos_token_id=eos, eos_token_id=eos, hidden_act="silu", torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   pad_token=EOS)
    fast.save_pretrained(str(out))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--dense-steps", type=int, default=None, help="default: --steps")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--corpus-mb", type=int, default=96)
    ap.add_argument("--max-minutes", type=float, default=4.5, help="time guard of each model")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="try it out at a tiny size on the CPU")
    args = ap.parse_args(argv)
    global DEVICE
    if args.cpu:
        DEVICE = "cpu"
        MOE.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, num_experts=8, moe_intermediate_size=64,
                   num_experts_per_tok=2,
                   intermediate_size=256)

    import torch

    t0 = time.time()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(f"[train {time.time() - t0:6.1f}s] {msg}", flush=True)

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    train_texts, held_texts, roots = corpus(args.corpus_mb * 1_000_000)
    log(f"corpus: {len(train_texts)} files to train on, {len(held_texts)} held out, from {roots}")
    tok = make_tokenizer(train_texts, args.vocab, 24_000_000)
    eos = tok.token_to_id(EOS)
    data = encode(tok, train_texts)
    held = encode(tok, held_texts)
    log(f"tokens: {len(data):,} to train on, {len(held):,} held out")
    # held-out prompts for the routing record: the start of held-out files
    long = [t[:1500] for t in held_texts if len(t) >= 3000]
    prompts = long[:: max(1, len(held_texts) // 64)][:16]
    (out / "heldout.json").write_text(json.dumps({"prompts": prompts}, indent=1))

    report = {"model": MOE, "steps": args.steps, "batch": args.batch, "seq": args.seq,
              "lr": args.lr, "seed": args.seed, "vocab": args.vocab, "corpus_roots": roots,
              "train_tokens": int(len(data)), "heldout_tokens": int(len(held)),
              "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
              "torch": torch.__version__}
    import transformers

    report["transformers"] = transformers.__version__
    torch.manual_seed(args.seed)
    moe = build("moe", args.vocab, eos)
    report["moe_params"] = sum(p.numel() for p in moe.parameters())
    losses, done, secs = train(moe, data, args, log)
    report["moe"] = {"losses": losses, "steps_done": done, "seconds": secs,
                     "heldout_loss": heldout_loss(moe, held, args)}
    log(f"MoE held-out loss {report['moe']['heldout_loss']:.3f} after {done} steps, {secs:.0f} s")
    save_hf(moe, tok, out / "hf", args.vocab, eos)
    del moe
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    if not args.no_dense:
        torch.manual_seed(args.seed)
        dense = build("dense", args.vocab, eos)
        report["dense_params"] = sum(p.numel() for p in dense.parameters())
        dargs = argparse.Namespace(**{**vars(args), "steps": args.dense_steps or args.steps})
        losses, done, secs = train(dense, data, dargs, log)
        report["dense"] = {"losses": losses, "steps_done": done, "seconds": secs,
                           "heldout_loss": heldout_loss(dense, held, dargs)}
        log(f"dense held-out loss {report['dense']['heldout_loss']:.3f} after {done} steps")
        del dense
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    from mlx_lm import convert

    mlx_dir = out / "mlx"
    if mlx_dir.exists():
        import shutil

        shutil.rmtree(mlx_dir)
    convert(str(out / "hf"), str(mlx_dir), quantize=True, q_bits=4, q_group_size=64)
    report["seconds"] = time.time() - t0
    (out / "training.json").write_text(json.dumps(report, indent=1))
    log(f"saved {mlx_dir}; {report['seconds']:.0f} s in all")


if __name__ == "__main__":
    main()
