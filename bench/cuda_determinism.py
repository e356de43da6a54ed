"""Which of stock mlx-lm's ops give different bits for the same inputs on the default device.

    python bench/cuda_determinism.py [--dtype float32] [--overrides JSON] [--repeats 5]

Builds the parity suite's small Qwen3-MoE checkpoint, loads it with stock mlx-lm, and calls each module
of the first layer (attention and its parts, router, the routed SwitchGLU, the whole MoE block, the layer) and the
MoE's primitive ops (gather_qmm, quantized_matmul, argpartition, softmax) on fixed random inputs,
``--repeats`` times each, printing for each whether every repeat equals the first. On the CPU all are
equal; a backend where one is not cannot be the reference of a bit-exact parity test.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--variant", default="affine4")
    ap.add_argument("--overrides", default='{"hidden": 256, "moe_intermediate": 128}')
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", default="1,7", help="sequence lengths to try")
    args = ap.parse_args()
    import mlx.core as mx

    from mlx_lm_streaming.synthetic import build_checkpoint
    from mlx_lm_streaming.parity import load_stock

    print("device", mx.default_device(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(
            Path(tmp) / "ckpt",
            "qwen3_moe",
            args.variant,
            dtype=args.dtype,
            overrides=json.loads(args.overrides) if args.overrides else None,
        )
        model, config = load_stock(path)
    layer = model.model.layers[0]
    moe = layer.mlp
    sw = moe.switch_mlp
    dtype = getattr(mx, args.dtype)
    for n in (int(t) for t in args.tokens.split(",")):
        mx.random.seed(n)
        x = (mx.random.normal((1, n, config["hidden_size"])) * 0.5).astype(dtype)
        inds = mx.argpartition(-moe.gate(x), kth=moe.top_k - 1, axis=-1)[..., : moe.top_k]
        mx.eval(x, inds)
        g = sw.gate_proj
        xe = mx.expand_dims(x, (-2, -3))
        mask = "causal" if n > 1 else None
        at = layer.self_attn
        xn = layer.input_layernorm(x)
        q = at.q_proj(xn).reshape(1, n, at.n_heads, -1).transpose(0, 2, 1, 3)
        k = at.k_proj(xn).reshape(1, n, at.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = at.v_proj(xn).reshape(1, n, at.n_kv_heads, -1).transpose(0, 2, 1, 3)
        mx.eval(xn, q, k, v)
        probes = {
            "input_layernorm": lambda: layer.input_layernorm(x),
            "q_proj": lambda: at.q_proj(xn),
            "k_proj": lambda: at.k_proj(xn),
            "q_norm": lambda: at.q_norm(q),
            "rope": lambda: at.rope(q),
            "fast sdpa": lambda: mx.fast.scaled_dot_product_attention(
                q, k, v, scale=at.scale, mask=mask
            ),
            "o_proj": lambda: at.o_proj(q.transpose(0, 2, 1, 3).reshape(1, n, -1)),
            "self_attn": lambda: layer.self_attn(x, mask=mask),
            "router (gate)": lambda: moe.gate(x),
            "argpartition": lambda: mx.argpartition(-moe.gate(x), kth=moe.top_k - 1, axis=-1),
            "softmax": lambda: mx.softmax(moe.gate(x), axis=-1, precise=True),
            "gather_qmm (gate_proj)": lambda: mx.gather_qmm(
                xe, g.weight, g.scales, g.biases, rhs_indices=inds, transpose=True,
                group_size=g.group_size, bits=g.bits, mode=g.mode,
            ) if hasattr(g, "scales") else g(xe, inds),
            "SwitchGLU": lambda: sw(x, inds),
            "MoE block": lambda: moe(x),
            "layer": lambda: layer(x, mask=mask),
            "model": lambda: model(mx.array([[i % 100 + 1 for i in range(n)]])),
        }
        for name, fn in probes.items():
            first = fn()
            mx.eval(first)
            same = []
            for _ in range(args.repeats):
                again = fn()
                mx.eval(again)
                same.append(bool(mx.array_equal(first, again, equal_nan=True).item()))
            diff = float(mx.abs(first.astype(mx.float32) - again.astype(mx.float32)).max().item())
            print(f"tokens {n} {name}: equal {sum(same)}/{len(same)}, last max abs diff {diff:g}",
                  flush=True)


if __name__ == "__main__":
    main()
