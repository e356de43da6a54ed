"""What a streaming model says: the chosen budget at load, and the ``--streaming-stats`` line (and
per-layer table) at exit. Functions of a ``loading.StreamingState``."""

import atexit
import sys

from ...option_table import GB
from ..options import StreamingOptions
from ..sizes import decimal_gb, gb_as_given, gb_digits
from . import machine as memory

_REPORTING: list = []  # states whose stats are printed at exit, in load order
# lines printed at exit before the stats lines, where any are printed (``note_at_exit``)
_NOTES: list = []
# set (integration.py) once an mlx-lm command's line or environment asked for streaming: loads then
# say on stderr which budget they chose (``choice_line``)
cli_streaming = False


def stats_line(state, label: bool = False) -> str:
    """The ``--streaming-stats`` line; ``label``: name the model (several stream in this
    process, e.g. a draft model or the server's models)."""
    s = state.stats()
    # no expert was asked for yet (nothing generated): no rate to give
    rate = "n/a" if s["hits"] + s["misses"] == 0 else f"{s['hit_rate']:.1%}"
    name = f"{state.model_path.name}: " if label else ""
    line = (
        f"[streaming] {name}hit rate {rate}, experts read {s['experts_read']}, "
        f"{_gb(s['gb_read'])} read{_read_split(s)}, {s['io_seconds']:.2f} s in I/O, "
        f"cache {_gb(s['cache_gb'])}"
    )
    if "tier_device_gb" in s:
        share = s["tier_device_share"]
        served = "n/a" if share != share else f"{share:.1%} / {1 - share:.1%}"
        line += (
            f" (tiers: device {_gb(s['tier_device_gb'])}, host {_gb(s['tier_host_gb'])} read "
            f"in place; uses served device / host {served} of {s['tier_sampled_uses']} counted; "
            f"{s['tier_moves']} experts moved, {s['tier_moves_per_token']:.2f} a token in "
            f"{s['tier_move_batches']} batches, {s['tier_shifts']} routing shifts "
            f"followed; {s['tier_prompt_calls']} prompt calls over "
            "device copies)"
        )
    if "host_cache_gb" in s:
        line += (
            f" (host cache {_gb(s['host_cache_gb'])}: {s['host_cache_hits']} of the "
            f"{s['misses']} misses copied from it, {_gb(s['host_cache_served_gb'])}, not read)"
        )
    if "budget_ceiling_gb" in s and s["budget_shrinks"] + s["budget_grows"]:
        line += _budget_part(s)  # (a budget that never moved: nothing to say)
    if s.get("failed_background_reads"):
        line += (
            f", background reads of {s['failed_background_reads']} experts failed (read "
            f"again on demand; first: {s['first_background_error']})"
        )
    if state.pipeline is not None:
        rank, size, start, end = state.pipeline
        line += f", pipeline rank {rank}/{size} (layers {start}-{end - 1})"
    p = state.prefill
    if p.prompts:
        line += (
            f", layer-major prefill of {p.prompts} prompt{'s' if p.prompts > 1 else ''} "
            f"({p.chunks} chunks in {p.groups} group{'s' if p.groups > 1 else ''}, "
            f"{decimal_gb(p.held_bytes)} of hidden states held at most{_sets_part(p)})"
        )
    if s.get("miss_read_busy_seconds"):
        line += _misses_part(s)
    if s["span_seconds"] > 0:
        line += (
            f"; {s['span_seconds']:.2f} s from first to last expert request: "
            f"{s['io_wait_seconds']:.2f} s waiting for reads, {s['install_seconds']:.2f} s "
            f"copying into the cache, {s['other_seconds']:.2f} s everything else"
        )
    return line


