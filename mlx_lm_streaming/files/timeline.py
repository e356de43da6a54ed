"""Timeline of a streaming run as Chrome trace-event JSON (``--streaming-trace FILE``).

The file opens in Perfetto (ui.perfetto.dev) and chrome://tracing: one lane per thread (the thread that
calls the model, the demand readers, the background readers), and on them per MoE layer call its host
sync, every expert read (layer, expert, bytes, start and end), the installs of staged bytes into the
slot banks, the submission of compute (``mx.async_eval``) and the waits for reads or compute. A
``decode`` or ``prefill`` span (category ``step``) on the calling thread groups the MoE layer calls of
one forward pass.

The file uses the format's JSON Array form: ``[`` then one complete event (``"ph": "X"``, ``ts`` and
``dur`` in microseconds) per line. Events are written in batches, at least once a second, so an
interrupted run leaves a file the viewers open (the format makes the closing ``]`` optional); ``close``
writes the ``]``, so a finished file is plain JSON. The file is opened at the first write, after the
load passed; a write that fails (a full disk) gives the timeline up with one line on stderr, and the
run goes on (``outputs.py``).

Off by default: ``cache.timeline`` is then ``runtime.no_timeline.NO_TIMELINE``, whose recording calls
do nothing (no Python call). Recording never changes what is read or computed.
"""

import json
import os
import threading
import time
from typing import Optional

from .outputs import TIMELINE, check_output, close_quietly, identity, open_for_run, say_failed

# events kept in memory before they are written, and the longest they wait
FLUSH_EVENTS = 512
FLUSH_SECONDS = 1.0


