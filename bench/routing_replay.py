"""Replay a routing trace: each MoE layer's router choice replaced by the trace's experts.

    python bench/routing_replay.py --check [--trace FILE]   # tiny models: stock vs streaming, exact

``TraceRouting(trace).wrap(model)`` puts a wrapper around every routed-expert module of a model (stock
``SwitchGLU``, our ``StreamingSwitchGLU``, the seeds'): the wrapper calls the module with the trace's
expert ids for the tokens of the call instead of the router's. mlx-lm's own code around it (router
scores, shared experts, mixing) runs unchanged, so a stock model and a streaming one wrapped alike compute
the same thing and their logits stay comparable bit for bit (``--check``), while the streaming one reads
the experts the real model would have asked for. ``bench/experts.py --routing trace:FILE`` uses it.

Rules: the model's MoE layer and expert counts must be the trace's (``TraceError`` otherwise); or, with
``layers=N``, the model has N MoE layers and gets the trace's first N. Each layer consumes the trace's
token rows in order, as many per call as the call has tokens (every row of a batch gets the same ids);
past the end, the decode rows are replayed again. A row holds the model's top-k ids: a longer trace row is
cut, a shorter one (an empty row: the recorded engine skipped that layer for that token) is completed with
that layer's ids of the row before, then the lowest ids not in it. ``calls = {}`` starts every layer at
the trace's first row again (``bench/experts.py`` does that so that every configuration sees the same
routing).
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from mlx_lm_streaming.index import natural_key  # noqa: E402
from mlx_lm_streaming.routing_trace import TraceError, read_trace  # noqa: E402


class TraceRouting:
    """Expert ids from a routing trace, per (MoE layer, call); the interface of ``ForcedRouting``."""

    def __init__(self, trace, layers=None):
        self.trace = read_trace(trace) if isinstance(trace, (str, Path)) else trace
        self.layers = layers  # None: the model must have the trace's MoE layer count
        self.calls = {}  # layer -> trace rows consumed so far
        rows = self.trace.rows
        self._decode_from = next((i for i, r in enumerate(rows) if r.phase == "decode"), 0)

    def wrap(self, model) -> int:
        """Wrap every routed-expert module of ``model``; returns how many."""
        import seeds
        from mlx_lm.models.switch_layers import SwitchGLU

        from mlx_lm_streaming.switch import StreamingSwitchGLU

        kinds = (SwitchGLU, StreamingSwitchGLU, seeds._SeedSwitch)
        # in model order (named_modules does not give it): layer i takes the trace's layer i
        found = [(p, m) for p, m in model.named_modules() if isinstance(m, kinds)]
        found.sort(key=lambda pm: natural_key(pm[0]))
        experts = {_num_experts(m) for _, m in found}
        num_experts = experts.pop() if len(experts) == 1 else None
        if self.layers is None:
            self.trace.check_model(len(found), num_experts)
        elif len(found) != self.layers or self.layers > self.trace.num_layers:
            raise TraceError(
                f"{self.trace.path}: layers={self.layers} needs a model with that many MoE layers "
                f"(it has {len(found)}) and a trace with at least as many (it has "
                f"{self.trace.num_layers})"
            )
        elif num_experts != self.trace.num_experts:
            self.trace.check_model(self.trace.num_layers, num_experts)
        for layer_no, (path, module) in enumerate(found):
            parent = model
            parts = path.split(".")
            for q in parts[:-1]:
                parent = parent[int(q)] if isinstance(parent, list) else parent[q]
            parent[parts[-1]] = _replay_class()(module, self, layer_no)
        return len(found)

    def row(self, i: int) -> int:
        """Index of the trace row that a layer's ``i``-th token takes."""
        n = len(self.trace.rows)
        if i < n:
            return i
        start = self._decode_from
        return start + (i - start) % (n - start)

    def ids(self, layer_no: int, i: int, k: int) -> list:
        """``k`` expert ids for the layer's ``i``-th token (see the module docstring)."""
        rows = self.trace.rows
        got = list(rows[self.row(i)].experts[layer_no][:k])
        back = i - 1
        while len(got) < k and back >= 0:
            got += [e for e in rows[self.row(back)].experts[layer_no] if e not in got][
                : k - len(got)
            ]
            back -= 1
        e = 0
        while len(got) < k:
            if e not in got:
                got.append(e)
            e += 1
        return got

    def indices(self, layer_no: int, shape):
        """The ids for one call of the layer, ``shape`` ``(..., tokens, k)``, as a uint32 array."""
        import mlx.core as mx

        k, tokens = shape[-1], shape[-2] if len(shape) > 1 else 1
        first = self.calls.get(layer_no, 0)
        self.calls[layer_no] = first + tokens
        block = np.array([self.ids(layer_no, first + t, k) for t in range(tokens)], np.uint32)
        return mx.array(np.broadcast_to(block, tuple(shape)).copy())