def _budget_part(s) -> str:
    """The budget that followed free memory (``moving_budget``): its low and high over the run, its
    ceiling, and how often it moved."""
    low, high = _gb(s["budget_low_gb"]), _gb(s["budget_high_gb"])
    moves = s["budget_shrinks"] + s["budget_grows"]
    span = f"{low} to {high}" if low != high else f"{low} throughout"
    return (
        f", budget following free memory {span} (ceiling {_gb(s['budget_ceiling_gb'])}; "
        f"moved {moves} time{'' if moves == 1 else 's'}: {s['budget_shrinks']} down, "
        f"{s['budget_grows']} up{_stopped(s)})"
    )


def _stopped(s) -> str:
    error = s.get("budget_error")
    return f"; a move stopped: {error}, those banks kept their size" if error else ""


def _misses_part(s) -> str:
    """For the misses: how long the disk was busy reading them (wall time with one or more in
    flight) against how long the model's thread waited for reads: a wait much longer than the
    busy time is a hand-off that left the disk idle; a busy time longer than the wait, reads that
    overlapped compute."""
    busy, waited = s["miss_read_busy_seconds"], s["io_wait_seconds"]
    demand_gb = s["gb_read"] - s.get("background_gb", 0.0)
    # (a rate as sizes are written: "0.00 GB/s" where a small model's few reads ran slowly)
    rate = f", {gb_digits(demand_gb / busy * 1e9)} GB/s while busy" if demand_gb > 0 else ""
    # bytes read against those the misses need (each missed expert once, less a host cache's)
    needed = s.get("gb_needed", 0.0) - s.get("host_cache_served_gb", 0.0)
    if needed > 0 and s["gb_read"] > 0:
        rate += f", {s['gb_read'] / needed:.2f}x the bytes the misses need"
        if "gb_uncached" in s:  # (the store reads past the page cache: ``direct``)
            rate += f", {s['gb_uncached'] / s['gb_read']:.0%} of the reads past the page cache"
    return (
        f"; misses: the disk busy {busy:.2f} s reading them{rate}, the decode waiting "
        f"{waited:.2f} s for reads"
    )


def _sets_part(p) -> str:
    """What layer-major prefill's layer sets did (``bank.layer_set``), or why it went in waves."""
    if p.set_bytes:
        return (
            f"; each layer over its whole expert set, two sets {decimal_gb(p.set_bytes)} beside "
            f"the budget: {p.set_experts_read} experts read, {p.set_experts_copied} copied from "
            f"the cache, {p.set_kept} given to the cache after"
        )
    return f"; in waves through the slots: {p.waves_why}" if p.waves_why else ""


def _long_prompts(state) -> str:
    """The load line's word on long prompts: over layer sets (what they take beside the budget),
    in waves and why, or nothing (layer-major prefill off, or every expert cached)."""
    cache = state.cache
    if (
        not cache.layer_major_prefill
        or cache.tiers is not None
        or cache.budget_bytes >= cache.total_expert_bytes
    ):
        return ""
    nbytes, why = memory.layer_sets_fit(cache, state.resident_bytes)
    if why is None:
        from ..bank.layer_set import with_stage

        staged = " and a stage on the device" if with_stage(nbytes, cache.banks) else ""
        return (
            f"; long prompts a layer's whole expert set at a time, {decimal_gb(nbytes)} for two"
            f"{staged} beside the budget"
        )
    return f"; long prompts layer by layer in waves through the slots ({why})"


def _decode_part(s) -> str:
    """``--streaming-stats layers``' first line: how many decode-sized calls ran as verified steps
    and per layer, and how that was chosen (``share_limits``). The default line leaves it out: it
    is the runtime's own words."""
    verified, per_layer = s.get("verified_steps", 0), s.get("per_layer_decodes", 0)
    if not verified + per_layer:
        return ""
    how = {"always": "verified wherever possible"}.get(s.get("decode_choice"), "share limits")
    return f"decode calls: {verified} verified steps, {per_layer} per layer (by {how})"


def _read_split(s) -> str:
    """Where background reads ran: the GB read split into those read for the experts asked for
    (on demand) and those read ahead (lookahead, next wave, the fill of a bank of every expert)."""
    background = min(s.get("background_gb", 0.0), s["gb_read"])
    if not background:
        return ""
    demand = s["gb_read"] - background
    return (
        f" ({_gb(demand)} on demand, {_gb(background)} in the background: lookahead, next "
        "wave, fill)"
    )


