"""Routing traces: which experts each MoE layer picked for each token (JSON Lines, version 1).

The first line is a header, then one line per token in the order the model ran them::

    {"format": "moe-routing-trace", "version": 1, "model": "...", "num_layers": 48,
     "num_experts": 128, "top_k": 6, ...}
    {"seq": 0, "phase": "prefill", "experts": [[49, 19, 58, 29, 16, 70], [...], ...]}

``num_layers`` counts MoE layers only; ``experts[i]`` lists the ids the i-th MoE layer picked for the
token, in the router's rank order (an empty list: the layer did not run for it). ``seq`` numbers
independent sequences; ``phase`` is ``prefill`` or ``decode``. ``read_trace`` validates a file and
names the file and line of the first problem; ``TraceWriter`` appends one line per token and flushes
it, so an interrupted run leaves a valid prefix; ``RoutingRecorder`` turns the expert ids each MoE
layer of a streaming model was called with into such lines (``--record-routing``). Stdlib and numpy
only.
"""

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import CheckpointError, ConfigurationError, open_output
from .outputs import (
    ROUTING_TRACE,
    TRACE_FORMAT,
    check_output,
    close_quietly,
    identity,
    open_for_run,
    say_failed,
)

FORMAT = TRACE_FORMAT
VERSION = 1
PHASES = ("prefill", "decode")


class TraceError(CheckpointError):
    """A routing trace file is missing, malformed, or does not fit the model."""


@dataclass
class TraceRow:
    """One token: its sequence, phase, and per MoE layer the expert ids in rank order."""

    seq: int
    phase: str
    experts: List[List[int]]


@dataclass
class RoutingTrace:
    header: Dict
    rows: List[TraceRow] = field(default_factory=list)
    path: Optional[Path] = None

    @property
    def num_layers(self) -> int:
        return self.header["num_layers"]

    @property
    def num_experts(self) -> int:
        return self.header["num_experts"]

    @property
    def top_k(self) -> int:
        return self.header["top_k"]

    def check_model(self, num_layers: int, num_experts: int) -> None:
        """One-line ``TraceError`` if the trace's MoE layer or expert counts are not the model's
        (a different top-k is fine: the trace's own choices are used)."""
        if (self.num_layers, self.num_experts) != (num_layers, num_experts):
            raise TraceError(
                f"{self.path}: routing trace has {self.num_layers} MoE layers x "
                f"{self.num_experts} experts but the model has {num_layers} x {num_experts}; "
                "record a trace of this model (--record-routing)"
            )


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_header(header, where: str) -> Dict:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceError(f'{where}: not a routing trace (the header needs "format": "{FORMAT}")')
    if header.get("version") != VERSION:
        raise TraceError(
            f"{where}: routing trace version {header.get('version')!r} is not supported "
            f"(this reader knows version {VERSION})"
        )
    for key in ("num_layers", "num_experts", "top_k"):
        if not _int(header.get(key)) or header[key] < 1:
            raise TraceError(f"{where}: header field {key!r} must be a positive integer")
    return header


def _check_row(row, header: Dict, where: str) -> TraceRow:
    if not isinstance(row, dict):
        raise TraceError(f"{where}: a token line must be a JSON object")
    seq, phase, experts = row.get("seq"), row.get("phase"), row.get("experts")
    if not _int(seq) or seq < 0:
        raise TraceError(f"{where}: 'seq' must be a non-negative integer")
    if phase not in PHASES:
        raise TraceError(f"{where}: 'phase' must be 'prefill' or 'decode', got {phase!r}")
    if not isinstance(experts, list) or len(experts) != header["num_layers"]:
        raise TraceError(
            f"{where}: 'experts' must list {header['num_layers']} MoE layers (the header's "
            "num_layers)"
        )
    n = header["num_experts"]
    for i, ids in enumerate(experts):
        if not isinstance(ids, list) or not all(_int(e) and 0 <= e < n for e in ids):
            raise TraceError(
                f"{where}: MoE layer {i} must list expert ids in 0..{n - 1} (the header's "
                "num_experts)"
            )
        if len(set(ids)) != len(ids):
            raise TraceError(f"{where}: MoE layer {i} lists an expert twice")
    return TraceRow(seq, phase, experts)


