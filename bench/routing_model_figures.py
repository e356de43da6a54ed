"""The routing model's routing recorded, and prediction measured on it against the truth (issue 28).

Runs the mlx-lm model that ``bench/train_routing_model.py`` made (stock ``mlx_lm.load``; nothing of
this package in the forward) on held-out prompts: each prompt's prefill, then ``--decode`` tokens
sampled (temperature ``--temp``, seeded). Writes

- ``OUT/routing-model.jsonl``: the routing trace (tests/data/routing/'s format, ids in the router's
  rank order), one sequence per prompt;
- ``OUT/routing-model-figures.json``: for the decode tokens, per predictor, precision and recall
  against the experts the layer really picked, at top-k and top-2k (pooled over layers, and per
  layer). The predictors, and the hidden state each uses (what the model has at that point):
  - ``next_router_on_moe_input``: layer L+1's router on layer L's MoE input (the post-attention
    normed state that layer L's own router reads; what the package's lookahead uses: available at
    layer L's host sync, before layer L's experts run);
  - ``next_router_on_layer_output``: layer L+1's router on layer L's output (the residual stream
    after layer L's MoE), normed by layer L+1's post-attention norm (available once layer L
    finished, before layer L+1's attention);
  - ``two_ahead_*``: the same for layer L+2;
  - ``previous_token``: the experts layer L+1 picked for the previous token;
  - ``pass_without_one_expert``: what a verified step's pass names after a miss: the forward run
    again with one expert of layer L (chosen at random among its picks) replaced by another
    (a missing expert's rows are computed from whatever slot 0 holds), and layers L+1.. of that
    pass compared with the true pass, by distance d = 1, 2, 4, 8 and pooled over every later layer
    (recall: the share of the later layers' true picks that the pass named; the share of the later
    misses it names, where misses are a random subset of the picks).

    python3 bench/routing_model_figures.py --model /root/routing-model/mlx \
        --prompts /root/routing-model/heldout.json --out $OUT \
        [--seqs 4 --decode 256]

``--next-pass SHARE`` measures only what a cold token's reads could begin from before its own pass
(issue 46): the next token's pass run on this token's unchecked sample while this token's reads
are in flight, and how many of the next token's misses it names (``next_pass``; any mlx-lm
``qwen3_moe`` model, the demo model on the CPU too):

    python3 bench/routing_model_figures.py --model /root/routing-model/mlx \
        --prompts /root/routing-model/heldout.json --out $OUT --next-pass 0.5 --decode 128

``--compare TRACE...`` (no model; the CPU is enough) compares traces instead: per layer, the decode
hit rate of per-layer caches of 12.5%, 25% and 50% of the experts under LRU and Belady's offline
optimum (``mlx_lm_streaming.tools.replay``, cold start, the whole trace in order), the share of a
token's experts that the previous token of its sequence used in the same layer, and the skew of
expert load (the share of a layer's decode picks that go to its 10% most used experts; 0.10 is
uniform), written to ``--out``/routing-compare.json:

    python3 bench/routing_model_figures.py --compare tests/data/routing/*.jsonl \
        --out docs/benchmarks
"""

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

SOURCE = "bench/routing_model_figures.py on the model bench/train_routing_model.py makes (seed 0)"


class Tap(nn.Module):
    """A layer's MoE block, its input and picks recorded; one expert swapped when told."""

    def __init__(self, block, no, log):
        super().__init__()
        self.block, self.no, self.log = block, no, log
        switch = block.switch_mlp
        tap = self

        class Picks(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = switch

            def __call__(self, x, inds):
                swap = tap.log.get("swap")
                if swap is not None and swap[0] == tap.no:
                    _, e, r = swap
                    inds = mx.where(inds == e, r, inds)
                tap.log["picks"][tap.no] = inds
                remap = tap.log.get("remap")  # (--next-pass: missing experts from slot 0's)
                if remap is not None:
                    inds = remap[tap.no][inds]
                return self.inner(x, inds)

        block.switch_mlp = Picks()

    def __call__(self, x):
        self.log["moe_in"][self.no] = x
        return self.block(x)


class LayerTap(nn.Module):
    """A decoder layer, its output recorded."""

    def __init__(self, layer, no, log):
        super().__init__()
        self.layer, self.no, self.log = layer, no, log
        self.mlp = layer.mlp

    def __call__(self, *a, **k):
        out = self.layer(*a, **k)
        self.log["out"][self.no] = out
        return out


def instrument(model):
    layers = model.model.layers
    log = {"moe_in": {}, "picks": {}, "out": {}, "swap": None}
    for i, layer in enumerate(layers):
        layer.mlp = Tap(layer.mlp, i, log)
        layers[i] = LayerTap(layer, i, log)
    return log


def forward(model, log, tokens, cache, remap=None):
    """The model on ``tokens`` (one sequence) over ``cache``, its taps' record evaluated with its
    logits; ``remap``: per layer, the slot map its experts are computed through (``--next-pass``)."""
    for key in ("picks", "moe_in", "out"):
        log[key].clear()
    log["remap"] = remap
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits, log["picks"], log["moe_in"], log["out"])
    log["remap"] = None
    return logits