def _gb(gb: float) -> str:
    return decimal_gb(gb * 1e9)


def generation_began() -> bool:
    """Whether a streaming model of this process was asked for experts yet (it ran a forward)."""
    from .expert_cache import _LIVE

    return any(cache.stats.first_request is not None for cache in list(_LIVE))


def fallback_line(state, why: str) -> str:
    """The one line that says a long prompt prefills chunk by chunk, as stock (layer_major.py)."""
    return (
        f"[streaming] {state.model_path.name}: layer-major prefill does not apply ({why}): long "
        "prompts prefill chunk by chunk, each chunk reading the uncached experts again"
    )


def layers_table(state) -> str:
    """``--streaming-stats layers``: how the decode calls ran, then the hit rate, misses and GB
    read of each MoE layer."""
    s = state.stats()
    decode = _decode_part(s)
    rows = [("layer", "slots", "hit rate", "misses", "GB read")]
    for layer in s["per_layer"]:
        asked = layer["hits"] + layer["misses"]
        rows.append(
            (
                layer["layer"],
                str(layer["slots"]),
                f"{layer['hit_rate']:.1%}" if asked else "n/a",
                str(layer["misses"]),
                gb_digits(layer["gb_read"] * GB),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"[streaming]   {decode}"] if decode else []
    lines += [
        "[streaming]   " + "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
        )
        for r in rows
    ]
    return "\n".join(lines)

# what a budget at or above every expert's bytes is said to be, by the load line and ``plan`` alike
EVERY_EXPERT = "capped at every expert"
# what a budget the moving budget started below its ceiling is said to be (free memory short)
LOWERED = "lowered to what free memory allows now"


def budget_how(state, budget: int, given_gb=None, free=None) -> str:
    """Where ``budget`` came from and what bounded it, in the words the load line and ``plan``
    share: ``given 100000 GB, capped at every expert``; ``50% of the 25.276 GB of memory that the
    resident weights leave free, raised to one expert per layer``; ``default``."""
    cache = state.cache
    if given_gb is not None:
        how = f"given {gb_as_given(given_gb)} GB"
    elif free is None:
        how = "default"
    else:
        _, part, what = memory.budget_base()
        how = f"{part:.0%} of the {decimal_gb(free)} of {what} that the resident weights leave free"
    if budget >= cache.total_expert_bytes:
        how += ", " + EVERY_EXPERT
    elif cache.moving is not None and budget < cache.moving.ceiling:
        how += ", " + LOWERED  # (planned at load, where memory was short: it grows as it frees)
    elif given_gb is None and budget == sum(b.layer.expert_nbytes for b in cache.banks):
        how += ", raised to one expert per layer"
    return how


def cache_bytes(cache, budget: int) -> int:
    """What a cache with ``budget`` can hold at most: the budget, capped at every expert."""
    return min(budget, cache.total_expert_bytes)


def choice_line(state) -> str:
    """What was chosen, said at load: budget (and where it came from), slots, resident weights."""
    cache = state.cache
    banks = cache.banks
    if cache.budget_bytes is None or not banks:
        return f"[streaming] {state.model_path.name}: no MoE layer streams on this rank"
    how = budget_how(state, cache.budget_bytes, state.options.expert_cache_gb, state.free_bytes)
    if state.options.expert_cache_gb is None and state.free_bytes is not None:
        how = f"default: {how}"
    plan = cache.plan_slots()
    slots = min(plan)
    more = sum(n > slots for n in plan)
    extra = f" ({slots + 1} in {more} layer{'s' if more > 1 else ''})" if more else ""
    experts = "/".join(sorted({str(b.num_experts) for b in banks}))
    tier = ""
    if cache.tiers is not None:
        device = cache_bytes(cache, cache.budget_bytes)
        tier = (
            f" (two tiers: {decimal_gb(device)} on the device, "
            f"{decimal_gb(cache.total_expert_bytes - device)} in host memory read in place)"
        )
        how = f"{how}; host {decimal_gb(cache.host_bytes)}"
    elif cache.host_cache is not None:
        tier = f" (a host cache of {decimal_gb(cache.host_cache.host_bytes)} behind them)"
    return (
        f"[streaming] {state.model_path.name}: expert cache "
        f"{decimal_gb(cache_bytes(cache, cache.slot_budget))} ({how}), {slots} of {experts} "
        f"experts per layer{extra}{tier} in {len(banks)} MoE layer{'s' if len(banks) > 1 else ''}, "
        f"resident weights {decimal_gb(state.resident_bytes)}{_long_prompts(state)}"
    )