def read_trace(path) -> RoutingTrace:
    """Read and validate a trace; ``TraceError`` names the file and line at fault."""
    path = Path(path)
    try:
        handle = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{path}: cannot read the routing trace ({e.strerror or e})") from None
    trace = None
    with handle:
        try:
            for number, line in enumerate(handle, 1):
                where = f"{path}:{number}"
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except ValueError as e:
                    raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
                if trace is None:
                    trace = RoutingTrace(_check_header(value, where), path=path)
                else:
                    trace.rows.append(_check_row(value, trace.header, where))
        except UnicodeDecodeError:
            raise TraceError(f"{path}: not a routing trace (not UTF-8 text)") from None
    if trace is None:
        raise TraceError(f"{path}: empty file, not a routing trace")
    return trace


def check_decode_tokens(trace: RoutingTrace) -> None:
    """``TraceError`` if ``trace`` holds no decode token (what the budget figures are per)."""
    if not any(row.phase == "decode" for row in trace.rows):
        raise TraceError(
            f"{trace.path}: the routing trace has no decode tokens ({len(trace.rows)} prefill "
            "tokens), and hit rates and GB read are per decode token: record one from a run that "
            "generates, without --draft-model (whose verify steps are prefill)"
        )


class TraceWriter:
    """Appends a trace as a run goes: the header when opened, then one flushed line per token."""

    def __init__(
        self, path, num_layers: int, num_experts: int, top_k: Optional[int], file=None, **header
    ):
        """``top_k`` None: the header is written with the first token, whose longest list of
        expert ids gives it. ``file``: ``path`` already open for writing (else it is opened here,
        and a failure is a ``ConfigurationError``)."""
        self.path = Path(path)
        self.num_layers = num_layers
        self._file = file if file is not None else open_output(self.path, "routing trace")
        self._header = {
            "format": FORMAT,
            "version": VERSION,
            **header,
            "num_layers": num_layers,
            "num_experts": num_experts,
            "top_k": top_k,
        }
        if top_k is not None:
            self._line(self._header)
            self._header = None

    def _line(self, value: Dict) -> None:
        self._file.write(json.dumps(value) + "\n")
        self._file.flush()

    def token(self, seq: int, phase: str, experts) -> None:
        """One token: ``experts[i]`` the ids MoE layer i picked, in rank order (lists or arrays)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        if len(experts) != self.num_layers:
            raise ValueError(f"{len(experts)} layers given, the trace has {self.num_layers}")
        rows = [[int(e) for e in ids] for ids in experts]
        if self._header is not None:
            self._header["top_k"] = max(1, max(len(ids) for ids in rows))
            self._line(self._header)
            self._header = None
        self._line({"seq": int(seq), "phase": phase, "experts": rows})

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_same_model(path: Path, header: Dict) -> None:
    """``ConfigurationError`` if ``path`` holds the routing trace of another model than the one
    ``header`` is for (``model_path``; a trace without one by its ``model`` name), as ``pack``
    refuses to replace another model's pack: a trace is not lost to a run of another model."""
    try:
        with open(path, encoding="utf-8") as f:
            old = json.loads(f.readline())
    except (OSError, ValueError):
        return  # no file, or nothing of a trace in it (check_output has judged it)
    if not isinstance(old, dict):
        return
    key = "model_path" if "model_path" in old else "model"
    theirs, ours = old.get(key), header.get(key)
    if theirs is None or ours is None or theirs == ours:
        return
    raise ConfigurationError(
        f"{path}: holds the routing trace of another model ({theirs}), not of "
        f"{header.get('model_path', ours)}; refusing to replace it: give another path for the "
        "routing trace, or remove the file to record over it"
    )


