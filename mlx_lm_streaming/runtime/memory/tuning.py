"""How an ``ExpertCache`` schedules its reads: ``CacheTuning``, the settings benchmarks and tests
vary (``expert_cache`` imports it for those that import it from there)."""

from dataclasses import dataclass
from typing import Optional

from ...errors import ConfigurationError
from .moving_budget import CHECK_SECONDS

# experts this big and bigger are read a projection at a time (``CacheTuning.phase_min_bytes``)
PHASE_MIN_BYTES = 16 << 20
# demand reads in flight (``CacheTuning.reads_in_flight``): the H200's disk gave its best at 8-16
# whole-expert reads; a stacked checkpoint's expert is nine ranges read in turn, which needed four
# times the reads in flight of whole ones on this box's disk (docs/benchmarks/streaming-path.md)
READS_IN_FLIGHT = 16
# readers of a layer set's fill through device copies (``CacheTuning.set_readers``): page cache ->
# page-locked buffer -> device on the H200, a 0.36 GB range: 16.1 / 15.7 / 10.3 GB/s at 4 / 8 / 16
# threads (the copy engine's queue, not the page cache, bounds it: the reads alone gave 24 / 37 /
# 31 GB/s; docs/benchmarks/prefill.md); 8 keeps a cold disk's queue as deep as its best
SET_READERS = 8


# ``CacheTuning.set_stage``'s values (None: no stage; ``bank.layer_set.STAGES`` makes the others)
SET_STAGES = (None, "device", "host")