class Timeline:
    """Thread-safe recorder of trace events, written to ``path`` as the run goes."""

    _open: set = set()  # real paths of the timelines not closed yet (one writer per file)

    def __init__(self, path, process_name: str = "mlx-lm-streaming", model_path=None):
        """Checks ``path`` (``outputs.check_output``) but opens it only at the first write, once the
        load passed; a write that fails gives the timeline up in one line on stderr, and the run
        goes on."""
        self.path = str(path)
        check_output(self.path, TIMELINE, model_path)
        self._seen = identity(self.path)  # what may be replaced at the first write
        self._file = None  # opened by the first ``_write``
        self._failed = False
        self._closed = False
        Timeline._open.add(os.path.realpath(self.path))
        self.pid = os.getpid()
        self._origin = time.perf_counter()
        self._lock = threading.Lock()
        self._pending = []
        self._first = True
        self._last_flush = self._origin
        self._threads = set()
        self._step = 0  # forward passes seen; see ``layer``
        self._step_layers = set()
        self._step_span = None  # (start, end, tokens) of the current step
        self._pending.append("[")
        self._event(
            {
                "name": "process_name",
                "ph": "M",
                "pid": self.pid,
                "tid": 0,
                "args": {"name": process_name},
            }
        )

    @classmethod
    def claimed(cls, path) -> bool:
        """Whether an open timeline of this process writes ``path`` (a draft model asking for the
        same file is not recorded)."""
        return os.path.realpath(path) in cls._open

    @staticmethod
    def now() -> float:
        """``time.perf_counter()``: the clock of every ``start`` given here (seconds)."""
        return time.perf_counter()

    def span(self, name: str, start: float, cat: str, **args) -> None:
        """A complete event on the calling thread, from ``start`` (``now()``) to now."""
        end = self.now()
        self._add(name, cat, start, end, threading.get_native_id(), args)

    def read(self, start: float, layer: str, expert: int, nbytes: int, kind: str, **args) -> None:
        """One expert's bytes read from the store, on the calling thread, from ``start`` to now."""
        self.span(
            "read",
            start,
            "read",
            layer=layer,
            expert=int(expert),
            bytes=int(nbytes),
            kind=kind,
            **args,
        )

    def batch_read(self, start: float, batch, error=None) -> None:
        """A ``StagedBatch`` read in one store call: one read event per expert, each spanning the
        call (the store reads the batch's ranges together)."""
        end = self.now()
        tid = threading.get_native_id()
        extra = {"error": f"{type(error).__name__}: {error}"} if error is not None else {}
        for e in batch.wanted():
            args = dict(
                layer=batch.layer.path,
                expert=e,
                bytes=batch.layer.expert_nbytes,
                kind=batch.kind,
                batch=len(batch.experts),
                **extra,
            )
            self._add("read", "read", start, end, tid, args)

    def layer(self, start: float, path: str, tokens: int, **args) -> None:
        """One MoE layer call, on the calling thread. A layer called again starts a new step (a
        forward pass): the step before is written as a span over its layer calls."""
        end = self.now()
        tid = threading.get_native_id()
        with self._lock:
            if path in self._step_layers:
                self._end_step()
            self._step_layers.add(path)
            if self._step_span is None:
                self._step_span = [start, end, tokens, tid]
            self._step_span[1] = end
            step = self._step
        self._add(
            "layer", "layer", start, end, tid, dict(layer=path, step=step, tokens=tokens, **args)
        )

    def _end_step(self) -> None:
        # under the lock
        if self._step_span is not None:
            start, end, tokens, tid = self._step_span
            phase = "prefill" if tokens > 1 else "decode"
            self._event(
                self._complete(
                    phase,
                    "step",
                    start,
                    end,
                    tid,
                    {"step": self._step, "phase": phase, "tokens": tokens},
                )
            )
            self._step += 1
        self._step_layers = set()
        self._step_span = None

    def _add(self, name, cat, start, end, tid, args) -> None:
        if self._failed:
            return
        event = self._complete(name, cat, start, end, tid, args)
        with self._lock:
            if tid not in self._threads:
                self._threads.add(tid)
                self._event(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": self.pid,
                        "tid": tid,
                        "args": {"name": threading.current_thread().name},
                    }
                )
            self._event(event)
            due = end - self._last_flush >= FLUSH_SECONDS
            if len(self._pending) >= FLUSH_EVENTS or due:
                self._write()

    def _complete(self, name, cat, start, end, tid, args) -> dict:
        # a complete event; ts and dur in microseconds since the timeline started
        ts = (start - self._origin) * 1e6
        dur = max(0.0, end - start) * 1e6
        return {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": round(ts, 3),
            "dur": round(dur, 3),
            "pid": self.pid,
            "tid": tid,
            "args": args,
        }

    def _event(self, event) -> None:
        # under the lock (or from __init__)
        self._pending.append(json.dumps(event, separators=(",", ":")))

    def _write(self, end: str = "") -> None:
        # under the lock; the first call opens the file ("[" is the first pending line). Never
        # raises for the file: a failure gives the timeline up (``_give_up``)
        if self._closed or self._failed or not (self._pending or end):
            return
        try:
            if self._file is None:
                self._file = open_for_run(self.path, self._seen)
            text = ",\n".join(self._pending)
            if self._first:
                text = text.replace("[,\n", "[\n", 1)
            elif text:
                text = ",\n" + text
            self._file.write(text + end)
            self._file.flush()
        except OSError as e:
            self._give_up(e)
            return
        self._first = False
        self._pending = []
        self._last_flush = time.perf_counter()

    def _give_up(self, error: OSError) -> None:
        # under the lock
        self._failed = True
        self._pending = []
        say_failed(self.path, TIMELINE, error)
        if self._file is not None:
            close_quietly(self._file)

    def flush(self) -> None:
        with self._lock:
            self._write()

    def discard(self) -> None:
        """Close without writing, for a load that failed: a file not opened yet stays as it was."""
        with self._lock:
            if self._file is None:
                self._closed = True
                self._pending = []
                Timeline._open.discard(os.path.realpath(self.path))

    def close(self) -> None:
        """Write what is left and the closing ``]`` (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._end_step()
            self._write(end="\n]\n")
            self._closed = True
            Timeline._open.discard(os.path.realpath(self.path))
            if self._file is not None and not self._failed:
                try:
                    self._file.close()
                except OSError as e:
                    self._give_up(e)


def open_timeline(path: Optional[str], process_name: str, model_path=None) -> Optional[Timeline]:
    """The timeline for a model that asks for ``path``; None when off or the file is another
    open timeline's. Nothing is opened yet (see ``Timeline``)."""
    if not path or Timeline.claimed(path):
        return None
    return Timeline(path, process_name, model_path)