class RoutingRecorder:
    """Records a streaming model's routing: ``record(bank, idx)`` from each MoE layer's call.

    ``banks()`` gives the model's MoE layer banks in model order (each has ``num_experts``). A token's
    line is written once every MoE layer has reported its call, or when a layer reports twice (a layer
    that did not run gets an empty list). A prompt's tokens but its last are ``prefill`` whatever
    the size of their calls (``prefill_ahead``, from the wrapped ``generate_step``); past them a
    call of more than one token is ``prefill``, of one token ``decode`` (mlx-lm runs the last prompt
    token in the first one-token step); each row of a batched call is its own sequence, and a
    prefill after decoding starts new sequences.

    One recorder per file in a process: a second model asking for the same file (a draft model) is
    not recorded (``claimed``)."""

    _open: set = set()  # resolved paths of the recorders not closed yet

    def __init__(self, path, banks: Callable[[], Sequence], model_path=None, **header):
        self.path = Path(path)
        self.banks = banks
        self.header = header
        self.lock = threading.Lock()
        self.writer: Optional[TraceWriter] = None
        self.layer_of: Dict[int, int] = {}
        self.pending: Dict[int, object] = {}  # layer -> expert ids of its call
        self.seq = 0
        self.width = 1  # sequences in the current batch
        self.phase = None
        self.prompt_left = 0  # prompt tokens still to come before decoding (``prefill_ahead``)
        # a bad path fails at load; the file is opened at the first token, once the load passed
        check_output(self.path, ROUTING_TRACE, model_path)
        if model_path is not None:
            self.header["model_path"] = str(Path(model_path).resolve())
            check_same_model(self.path, self.header)
        self.seen = identity(self.path)  # what may be replaced at the first token
        self.failed = False  # writing failed: the trace was given up (outputs.say_failed)
        RoutingRecorder._open.add(self.path.resolve())

    def record(self, bank, idx) -> None:
        """``idx``: the expert ids of one call of ``bank``'s layer, ``(..., tokens, k)``. Never
        raises for the file: a write that fails gives the trace up, in one line on stderr."""
        with self.lock:
            if self.failed:
                return
            try:
                self._record(bank, idx)
            except OSError as e:
                self._give_up(e)

    def _give_up(self, error: OSError) -> None:
        # under the lock
        self.failed = True
        self.pending = {}
        say_failed(self.path, ROUTING_TRACE, error)
        if self.writer is not None:
            close_quietly(self.writer._file)

    def _record(self, bank, idx) -> None:
        if self.writer is None:
            banks = list(self.banks())
            self.layer_of = {id(b): i for i, b in enumerate(banks)}
            experts = max(b.num_experts for b in banks)
            file = open_for_run(self.path, self.seen)  # an OSError gives the trace up
            self.writer = TraceWriter(
                self.path, len(banks), experts, None, file=file, **self.header
            )
        layer = self.layer_of[id(bank)]
        if layer in self.pending:
            self._flush()
        # (batch, tokens, k)
        self.pending[layer] = (
            idx.reshape(-1, *idx.shape[-2:]) if idx.ndim > 1 else idx.reshape(1, 1, -1)
        )
        if len(self.pending) == self.writer.num_layers:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        first = next(iter(self.pending.values()))
        batch, tokens = first.shape[0], first.shape[1]
        phase = "prefill" if tokens > 1 or self.prompt_left > 0 else "decode"
        self.prompt_left = max(0, self.prompt_left - tokens)
        if self.phase == "decode" and phase == "prefill":
            self.seq += self.width  # a new prompt
        self.phase, self.width = phase, batch
        for b in range(batch):
            for t in range(tokens):
                rows = [
                    self.pending[i][b, t] if i in self.pending else ()
                    for i in range(self.writer.num_layers)
                ]
                self.writer.token(self.seq + b, phase, rows)
        self.pending = {}

    def prefill_ahead(self, tokens: int) -> None:
        """The next ``tokens`` tokens are a prompt's (mlx-lm's ``generate_step`` prefills all but
        its last token, in chunks of any size, one token too): recorded as prefill."""
        with self.lock:
            self.prompt_left = max(0, int(tokens))

    @classmethod
    def claimed(cls, path) -> bool:
        """Whether an open recorder of this process writes ``path``."""
        return Path(path).resolve() in cls._open

    def close(self) -> None:
        with self.lock:
            RoutingRecorder._open.discard(self.path.resolve())
            if self.writer is not None and not self.failed:
                try:
                    self._flush()
                    self.writer.close()
                except OSError as e:
                    self._give_up(e)
