"""Which mlx-lm we can patch, and the check that guards every patch.

Everything mlx_lm_streaming changes in mlx-lm is decided here: ``integration.patch_module`` (called
by the startup hook, ``_bootstrap``, right after an mlx-lm module is imported) asks ``problem()`` and
``load_model_problem()`` before it patches anything. They check:

1. the installed mlx-lm version is in ``SUPPORTED`` (the releases the test suite runs against);
2. what it patches has the shape it expects (``load_model``'s parameters, the commands' ``main``,
   ``SwitchGLU``'s signature and the body of its ``__call__``, which ``schedules/direct.py`` runs a
   projection at a time through ``mlx_shims.switch_glu_*``).

This module is the gate; the shims the hot path uses once the gate passed are ``mlx_shims``.

If either check fails it patches **nothing**: mlx-lm runs stock. Streaming asked for by flag or by
``MLX_LM_STREAMING_EXPERTS`` then fails in one line that names the mlx-lm version found and the
supported range (``refusal``), instead of silently loading every expert into memory.
"""

import inspect
import os
import re
import sys
from typing import Optional, Tuple

# the command-line modules whose main() takes our flags (listed once, with the startup hook)
from ..option_table import CLI_MODULES

# mlx-lm releases we test (tests/run.sh runs the newest, .ci/run the oldest too): >= LOW, < HIGH
SUPPORTED = ((0, 30, 0), (0, 33, 0))
SUPPORTED_TEXT = ">=0.30.0, <0.33"
# parameters of mlx_lm.utils.load_model we read or pass on (any others pass through untouched)
LOAD_MODEL_PARAMETERS = ("model_path", "lazy", "strict", "model_config", "get_model_classes")