def ranked(gate, x, inds):
    """``inds`` (rows x k) in the router's rank order (largest logit first)."""
    logits = np.array(gate(x).astype(mx.float32))
    order = np.argsort(-np.take_along_axis(logits, inds, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(inds, order, axis=-1)


def topk(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-logits, axis=-1, kind="stable")[..., :k]


class Score:
    """Precision and recall of predicted sets against true sets, pooled and per key."""

    def __init__(self):
        self.hit, self.pred, self.true = {}, {}, {}

    def add(self, key, predicted, truth):
        p, t = set(map(int, predicted)), set(map(int, truth))
        self.hit[key] = self.hit.get(key, 0) + len(p & t)
        self.pred[key] = self.pred.get(key, 0) + len(p)
        self.true[key] = self.true.get(key, 0) + len(t)

    def table(self):
        return {
            str(k): {"precision": self.hit[k] / max(1, self.pred[k]),
                     "recall": self.hit[k] / max(1, self.true[k]), "n": self.true[k]}
            for k in sorted(self.hit, key=str)
        }


def compare(paths, out: Path) -> dict:
    """Hit curves, reuse and skew of each trace (``--compare``)."""
    from mlx_lm_streaming.tools.replay import belady, replay
    from mlx_lm_streaming.files.routing_trace import read_trace

    figures = {}
    for path in paths:
        trace = read_trace(path)
        decode = [r for r in trace.rows if r.phase == "decode"]
        lookups = [sum(len(r.experts[i]) for r in decode) for i in range(trace.num_layers)]
        entry = {"model": trace.header.get("model"), "layers": trace.num_layers,
                 "experts": trace.num_experts, "decode_tokens": len(decode)}
        for share in (0.125, 0.25, 0.5):
            slots = max(1, int(round(share * trace.num_experts)))
            for name, run in (("lru", lambda t, n: replay(t, n, policy="lru")), ("belady", belady)):
                res = run(trace, slots)
                per_layer = [1 - m / n if n else None for m, n in zip(res.decode_misses, lookups)]
                entry[f"{name} {share}"] = {"hit_rate": res.hit_rate("decode"),
                                            "per_layer": per_layer}
        reused = total = 0
        prev = None
        for row in trace.rows:
            if row.phase == "decode" and prev is not None and prev.seq == row.seq:
                for a, b in zip(row.experts, prev.experts):
                    reused += len(set(a) & set(b))
                    total += len(a)
            prev = row
        entry["previous_token_reuse"] = reused / total if total else None
        top = []
        for i in range(trace.num_layers):
            counts = np.bincount([e for r in decode for e in r.experts[i]],
                                 minlength=trace.num_experts)
            if counts.sum():
                k = max(1, trace.num_experts // 10)
                top.append(np.sort(counts)[::-1][:k].sum() / counts.sum())
        entry["top10pct_load_share"] = float(np.mean(top)) if top else None
        figures[Path(path).name] = entry
        print(f"{Path(path).name}: " + ", ".join(
            f"{k} {v['hit_rate']:.3f}" for k, v in entry.items() if isinstance(v, dict))
            + f", reuse {entry['previous_token_reuse']:.3f}, top-10% load "
            f"{entry['top10pct_load_share']:.3f}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing-compare.json").write_text(json.dumps(figures, indent=1))
    return figures


def _touch(resident: list, picks, slots: int) -> None:
    """A per-layer LRU of ``slots`` experts (oldest first) after a call that used ``picks``."""
    used = list(map(int, picks))
    for e in used:
        if e in resident:
            resident.remove(e)
        resident.append(e)
    while len(resident) > slots:
        resident.remove(next(e for e in resident if e not in used))


def _table(resident: list, experts: int):
    """A verified pass's slot map: a resident expert its own, a missing one slot 0's expert."""
    table = np.full(experts, min(resident) if resident else 0, dtype=np.int32)
    table[resident] = resident
    return mx.array(table)


def next_pass(model, tokenizer, prompts, args, log) -> dict:
    """``--next-pass SHARE``: how well the next token's pass, run on this token's unchecked
    sample while this token's reads are in flight, names the next token's misses. Per decode token
    t, with per-layer LRU caches of SHARE of each layer's experts: the pass of t (missing experts
    computed from slot 0's, as a verified step's pass is), its sample drawn with the key the true
    sample uses; then the pass of t+1 on that sample, over the KV entries t's pass wrote, with the
    experts t's pass named counted resident; then both taken back and t computed right. Scored:
    how often the two samples agree, and the experts t+1's pass names missing against the experts
    t+1 misses once computed right (recall: the share of t+1's missed experts named a token early;
    precision: the share of those named that t+1 misses)."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    L, E = len(model.model.layers), model.args.num_experts
    slots = max(model.args.num_experts_per_tok, round(args.next_pass * E))
    tally = dict(tokens=0, agree=0, hit=0, named=0, missed=0, layers_missed=0, agreed_hit=0,
                 agreed_missed=0)

    def step(tokens, cache, tables=None):
        logits = forward(model, log, tokens, cache, tables)
        return logits[0, -1].astype(mx.float32), [np.array(log["picks"][i][0]) for i in range(L)]

    def draw(logits, n):
        if args.temp <= 0:
            return int(mx.argmax(logits))
        return int(mx.random.categorical(logits / args.temp, key=mx.random.key(n)))

    n_key, decoded = args.seed * 1_000_003, []
    for text in prompts:
        ids = tokenizer.encode(text)[: args.prompt_tokens]
        cache = make_prompt_cache(model)
        decoded.append([])
        logits, picks = step(ids, cache)
        resident = [[] for _ in range(L)]
        for t in range(len(ids)):
            for i in range(L):
                _touch(resident[i], picks[i][t], slots)
        tok, named, agreed = draw(logits, n_key), None, False
        for _ in range(args.decode):
            n_key += 1
            p_logits, p_picks = step([tok], cache, [_table(r, E) for r in resident])
            believed = [list(r) for r in resident]
            for i in range(L):
                _touch(believed[i], p_picks[i][-1], slots)
            guess = draw(p_logits, n_key)
            _, g_picks = step([guess], cache, [_table(r, E) for r in believed])
            trim_prompt_cache(cache, 2)
            logits, true = step([tok], cache)
            missed = [set(map(int, true[i][-1])) - set(resident[i]) for i in range(L)]
            if named is not None:
                tally["tokens"] += 1
                tally["missed"] += sum(map(len, missed))
                tally["named"] += sum(map(len, named))
                tally["hit"] += sum(len(a & b) for a, b in zip(named, missed))
                tally["layers_missed"] += sum(1 for m in missed if m)
                if agreed:  # (the guess was this token: what is left is the pass's KV entries)
                    tally["agreed_hit"] += sum(len(a & b) for a, b in zip(named, missed))
                    tally["agreed_missed"] += sum(map(len, missed))
            for i in range(L):
                _touch(resident[i], true[i][-1], slots)
            named = [set(map(int, g_picks[i][-1])) - set(believed[i]) for i in range(L)]
            decoded[-1].append(tok)  # (the true token of this step: the stock decode's)
            tok = draw(logits, n_key)
            agreed = tok == guess
            tally["agree"] += agreed
    tokens = max(1, tally["tokens"])
    return {"share": args.next_pass, "slots": slots, "temp": args.temp, **tally,
            "samples_agree": tally["agree"] / max(1, args.decode * len(prompts)),
            "misses_per_token": tally["missed"] / tokens,
            "recall": tally["hit"] / max(1, tally["missed"]),
            "recall_where_agreed": tally["agreed_hit"] / max(1, tally["agreed_missed"]),
            "precision": tally["hit"] / max(1, tally["named"]), "decoded": decoded}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", nargs="+", default=None, help="traces to compare (no model)")
    ap.add_argument("--model")
    ap.add_argument("--prompts", help="heldout.json of train_routing_model.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--swap-every", type=int, default=2, help="the one-expert-left-out pass on "
                    "every Nth decode token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--next-pass", type=float, default=None, metavar="SHARE",
                    help="only the next token's pass on this one's unchecked sample, with caches "
                    "of SHARE of each layer's experts (writes routing-next-pass-SHARE.json)")
    args = ap.parse_args(argv)
    if args.compare:
        compare(args.compare, Path(args.out))
        return
    if not args.model or not args.prompts:
        ap.error("--model and --prompts (or --compare TRACE...)")

    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load(args.model)
    cfg = model.args
    L, E, K = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    gates = [layer.mlp.gate for layer in model.model.layers]
    norms = [layer.post_attention_layernorm for layer in model.model.layers]
    log = instrument(model)
    prompts = json.loads(Path(args.prompts).read_text())["prompts"][: args.seqs]
    if args.next_pass is not None:
        figures = {"model": args.model, "seqs": len(prompts), "decode": args.decode,
                   **next_pass(model, tokenizer, prompts, args, log)}
        (out / f"routing-next-pass-{args.next_pass}.json").write_text(json.dumps(figures, indent=1))
        print(json.dumps(figures))
        return
    rng = np.random.default_rng(args.seed)
    mx.random.seed(args.seed)
    header = {"format": "moe-routing-trace", "version": 1,
              "model": f"Qwen3-MoE {L} x {E} top-{K}, trained (bench/train_routing_model.py)",
              "num_layers": L, "num_experts": E, "top_k": K, "source": SOURCE,
              "license": "this repository's; trained on the H200 image's installed Python packages",
              "note": f"held-out prompts (first {args.prompt_tokens} tokens of held-out files), "
                      f"{args.decode} tokens sampled at temperature {args.temp}, seed {args.seed}; "
                      "ids in the router's rank order"}
    rows = []
    score = Score()
    swap = Score()
    t0 = time.time()

    def step(tokens, cache):
        return forward(model, log, tokens, cache)

    for seq, text in enumerate(prompts):
        ids = tokenizer.encode(text)[: args.prompt_tokens]
        cache = make_prompt_cache(model)
        logits = step(ids, cache)
        picks = [ranked(gates[i], log["moe_in"][i][0], np.array(log["picks"][i][0]))
                 for i in range(L)]
        for t in range(len(ids)):
            rows.append({"seq": seq, "phase": "prefill",
                         "experts": [picks[i][t].tolist() for i in range(L)]})
        prev = [p[-1] for p in picks]
        for n in range(args.decode):
            last = logits[0, -1].astype(mx.float32)
            tok = int(mx.random.categorical(last / args.temp)) if args.temp > 0 else int(
                mx.argmax(last))
            logits = step([tok], cache)
            moe_in = [np.array(log["moe_in"][i][0, -1].astype(mx.float32)) for i in range(L)]
            outs = [log["out"][i][0, -1:] for i in range(L)]
            true = [np.array(log["picks"][i][0, -1]) for i in range(L)]
            rows.append({"seq": seq, "phase": "decode", "experts": [
                ranked(gates[i], log["moe_in"][i][0, -1:], true[i][None])[0].tolist()
                for i in range(L)]})
            for i in range(L - 1):
                for ahead in (1, 2):
                    j = i + ahead
                    if j >= L:
                        continue
                    a = np.array(gates[j](mx.array(moe_in[i])[None]).astype(mx.float32))[0]
                    b = np.array(gates[j](norms[j](outs[i])).astype(mx.float32))[0]
                    name = "next" if ahead == 1 else "two_ahead"
                    for k, tag in ((K, "top-k"), (2 * K, "top-2k")):
                        score.add(f"{name}_router_on_moe_input {tag}", topk(a, k), true[j])
                        score.add(f"{name}_router_on_moe_input {tag} layer {j}", topk(a, k),
                                  true[j])
                        score.add(f"{name}_router_on_layer_output {tag}", topk(b, k), true[j])
                if i + 1 < L:
                    score.add("previous_token", prev[i + 1], true[i + 1])
            prev = true
            if n % args.swap_every == 0:
                layer = int(rng.integers(0, L - 1))
                e = int(rng.choice(true[layer]))
                r = int(rng.choice(np.setdiff1d(np.arange(E), true[layer])))
                trim_prompt_cache(cache, 1)
                log["swap"] = (layer, e, r)
                step([tok], cache)
                log["swap"] = None
                wrong = [np.array(log["picks"][i][0, -1]) for i in range(L)]
                for j in range(layer + 1, L):
                    d = j - layer
                    score_key = f"d={d}" if d in (1, 2, 4, 8) else None
                    if score_key:
                        swap.add(score_key, wrong[j], true[j])
                    swap.add("every later layer", wrong[j], true[j])
                trim_prompt_cache(cache, 1)
                logits = step([tok], cache)  # the true pass again (its KV entries back)
        print(f"[figures] seq {seq}: {len(ids)} prompt + {args.decode} decode tokens, "
              f"{time.time() - t0:.0f} s", flush=True)
    with open(out / "routing-model.jsonl", "w") as f:
        f.write(json.dumps(header) + "\n")
        for row in rows:
            f.write(json.dumps(row) + "\n")
    figures = {"model": header["model"], "seqs": len(prompts), "decode": args.decode,
               "predictors": score.table(), "pass_without_one_expert": swap.table()}
    (out / "routing-model-figures.json").write_text(json.dumps(figures, indent=1))
    pooled = {k: v for k, v in figures["predictors"].items() if " layer " not in k}
    for k, v in pooled.items():
        print(f"{k}: precision {v['precision']:.3f} recall {v['recall']:.3f}")
    for k, v in figures["pass_without_one_expert"].items():
        print(f"pass without one expert, {k}: recall {v['recall']:.3f}")


if __name__ == "__main__":
    main()
