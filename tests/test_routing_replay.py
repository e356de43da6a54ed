"""bench/routing_replay.py: a routing trace's experts replace the router's, alike in stock and streaming."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support import decode, load_stock, load_streaming, per_slot, same

from mlx_lm_streaming.files.routing_trace import TraceError, read_trace
from synthetic import build_checkpoint

BENCH = Path(__file__).resolve().parent.parent / "bench"
TRACE = Path(__file__).resolve().parent / "data" / "routing" / "qwen3-30b-a3b.jsonl"


@pytest.fixture(scope="module")
def rr():
    from mlx_lm_streaming.runtime import mlx_shims

    sys.path.insert(0, str(BENCH))
    rewind = mlx_shims.rewind
    try:
        import routing_replay

        # as every bench CLI does: a forward run again (a verified step that missed) sees the same
        # ids; without it each rerun takes the trace's next rows and misses again
        routing_replay.unwind_on_rewind()
        yield routing_replay
    finally:
        mlx_shims.rewind = rewind
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def k6(tmp_path_factory):
    """qwen3_moe, 2 MoE layers of 128 experts, top-k 6 (the trace's)."""
    path = tmp_path_factory.mktemp("k6") / "q3k6"
    return build_checkpoint(path, "qwen3_moe", num_layers=2, overrides={"experts": 128, "top_k": 6})


def test_each_layer_gets_the_traces_next_rows(rr, k6):
    trace = read_trace(TRACE)
    model, _ = load_stock(k6)
    routing = rr.TraceRouting(trace, layers=2)
    assert routing.wrap(model) == 2
    seen = {0: [], 1: []}
    wrappers = [m for _, m in model.named_modules() if type(m).__name__ == "RoutedSwitch"]
    for w in wrappers:
        inner = w._inner

        def spy(x, indices, inner=inner, layer=w._layer_no):
            seen[layer].append(np.array(indices).reshape(-1, indices.shape[-1]))
            return inner(x, indices)

        object.__setattr__(w, "_inner", spy)
    decode(model, mx.array([[1, 2, 3]]), steps=2)  # a 3-token prompt, then 2 tokens
    for layer in (0, 1):
        got = np.concatenate(seen[layer])
        want = np.array([row.experts[layer] for row in trace.rows[:5]])
        assert got.tolist() == want.tolist()
    routing.reset()
    assert np.array(routing.indices(0, (1, 1, 6))).reshape(-1).tolist() == trace.rows[0].experts[0]


def test_stock_and_streaming_compute_the_same_under_a_trace(rr, k6):
    tokens = mx.array([[5, 9, 200, 31]])
    stock, _ = load_stock(k6)
    own = decode(stock, tokens)
    rr.TraceRouting(read_trace(TRACE), layers=2).wrap(stock)
    want = decode(stock, tokens)
    # the trace's choices, not the router's, were computed
    assert not same(own, want)
    probe, _ = load_streaming(k6)
    budget = 8 * per_slot(probe) / 1e9  # 8 of 128 experts per layer: misses and evictions
    probe.expert_streaming.close()
    model, _ = load_streaming(k6, expert_cache_gb=budget)
    rr.TraceRouting(read_trace(TRACE), layers=2).wrap(model)
    assert same(want, decode(model, tokens))
    assert model.expert_streaming.cache.stats.misses > 0


def test_the_cursor_wraps_around_the_traces_decode_rows(rr):
    # past the trace's end the rows go on from its first decode row, not its prompt's first row
    routing = rr.TraceRouting(read_trace(TRACE), layers=2)
    n, first = len(routing.table[1]), routing.prefill[1]
    assert n == len(read_trace(TRACE).rows)
    got = np.array(routing.indices(1, (1, 2 * n, 6))).reshape(-1, 6)
    assert got[:n].tolist() == routing.table[1].tolist()
    again = routing.table[1][first:].tolist()
    assert got[n:].tolist() == (again * 3)[:n]


def test_a_model_that_cannot_replay_the_trace_is_refused(rr, k6, tmp_path):
    model, _ = load_stock(k6)
    with pytest.raises(TraceError, match="cannot replay 49 MoE layers"):
        rr.TraceRouting(read_trace(TRACE), layers=49)
    with pytest.raises(TraceError, match="the model has 2 MoE layers, the replay 3"):
        rr.TraceRouting(read_trace(TRACE), layers=3).wrap(model)
    k4 = build_checkpoint(
        tmp_path / "k4", "qwen3_moe", num_layers=2, overrides={"experts": 128, "top_k": 4}
    )
    model, _ = load_stock(k4)
    with pytest.raises(TraceError, match="build the checkpoint with top_k=6"):
        rr.TraceRouting(read_trace(TRACE), layers=2).wrap(model)
    few, _ = load_stock(
        build_checkpoint(tmp_path / "e8", "qwen3_moe", num_layers=2, overrides={"top_k": 6})
    )
    with pytest.raises(TraceError, match="128 experts per layer, the model"):
        rr.TraceRouting(read_trace(TRACE), layers=2).wrap(few)


def test_device_ids_equal_the_hosts_across_the_tables_end(rr):
    # a decode call's ids are a row of a block sent to the device once (issue 36); a call that runs
    # past the table's end wraps to its first decode row (past the prompt's), as the host's rows do
    trace = read_trace(TRACE)
    routing = rr.TraceRouting(trace, layers=2)
    table, first = routing.table[1], routing.prefill[1]
    assert 0 < first == sum(r.phase == "prefill" for r in trace.rows if r.experts[1])
    routing.cursor[1] = len(table) - 2
    want = routing.peek(1, (1, 5, 6))
    got = routing.indices(1, (1, 5, 6))
    assert np.array(got).tolist() == want.tolist()
    assert want.reshape(-1, 6).tolist() == table[[-2, -1, first, first + 1, first + 2]].tolist()
    assert routing.cursor[1] == len(table) + 3
    routing.cursor[1] = len(table) - 2
    for row in (-2, -1, first, first + 1):
        assert np.array(routing.indices(1, (1, 1, 6))).reshape(-1).tolist() == table[row].tolist()


@pytest.mark.parametrize("start", [0, 254, 300])
def test_forced_routing_device_blocks_equal_peek(rr, start):
    routing = rr.ForcedRouting(128)
    routing.cursor[0] = start  # 254: across a block's end
    for _ in range(4):
        want = routing.peek(0, (1, 1, 6))
        assert np.array(routing.indices(0, (1, 1, 6))).tolist() == want.tolist()
    routing.unwind(0, 3)  # back by three rows (into the first block from 254)
    got = np.array(routing.indices(0, (1, 1, 6))).reshape(-1)
    assert got.tolist() == routing.rows(0, start + 1, 1, 6)[0].tolist()
    assert len(set(got.tolist())) == 6 and got.max() < 128
    # a call of several rows takes the same rows as that many one-row calls
    routing.cursor[0] = start
    rows = np.array(routing.indices(0, (1, 3, 6))).reshape(-1, 6)
    routing.cursor[0] = start
    assert rows.tolist() == [np.array(routing.indices(0, (1, 1, 6))).reshape(-1).tolist()
                             for _ in range(3)]  # fmt: skip