@dataclass(frozen=True)
class CacheTuning:
    """How an ``ExpertCache`` schedules its reads, fixed at construction. Each setting only moves or
    drops work; none changes what is computed, and each is kept for a measured reason
    (docs/benchmarks/README.md). Defaults that benchmarks and tests vary (through the internal
    ``tuning`` entry of the streaming options, not a user option); what users choose (direct reads,
    layer-major prefill) is theirs alone (``StreamingOptions``), resolved at load and given to the
    cache beside this (``ExpertCache.direct_reads``, ``ExpertCache.layer_major_prefill``)."""

    # next-layer lookahead (prefetch.py); its guesses are read only while a layer's running
    # precision is at least ``lookahead_min_precision`` (a wrong guess costs a read), and so are
    # a verified step's (``read_misses_together``: ``StepRunner.guess_precision``)
    lookahead: bool = True
    lookahead_min_precision: float = 0.5
    # decode-sized calls whose experts are all resident run with no host sync per layer, checked
    # once per call (``verified_step.py``)
    verified_steps: bool = True
    # a verified step that finds a miss reads, with the missed layer's experts, those the pass
    # beyond it picked and lacks, all at once, then runs again from the missed layer
    # (``verified_step.py``); off: the missed layer's alone, the rest found by later checks
    read_misses_together: bool = True
    # those reads' landings taken bank by bank as the forward runs again, each layer evaluated as
    # it is built, so the layers run again while the later banks' reads land
    # (``bank.later_landings``); False: every landing taken first; None: on mlx-cuda only (an
    # H100, cold at 25-50%: 1.05x the default, median of 18 rounds, 14 faster; the CPU: 2.51
    # against 2.47 tok/s; Metal unmeasured: docs/benchmarks/streaming-path.md)
    replay_as_landed: Optional[bool] = None
    # a verified step's check reads its MoE calls' ids back one at a time while the device runs
    # the pass ahead, and issues a miss's reads (and the guesses') as the calls name them
    # (``decode.named_reads``); False: all ids read back, then the reads; None: on mlx-cuda only.
    # Exact; an H100 cold with the Qwen3 trace: 1.02x at 25% (within the spread), 1.04x at 50%,
    # so off (docs/benchmarks/streaming-path.md)
    reads_in_pass: Optional[bool] = False
    # where a quarter of verified steps' first MoE call missed, that call's ids read back as it
    # is built and its misses' reads issued then, the rest of the pass built and computed while
    # they read (``named_reads.look_first``); None: on mlx-cuda only (an H100, cold at 25-50%,
    # the Qwen3 trace and uniform routing: 1.065x the default, median of 12 rounds, 10 faster;
    # the CPU: 3.69 against 3.63 tok/s; Metal, whose banks stage, unmeasured:
    # docs/benchmarks/streaming-path.md). Exact
    first_call_reads: Optional[bool] = None
    # checked_late.py: steps held while at most this share of decode calls missed; None: off
    checked_late: Optional[float] = 0.25
    # a held step's check (its wait for the ids, the policies' records) on a thread of its own,
    # while the decode thread builds and launches the next token (``StepRunner.check_soon``);
    # False: on the decode thread, after the next token's launch; None: on mlx-cuda only (the
    # H100, 99% hits: 0.817 of stock against 0.753 without, side by side; the CPU: 0.717 and 0.671
    # against 0.729 and 0.680, none gained; Metal unmeasured: docs/benchmarks/streaming-path.md)
    check_on_thread: Optional[bool] = None
    # on mlx-cuda, a step's MoE calls' ids joined by one kernel (``bank.join_ids``: a held step's
    # check, the tiers' batches) instead of a copy kernel each; None or True: on mlx-cuda (never
    # elsewhere); False: MLX's own stack. Exact on an H100 (its bytes are the stack's; 15 kernels
    # a step fewer), but with the ids read by the copy engine (``ids_by_copy``, since removed: a
    # host read it was) faster in 12 of 20 rounds of the hit regime and 7 of 10 of the tiers at
    # 99%, medians 1.008x and 1.018x: within the noise, so off (docs/benchmarks/streaming-path.md,
    # tiers.md: "The sixteenth session")
    join_kernel: Optional[bool] = False
    # decode-sized expert calls over mlx-lm's own SwitchGLU (``mlx_shims.switch_glu``: a verified
    # step's, a complete bank's, the tiers') give each projection's rows of ``x`` to
    # ``gather_qmm`` as an index array made once per shape, where MLX builds an ``arange`` in each
    # call: three kernels a MoE call fewer, the same primitive over the same values (stock's
    # bits); an H100, 99% hits: 0.885 of stock against 0.842 (medians of six runs side by side,
    # faster in five), the tiers at 99% 0.953 against 0.834 (docs/benchmarks/streaming-path.md,
    # tiers.md); False: the module's own call
    kept_row_indices: bool = True
    # with them, that call and a verified step's (its slot map too) compiled by ``mx.compile``
    # with every array an input (``bank.compiled_glu``: built once per shape, the same primitives
    # and mlx-lm's own fused ``swiglu``); None: on the CPU and mlx-cuda, bit for bit on both (an
    # H100, 99% hits: the build 0.08-0.10 ms a step shorter, 1.03-1.06x in three runs side by
    # side; the CPU both ways, within its noise: docs/benchmarks/streaming-path.md); off on Metal
    # (unverified)
    compiled_glu: Optional[bool] = None
    # how a decode-sized call chooses between a verified step and the per-layer schedule
    # (``share_limits.CHOICES``): "limits", by the per-backend limits on the share of MoE layers
    # that missed; "always", a verified step wherever one may run; None: "limits"
    verify_choice: Optional[str] = None
    # with direct reads, a load of at most this many experts spreads each expert's ranges over the
    # store's readers; a load of more reads each expert on its own demand thread alone (fewer
    # thread hand-offs: docs/history.md, "A token's misses read together"); None: always
    # spread
    spread_reads_upto: Optional[int] = 1
    # demand reads in flight at once (the demand threads, each reading one expert): a token's
    # misses read together keep this many reads queued at the disk
    # (docs/benchmarks/streaming-path.md, "The reads' queue depth"); None: the store's threads
    reads_in_flight: Optional[int] = READS_IN_FLIGHT
    # a layer set's readers where its fill goes through device copies (mlx-cuda); None:
    # ``reads_in_flight``
    set_readers: Optional[int] = SET_READERS
    # on mlx-cuda, direct reads go into a page-locked buffer and are copied into the slots by the
    # CUDA runtime (``cuda_copy.py``: the slots' managed pages stay on the device); off: host
    # writes through the banks' views. Nothing changes on other backends
    device_copies: bool = True
    # with device copies, a long prompt's layer set is filled into a stage while the device
    # computes and moved into the set when its layer starts, the device idle. "device": device
    # memory outside MLX, the readers' copies go there (``cuda_copy.DeviceStage``, one more set's
    # bytes on the device, where three sets fit; else two sets and no stage); "host": page-locked
    # host memory the readers read into, no copy until the layer starts (``cuda_copy.HostStage``);
    # None: straight into the set. The H200, Qwen3 shape at 25%, one run: 4K tokens 1.45 / 1.43 s
    # to the first token staged on the device against 1.70 / 1.52 straight in and 1.67 / 1.74
    # through the host, 16K 4.39 s against 4.62 and 4.65, the same bits (docs/benchmarks/prefill.md)
    set_stage: Optional[str] = "device"
    # with direct reads, experts of at least this many bytes are read a projection at a time
    # (``schedules.ByProjection``); None: never
    phase_min_bytes: Optional[int] = PHASE_MIN_BYTES
    # bound on bytes staged by background reads; None: ``STAGING_SHARE`` of the budget
    staging_bytes: Optional[int] = None
    # bound on the hidden states held between layers for one group of chunks; None: no bound
    prefill_hold_bytes: Optional[int] = 1 << 30
    # long prompts' layers over whole expert sets where two fit (``machine.layer_sets_fit``);
    # off: waves
    layer_sets: bool = True
    # over two tiers (mlx-cuda), long prompts layer-major over layer sets too: each layer's device
    # tier copied into its set on the device, its host tier read from the store once (the
    # streaming path's fill), where two sets fit beside the device tier; off: each chunk's MoE
    # calls over a device copy of the whole bank (``bank.device_copy``). The H200, a 4K prompt at
    # 25%: 2.61x / 2.59x stock's first token over sets, 4.28x / 8.89x over copies of the banks,
    # the same bits (docs/benchmarks/tiers.md)
    tier_layer_sets: bool = True
    # over two tiers, a bank's device tier moves only where its use counts are more uneven than
    # chance makes them (``tiers.MIN_SKEW``, their index of dispersion; None: that); 0: wherever
    # the margins say. An H200, uniform routing (every move chasing chance): 1.08-1.35x at a
    # quarter of the experts on the device, 1.12x at half (docs/benchmarks/tiers.md)
    tier_min_skew: Optional[float] = None
    # a pair of experts swaps only where their counts differ by more than this many standard
    # deviations of chance (None: ``tiers.SWAP_Z``, 2); 0: by the margins alone. On the traces'
    # replays (the CPU) a fifth to a seventh of the moves at a tenth and a quarter of the experts
    # on the device, as many uses served or more (the trained model's drifting routing: 12-20%
    # fewer moves, 0.5-0.9% fewer uses served); an H100, both traces: 1.11x and 1.46x at a
    # quarter, 1.58x and 1.03x at a tenth (docs/design.md, docs/benchmarks/tiers.md)
    tier_swap_z: Optional[float] = None
    # seconds between two readings of free memory where the budget follows it
    # (``moving_budget``); None: no thread (tests take the readings themselves: ``budget_watch``)
    budget_check_seconds: Optional[float] = CHECK_SECONDS

    def cuda_only(self, field: str, cuda: bool) -> bool:
        """Whether ``field`` (``join_kernel``: a CUDA runtime path) is on: on
        mlx-cuda (``cuda``) unless it is False, never elsewhere."""
        return cuda and getattr(self, field) is not False

    def __post_init__(self):
        for field in ("tier_min_skew", "tier_swap_z"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0):
                raise ConfigurationError(
                    f"CacheTuning.{field}={value!r}: a number, 0 or more, or None"
                )
        if self.set_stage not in SET_STAGES:
            raise ConfigurationError(
                f"CacheTuning.set_stage={self.set_stage!r}: one of "
                f"{', '.join(repr(k) for k in SET_STAGES)}"
            )