def mlx_lm_version() -> Optional[str]:
    """The installed mlx-lm's version string, or None where it cannot be told."""
    package = sys.modules.get("mlx_lm")
    version = getattr(package, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib.metadata import version as dist_version

        return dist_version("mlx-lm")
    except Exception:
        return None


def parse_version(text: str) -> Optional[Tuple[int, int, int]]:
    """``"0.32.2"`` -> ``(0, 32, 2)``; pre-release and local tails are ignored; None if not numeric."""
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            return None
        parts.append(int(digits))
        if len(digits) < len(piece):
            break
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


def version_problem(version: Optional[str] = None) -> Optional[str]:
    """None if ``version`` (default: the installed one) is supported, else why not, in words."""
    if version is None:
        version = mlx_lm_version()
    parsed = parse_version(version) if version else None
    if parsed is None:
        return f"the mlx-lm version could not be told ({version!r})"
    low, high = SUPPORTED
    if not low <= parsed < high:
        return f"mlx-lm {version} is installed; mlx-lm-streaming supports mlx-lm {SUPPORTED_TEXT}"
    return None


def load_model_problem(load_model) -> Optional[str]:
    """None if ``load_model`` takes the parameters we read, by those names, and has a default for
    ``get_model_classes`` (``model_classes``), else what is missing."""
    problem = _missing(load_model, "mlx_lm.utils.load_model", LOAD_MODEL_PARAMETERS)
    if problem:
        return problem
    if model_classes(load_model) is None:
        return "mlx_lm.utils.load_model's get_model_classes has no default taking config="
    return None


def _takes(fn, name: str) -> bool:
    """Whether ``fn`` can be called with the keyword argument ``name``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _missing(fn, name: str, wanted) -> Optional[str]:
    """Which of the parameters ``wanted`` mlx-lm's ``name`` (``fn``) does not take, as a problem
    line; None where it takes them all."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return f"{name} has no signature to check"
    missing = [p for p in wanted if p not in params]
    return f"{name} takes no {', '.join(missing)}" if missing else None


def _takes_one(fn) -> bool:
    """Whether ``fn`` can be called with one positional argument."""
    try:
        inspect.signature(fn).bind(None)
    except (TypeError, ValueError):
        return False
    return True


def model_classes(load_model=None):
    """The function mlx-lm's ``load_model`` finds a model's classes with, ``(config=...) ->
    (Model, ModelArgs)``: the default of its ``get_model_classes`` parameter (``load_model``: the
    stock one, default ``mlx_lm.utils.load_model``). None where there is none taking ``config``."""
    if load_model is None:
        from mlx_lm import utils

        load_model = getattr(utils, "load_model", None)
    try:
        param = inspect.signature(load_model).parameters.get("get_model_classes")
    except (TypeError, ValueError):
        return None
    get = None if param is None else param.default
    if get is inspect.Parameter.empty or not callable(get) or not _takes(get, "config"):
        return None
    return get


def download(repo: str):
    """mlx-lm's own resolution of a Hugging Face hub id to a local directory (``utils._download``:
    downloads, or uses its cache), or None where this mlx-lm has no such function taking a repo."""
    from mlx_lm import utils

    get = getattr(utils, "_download", None)
    if not callable(get) or not _takes_one(get):
        return None
    return get(repo)


def wrap_pipeline(model, around) -> bool:
    """Route ``model.model.pipeline(group, ...)`` (mlx-lm's split of a model's layers among the
    ranks of a pipeline group) through ``around(stock, group, *args, **kwargs)``, where ``stock``
    is the model's own method. Nothing is changed (False) where the model has no ``pipeline`` that
    takes a group."""
    inner = getattr(model, "model", None)
    stock = getattr(inner, "pipeline", None)
    if not callable(stock) or not _takes_one(stock):
        return False

    def pipeline(group, *args, **kwargs):
        return around(stock, group, *args, **kwargs)

    inner.pipeline = pipeline
    return True


def pipeline_span(model) -> Tuple[int, int]:
    """``(first layer, end layer)`` that this pipeline rank of ``model`` keeps, once split (the
    inner model's ``start_idx`` and ``end_idx``)."""
    return model.model.start_idx, model.model.end_idx


# mlx-lm's SwitchGLU sorts its rows by expert from this many indices on (``do_sort = indices.size
# >= 64`` in SwitchGLU.__call__): below it, a call is the unsorted ops ``switch_glu_*`` repeat. The
# streaming layer also uses it to tell decode-sized calls from prefill-sized ones
SORT_THRESHOLD = 64
# the statements of SwitchGLU.__call__ (whitespace removed) that ``switch_glu_*`` repeat below the
# sort threshold; checked at patch time (``switch_glu_problem``)
SWITCH_GLU_BODY = (
    "x=mx.expand_dims(x,(-2,-3))",
    f"do_sort=indices.size>={SORT_THRESHOLD}",
    "x_up=self.up_proj(x,idx,sorted_indices=do_sort)",
    "x_gate=self.gate_proj(x,idx,sorted_indices=do_sort)",
    "x=self.down_proj(self.activation(x_up,x_gate),idx,sorted_indices=do_sort",
    "returnx.squeeze(-2)",
)


def switch_glu_problem(switch_glu=None) -> Optional[str]:
    """None if mlx-lm's ``SwitchGLU`` (or ``switch_glu``) has the signature we replace and the call
    body ``switch_glu_*`` repeat, else what differs."""
    if switch_glu is None:
        try:
            from mlx_lm.models.switch_layers import SwitchGLU as switch_glu
        except ImportError as e:
            return f"mlx_lm.models.switch_layers.SwitchGLU cannot be imported ({e})"
    params = list(inspect.signature(switch_glu.__call__).parameters)
    if params[1:3] != ["x", "indices"]:
        return f"SwitchGLU.__call__ takes {params[1:]}, not (x, indices)"
    init = inspect.signature(switch_glu.__init__).parameters
    if "activation" not in init:
        return "SwitchGLU takes no activation"
    try:
        body = re.sub(r"\s+", "", inspect.getsource(switch_glu.__call__))
    except (OSError, TypeError):
        return "the source of SwitchGLU.__call__ cannot be read"
    for statement in SWITCH_GLU_BODY:
        if statement not in body:
            return f"SwitchGLU.__call__ no longer does {statement!r}"
    return None


# the bodies (whitespace removed) of the switch projections' ``__call__`` that
# ``mlx_shims.switch_glu`` repeats below SORT_THRESHOLD indices, each call's rows of ``x`` given
# (mlx-lm 0.32, with ``global_scale``, and 0.30-0.31); a class whose body is neither keeps its call
_CALL = "def__call__(self,x,indices,sorted_indices=False):x=mx."
_END = "sorted_indices=sorted_indices,)"
_BIAS = 'if"bias"inself:x=x+mx.expand_dims(self["bias"][indices],-2)returnx'
_QMM = ('gather_qmm(x,self["weight"],self["scales"],self.get("biases"),rhs_indices=indices,'
        "transpose=True,group_size=self.group_size,bits=self.bits,mode=self.mode,")  # fmt: skip
SWITCH_LINEAR_BODIES = {
    _CALL + _QMM + "global_scale=self.global_scale," + _END + _BIAS: "global",
    _CALL + _QMM + _END + _BIAS: "quantized",
    _CALL + 'gather_mm(x,self["weight"].swapaxes(-1,-2),rhs_indices=indices,' + _END + _BIAS: (
        "plain"
    ),
}


def switch_linears() -> dict:
    """mlx-lm's switch projection classes whose ``__call__`` is one of ``SWITCH_LINEAR_BODIES``:
    class -> its kind there ("global": ``gather_qmm`` with ``global_scale``, "quantized":
    without, "plain": ``gather_mm``); none where the module cannot be read."""
    try:
        from mlx_lm.models import switch_layers
    except ImportError:
        return {}
    found = {}
    for name in ("QuantizedSwitchLinear", "SwitchLinear"):
        cls = getattr(switch_layers, name, None)
        try:
            body = re.sub(r"\s+", "", inspect.getsource(cls.__call__))
        except (AttributeError, OSError, TypeError):
            continue
        kind = SWITCH_LINEAR_BODIES.get(body)
        if kind is not None and (kind == "plain") == (name == "SwitchLinear"):
            found[cls] = kind
    return found


# SwitchGLU.__call__ below SORT_THRESHOLD indices, one step at a time (streaming computes a read
# expert's gate and up projections while its down projection is still read: schedules.ByProjection)


_problem: Optional[str] = None
_checked = False


def problem() -> Optional[str]:
    """Why this mlx-lm cannot be patched (checked once per process), or None."""
    global _problem, _checked
    if not _checked:
        _problem = version_problem() or switch_glu_problem()
        _checked = True
    return _problem


def streaming_in_environment(environ=os.environ) -> bool:
    from .options import ENV, FALSE

    return environ.get(ENV["enabled"], "").strip().lower() not in FALSE


def refusal(why: str) -> str:
    """The one line that says streaming cannot run with this mlx-lm."""
    return f"mlx-lm-streaming: streaming experts is not available: {why}; mlx-lm runs stock"


_refused = False


def say_refusal(message: str) -> None:
    """Print ``message`` on stderr, once per process."""
    global _refused
    if not _refused:
        _refused = True
        print(message, file=sys.stderr, flush=True)


# -- the prompt's prefill (layer_major.py) -----------------------------------------------------------

# parameters of mlx_lm.generate.generate_step that layer-major prefill reads or passes on
GENERATE_STEP_PARAMETERS = (
    "prompt",
    "model",
    "stream",
    "max_kv_size",
    "prompt_cache",
    "prefill_step_size",
    "kv_bits",
    "logits_processors",
    "prompt_progress_callback",
    "input_embeddings",
)
# the statements of generate_step (whitespace removed) whose work layer-major prefill does in
# another order: the cache it makes, the chunks it cuts (all but the last token, in chunks of
# prefill_step_size), the tokens the logits processors see, the last token's step
GENERATE_STEP_BODY = (
    "prompt_cache=make_prompt_cache(model,max_kv_size=max_kv_size",
    "whiletotal_prompt_tokens-prompt_processed_tokens>1:",
    "remaining=(total_prompt_tokens-prompt_processed_tokens)-1",
    "n_to_process=min(prefill_step_size,remaining)",
    "_model_call(input_tokens=processed[None],",
    "mx.concat([tokens,input_tokens])",
    "logits=processor(tokens,logits)",
    "prompt_progress_callback(total_prompt_tokens,total_prompt_tokens)",
)


# the statements of generate_step (whitespace removed) that the decode loop with late checks
# (checked_late.py) does itself after stock's first step: a step's sampling, the loop's order, the
# first step as the place where max_tokens=0 stops (its draw ends stock's run; the progress
# callback's calls before it, the call after it made by the loop), and KV quantization as a
# no-op without kv_bits
DECODE_LOOP_BODY = (
    "logits=logits[:,-1,:]",
    "iflogits_processorsandlen(input_tokens)>0:",
    "logprobs=logits-mx.logsumexp(logits,keepdims=True)",
    "sampled=sampler(logprobs)",
    "returnsampled,logprobs.squeeze(0)",
    "y,logprobs=_step(input_tokens=prompt,input_embeddings=input_embeddings)",
    "prompt_progress_callback(prompt_processed_tokens,total_prompt_tokens)",  # (before it)
    "whiletotal_prompt_tokens-prompt_processed_tokens>1:",
    "ifn==0:mx.eval(y)prompt_progress_callback(total_prompt_tokens,total_prompt_tokens)",
    "ifn!=max_tokens:next_y,next_logprobs=_step(y)",
    "ifn==max_tokens:break",
    "yieldy.item(),logprobs",
    "ifn%256==0:mx.clear_cache()",
    "sampler=samplerorgreedy_sampler",
    "returnmodel(input_tokens,cache=prompt_cache)",
)


def decode_loop_problem(generate_step) -> Optional[str]:
    """None if mlx-lm's ``generate_step`` decodes as the loop with late checks does after its first
    step (``DECODE_LOOP_BODY``), and ``maybe_quantize_kv_cache`` does nothing without
    ``kv_bits``, else what differs."""
    wanted = (*GENERATE_STEP_PARAMETERS, "max_tokens", "sampler")
    problem = _missing(generate_step, "mlx_lm.generate.generate_step", wanted)
    if problem:
        return problem
    try:
        body = re.sub(r"\s+", "", inspect.getsource(generate_step))
        from mlx_lm.generate import maybe_quantize_kv_cache

        quantize = re.sub(r"\s+", "", inspect.getsource(maybe_quantize_kv_cache))
    except (ImportError, OSError, TypeError):
        return "the source of mlx_lm.generate.generate_step cannot be read"
    for statement in DECODE_LOOP_BODY:
        if statement not in body:
            return f"mlx_lm.generate.generate_step no longer does {statement!r}"
    if "ifkv_bitsisNone:return" not in quantize:
        return "mlx_lm's maybe_quantize_kv_cache may quantize without kv_bits"
    return None


def generate_step_problem(generate_step) -> Optional[str]:
    """None if mlx-lm's ``generate_step`` takes the parameters layer-major prefill reads and has
    the chunked prefill it reorders, else what differs."""
    problem = _missing(generate_step, "mlx_lm.generate.generate_step", GENERATE_STEP_PARAMETERS)
    if problem:
        return problem
    try:
        body = re.sub(r"\s+", "", inspect.getsource(generate_step))
    except (OSError, TypeError):
        return "the source of mlx_lm.generate.generate_step cannot be read"
    for statement in GENERATE_STEP_BODY:
        if statement not in body:
            return f"mlx_lm.generate.generate_step no longer does {statement!r}"
    return None


# the prefills that do not go through generate_step, where layer-major prefill does not apply and
# says so (layer_major.note_elsewhere): mlx-lm's BatchGenerator (the server's batched requests,
# batch_generate) prefills a chunk per step, interleaved with decoding, into batched caches; a
# draft model's speculative_generate_step prefills both models chunk by chunk itself
BATCH_INSERT = {"insert_segments": "segments", "insert": "prompts"}  # newest first


def batch_insert_problem(batch_generator) -> Optional[str]:
    """None if mlx-lm's ``BatchGenerator`` takes prompts through ``insert_segments(segments, ...)``
    (0.32) or ``insert(prompts, ...)`` (0.30), on a generator with a ``prefill_step_size``; else
    what differs."""
    if not isinstance(batch_generator, type):
        return "mlx_lm.generate has no BatchGenerator class"
    if "prefill_step_size" not in _parameters(batch_generator.__init__):
        return "BatchGenerator takes no prefill_step_size"
    for name, first in BATCH_INSERT.items():
        method = getattr(batch_generator, name, None)
        if callable(method):
            params = list(_parameters(method))
            if params[1:2] != [first]:
                return f"BatchGenerator.{name} takes {params[1:2]}, not {first}"
            return None
    return "BatchGenerator has no insert_segments or insert"


def _parameters(fn):
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def wrap_batch_insert(batch_generator, before) -> None:
    """Call ``before(generator, lengths)`` (each inserted prompt's length in tokens) ahead of
    every insertion of prompts into a ``BatchGenerator`` (``batch_insert_problem`` found none)."""
    import functools

    name = next(n for n in BATCH_INSERT if callable(getattr(batch_generator, n, None)))
    stock = getattr(batch_generator, name)
    if getattr(stock, "mlx_lm_streaming", False):
        return

    @functools.wraps(stock)
    def insert(self, *args, **kwargs):
        prompts = args[0] if args else kwargs.get(BATCH_INSERT[name], ())
        if name == "insert_segments":
            lengths = [sum(len(s) for s in segments) for segments in prompts]
        else:
            lengths = [len(p) for p in prompts]
        before(self, lengths)
        return stock(self, *args, **kwargs)

    insert.mlx_lm_streaming = True
    setattr(batch_generator, name, insert)


SPECULATIVE_PARAMETERS = ("prompt", "model", "draft_model", "prefill_step_size")


def speculative_problem(speculative_generate_step) -> Optional[str]:
    """None if mlx-lm's ``speculative_generate_step`` takes the parameters read to tell a long
    prompt, else what is missing."""
    name = "mlx_lm.generate.speculative_generate_step"
    return _missing(speculative_generate_step, name, SPECULATIVE_PARAMETERS)


