"""The user options: one row each, the one table that every way of asking for them is made from.

A row names the ``model_config["streaming_experts"]`` key (also ``mlx_lm_streaming.load``'s
keyword), the environment variable and the flag of the mlx-lm commands. ``options.StreamingOptions``
checks the values, ``options.StreamingOptions.from_env`` reads the variables, ``integration`` adds the
flags, ``mlx_lm_streaming.load`` takes the keywords, and the startup hook (``_bootstrap``) knows the
flags and variables from here; ``tests/test_option_table.py`` walks every row through all four.

Stdlib only and cheap: ``_bootstrap`` imports it at interpreter start, before anything else of ours.
"""

# every budget, flag, variable and option counts decimal GB, as mlx-lm's "Peak memory" does
GB = 10**9
PREFIX = "MLX_LM_STREAMING_"
# the words a yes/no variable or option takes; an empty variable counts as unset
ON_WORDS = ("1", "true", "yes", "on")
OFF_WORDS = ("0", "false", "no", "off")

# variables that are not options: the startup hook's switch, the plugin block list (plugins.py), and
# the benchmarks' data directory (bench/memory.py, bench/prefill.py)
HOOK_ENV = PREFIX + "HOOK"
BLOCK_PLUGINS_ENV = PREFIX + "BLOCK_PLUGINS"
OTHER_ENV = (HOOK_ENV, BLOCK_PLUGINS_ENV, PREFIX + "BENCH_DIR")


class Option:
    """One user option: ``name`` is the model_config key and the ``mlx_lm_streaming.load``
    keyword; ``flag`` None: no flag (``why_no_flag`` says why); ``metavar`` None: a flag without a
    value, ``"?"``: a flag whose value may be left out. (A plain class: ``typing`` would cost the
    interpreter's start-up milliseconds.)"""

    __slots__ = ("name", "env", "flag", "metavar", "help", "why_no_flag")

    def __init__(self, name, env, flag, metavar, help, why_no_flag=""):
        self.name, self.env, self.flag, self.metavar = name, env, flag, metavar
        self.help, self.why_no_flag = help, why_no_flag

    def __repr__(self):
        return f"Option({self.name!r}, {self.env!r}, {self.flag!r})"


OPTIONS = (
    Option(
        "enabled",
        PREFIX + "EXPERTS",
        "--streaming-experts",
        None,
        "Stream the routed experts from disk",
    ),
    Option(
        "if_unstreamable",
        PREFIX + "IF_UNSTREAMABLE",
        "--if-unstreamable",
        "refuse|whole",
        "What a Mixture-of-Experts model whose experts cannot stream does: refuse (one line, "
        "exit status 1) or whole (loads every expert, as stock mlx-lm). Default: refuse where "
        "--streaming-experts or model_config asks for streaming, whole where only "
        + PREFIX
        + "EXPERTS does. A model without experts always loads as stock",
    ),
    Option(
        "expert_cache_gb",
        PREFIX + "CACHE_GB",
        "--expert-cache-gb",
        "GB",
        "Expert cache budget in decimal GB (10**9 bytes). Default: 50% of the memory the "
        "resident weights leave free (on CUDA, where the cache is in GPU memory: 80% of the GPU "
        "memory they leave free), at least one expert per MoE layer",
    ),
    Option(
        "expert_cache_fixed",
        PREFIX + "CACHE_FIXED",
        "--expert-cache-fixed",
        None,
        "Pin the expert cache at its budget. Default: the budget is a ceiling, and the cache "
        "follows the memory other programs leave free below it (gives its least used experts' "
        "memory back when the machine runs short, down to one expert per MoE layer, and grows "
        "again when memory is free)",
    ),
    Option(
        "expert_host_gb",
        PREFIX + "HOST_GB",
        "--expert-host-gb",
        "GB",
        "mlx-cuda only: host memory in decimal GB for the experts the device budget cannot hold, "
        "read by the GPU in place; given below what they need: a host cache between the device's "
        "slots and disk; 0: none (misses stream from disk). Default: every expert where free "
        "host RAM less a margin allows, else 0",
    ),
    Option(
        "store",
        PREFIX + "STORE",
        "--expert-store",
        "NAME",
        "Store backend that reads expert bytes. Default: safetensors",
    ),
    Option(
        "store_options",
        PREFIX + "STORE_OPTIONS",
        "--expert-store-options",
        "K=V,...",
        "Options of the store backend, e.g. threads=8 (the store names the ones it knows)",
    ),
    Option(
        "kernel",
        PREFIX + "KERNEL",
        "--expert-kernel",
        "NAME",
        "Kernel that computes the selected experts. Default: auto, the fastest one that is "
        "bit-identical to stock mlx-lm here",
    ),
    Option(
        "cache_policy",
        PREFIX + "CACHE_POLICY",
        "--expert-cache-policy",
        "NAME",
        "Which resident expert a full cache gives up: decay_next (default), decay or lru",
    ),
    Option(
        "direct_reads",
        PREFIX + "DIRECT_READS",
        "--expert-direct-reads",
        "auto|on|off",
        "Read missed experts straight into the cache's slots. Default: auto (on with the CPU "
        "and CUDA backends)",
    ),
    Option(
        "layer_major_prefill",
        PREFIX + "LAYER_MAJOR_PREFILL",
        "--layer-major-prefill",
        "auto|on|off",
        "Prefill a prompt of several chunks layer by layer, each uncached expert read about once "
        "per prompt, each layer over its whole expert set where two layers' sets fit beside the "
        "budget. Default: auto (on with every backend)",
    ),
    Option(
        "stats",
        PREFIX + "STATS",
        "--streaming-stats",
        "?",
        "Print one line at exit: hit rate, experts and GB read, where the time went; with "
        "`layers`, also a table per MoE layer",
    ),
    Option(
        "verbose",
        PREFIX + "VERBOSE",
        None,
        None,
        "Say at load, in one line on stderr, which budget was chosen",
        why_no_flag="the commands always say it",
    ),
    Option(
        "record_routing",
        PREFIX + "RECORD_ROUTING",
        "--record-routing",
        "FILE",
        "Write the experts each MoE layer picks for each token to FILE as the run goes, a "
        "routing trace for `mlx_lm_streaming plan --routing-trace`",
    ),
    Option(
        "trace",
        PREFIX + "TRACE",
        "--streaming-trace",
        "FILE",
        "Write a timeline of expert reads, installs, host syncs and compute to FILE as Chrome "
        "trace-event JSON, for Perfetto or chrome://tracing",
    ),
    Option(
        "pack",
        PREFIX + "PACK",
        "--expert-pack",
        "PATH",
        "Read the experts from this pack (made by `mlx_lm_streaming pack MODEL --out PATH`), "
        "e.g. on another disk; implies --expert-store packed",
    ),
)

BY_NAME = {o.name: o for o in OPTIONS}
ENABLED = BY_NAME["enabled"]
# option name -> environment variable
ENV = {o.name: o.env for o in OPTIONS}
FLAGS = tuple(o.flag for o in OPTIONS if o.flag)


# the command-line modules whose main() takes our flags (integration/cli.py: wrap_cli_main)
CLI_MODULES = (
    "mlx_lm.generate",
    "mlx_lm.chat",
    "mlx_lm.server",
    "mlx_lm.cache_prompt",
    "mlx_lm.evaluate",
    "mlx_lm.perplexity",
)