def _num_experts(module) -> int:
    bank = getattr(module, "bank", None) or getattr(module, "_bank", None)  # ours, the seeds'
    if bank is not None:
        return bank.num_experts
    return module.gate_proj["weight"].shape[0]  # stock SwitchGLU


_CLASS = None


def _replay_class():
    global _CLASS
    if _CLASS is None:
        import mlx.nn as nn

        class ReplayedSwitch(nn.Module):
            """A routed-expert module called with a trace's expert ids instead of the router's."""

            def __init__(self, inner, routing, layer_no):
                super().__init__()
                object.__setattr__(self, "_inner", inner)
                object.__setattr__(self, "_routing", routing)
                object.__setattr__(self, "_layer_no", layer_no)

            def __call__(self, x, indices):
                replayed = self._routing.indices(self._layer_no, indices.shape)
                return self._inner(x, replayed.astype(indices.dtype))

        _CLASS = ReplayedSwitch
    return _CLASS


# -- --check ---------------------------------------------------------------------------------------


def check(trace_file, workdir: Path) -> int:
    """Stock and streaming (3 slots per layer) Qwen3-MoE-shaped models with the trace's MoE layer and
    expert counts (tiny otherwise), both replaying the trace: logits equal bit for bit, and the ids the
    streaming layers were called with (recorded by ``--record-routing``) the trace's."""
    import mlx.core as mx
    import mlx_lm.utils
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_streaming.integration import install
    from mlx_lm_streaming.routing_trace import TraceWriter
    from mlx_lm_streaming.synthetic import build_checkpoint

    install()
    if trace_file is None:
        trace_file = workdir / "tiny.jsonl"
        rng = np.random.default_rng(0)
        with TraceWriter(trace_file, 2, 8, 2, model="tiny") as w:
            for t in range(10):
                phase = "prefill" if t < 5 else "decode"
                w.token(0, phase, [rng.choice(8, 2, replace=False) for _ in range(2)])
    trace = read_trace(trace_file)
    ckpt = build_checkpoint(
        workdir / "ckpt",
        "qwen3_moe",
        "affine4",
        num_layers=trace.num_layers,
        overrides={"experts": trace.num_experts, "top_k": trace.top_k},
    )
    stock, _ = mlx_lm.utils.load_model(ckpt, model_config={"streaming_experts": False})
    probe, _ = mlx_lm.utils.load_model(ckpt, model_config={"streaming_experts": True})
    per_slot = sum(b.layer.expert_nbytes for b in probe.expert_streaming.cache.banks)
    probe.expert_streaming.close()
    recorded = workdir / "recorded.jsonl"
    opts = {"expert_cache_gb": (3 * per_slot + 0.5) / (1 << 30), "record_routing": str(recorded)}
    streaming, _ = mlx_lm.utils.load_model(ckpt, model_config={"streaming_experts": opts})
    prefill = sum(r.phase == "prefill" for r in trace.rows)
    steps = [mx.array([[(7 * i + 3) % 512 for i in range(prefill)]])]
    steps += [mx.array([[(37 * i + 11) % 512]]) for i in range(len(trace.rows) - prefill + 2)]
    outs = []
    for model in (stock, streaming):
        TraceRouting(trace).wrap(model)
        cache = make_prompt_cache(model)
        outs.append([model(s, cache=cache) for s in steps])
        mx.eval(outs[-1])
    streaming.expert_streaming.close()
    exact = all(mx.array_equal(a, b).item() for a, b in zip(*outs))
    want = [[TraceRouting(trace).ids(j, i, trace.top_k) for j in range(trace.num_layers)]
            for i in range(len(trace.rows) + 2)]  # fmt: skip
    got = [r.experts for r in read_trace(recorded).rows]
    followed = got == want
    print(
        f"{trace.path}: {len(steps)} calls, {len(got)} tokens; logits "
        f"{'exact' if exact else 'DIFFER'}; streaming routing "
        f"{'is the trace' if followed else 'is NOT the trace'}"
    )
    return 0 if exact and followed else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="stock vs streaming replaying a trace")
    ap.add_argument("--trace", default=None, help="trace file (default: a tiny random one)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    if not args.check:
        ap.error(
            "nothing to do: --check (bench/experts.py --routing trace:FILE replays in the bench)"
        )
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        try:
            return check(args.trace, Path(args.workdir or tmp))
        except TraceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