_SAID: set = set()  # choice lines already printed in this process


def say(line: str) -> None:
    # once per process: sharded_load splits a structure-only model before the real one, and a
    # server that loads a model again chooses the same
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr, flush=True)


def say_choice(options: StreamingOptions) -> bool:
    """At load, in the mlx-lm commands and where the API asked for it (``verbose=True``)."""
    return options.verbose or cli_streaming


def note_at_exit(line: str) -> None:
    """A line for the stats printed at exit (before them, once), e.g. why a patch was left out."""
    if line not in _NOTES:
        _NOTES.append(line)


def print_stats_at_exit(state) -> None:
    if not _REPORTING:
        atexit.register(_report_stats)
    _REPORTING.append(state)


def _report_stats() -> None:
    shown = []
    for state in _REPORTING:
        s = state.stats()
        if state.closed and s["hits"] + s["misses"] == 0:
            # a model that was dropped unused, e.g. the one sharded_load builds only to see the
            # model's structure before loading the rank's part
            continue
        shown.append(state)
    for line in _NOTES if shown else ():
        print(line, file=sys.stderr, flush=True)
    for state in shown:
        print(stats_line(state, label=len(shown) > 1), file=sys.stderr, flush=True)
        if state.options.stats == "layers":
            print(layers_table(state), file=sys.stderr, flush=True)


def tiers_plan_line(cache, backend: str, trace=None) -> str:
    """``plan``'s line on the two tiers (``tiers``): what the device and the host would hold at
    this budget (the host tier as ``host_split.split`` sizes it where asked for), and with a routing
    trace the share of its decode uses that the device tier would serve (each layer's hottest
    experts there)."""
    from .host_split import available_host_bytes, split

    if backend != "cuda":
        return f"two tiers (--expert-host-gb): mlx-cuda only; {backend} memory is unified"
    total = cache.total_expert_bytes
    device = min(cache.budget_bytes or 0, total)
    host = split(total, device, None, available_host_bytes())
    line = (
        f"two tiers (--expert-host-gb): device {decimal_gb(device)}, host {decimal_gb(host)}"
    )
    if not host and device < total:
        line += (
            f" (host RAM cannot hold the rest, {decimal_gb(total - device)}: a value below it "
            "gives a host cache between the device's slots and disk)"
        )
    if trace is not None and device < total:
        share = trace_share(cache, trace)
        line += f"; the trace's decode uses served by the device tier: {share:.1%}"
    return line


def trace_share(cache, trace) -> float:
    """The share of a trace's decode uses that each layer's hottest experts, as many as the
    device tier holds (``tiers.device_slots``), would serve."""
    import numpy as np

    from .tiers import device_slots

    banks = cache.banks
    plan = device_slots(banks, min(cache.budget_bytes or 0, cache.total_expert_bytes))
    served = used = 0
    for layer, (bank, n) in enumerate(zip(banks, plan)):
        counts = np.zeros(bank.num_experts)
        for row in trace.rows:
            if row.phase == "decode" and row.experts[layer]:
                np.add.at(counts, np.asarray(row.experts[layer], dtype=np.int64), 1)
        served += np.sort(counts)[::-1][:n].sum()
        used += counts.sum()
    return float(served / used) if used else float("nan")
