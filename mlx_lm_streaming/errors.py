"""Exceptions. Each names the file, tensor, layer or option at fault and hints at the fix."""


class StreamingError(Exception):
    """Base class of every error mlx_lm_streaming raises on purpose."""


class CheckpointError(StreamingError, ValueError):
    """A checkpoint file or tensor is missing, damaged, or disagrees with the config."""


class CheckpointChangedError(CheckpointError):
    """A checkpoint file changed on disk after the model was loaded."""


class UnsupportedModelError(StreamingError, ValueError):
    """The model type has no streaming adapter, or uses a feature we cannot stream."""


class NotMixtureOfExpertsError(UnsupportedModelError):
    """The model has no routed experts: a load that asks for streaming loads it as stock would."""


class UnstreamableModelError(UnsupportedModelError):
    """A Mixture-of-Experts model whose routed experts cannot stream (``architectures/refused.py``
    says why): refused, or loaded whole where ``if_unstreamable`` says so."""


class ExpertIOError(StreamingError, OSError):
    """Reading expert bytes failed for a reason that retrying does not fix."""


class ConfigurationError(StreamingError, ValueError):
    """An option has a value we cannot use (unknown store or kernel, budget too small)."""


class IncompatibleMlxLmError(StreamingError, RuntimeError):
    """The installed mlx-lm is outside the supported range, or not shaped as we expect."""


def exit_status(error: StreamingError) -> int:
    """2 for a bad option (like argparse), 1 for a checkpoint, model or I/O failure."""
    return 2 if isinstance(error, ConfigurationError) else 1


def one_line(error: BaseException) -> str:
    """The error's message on one line (a JSON error or a nested message may hold newlines)."""
    return " ".join(str(error).split()) or type(error).__name__


def exit_with(prog: str, error: StreamingError) -> None:
    """Print ``<prog>: error: <message>`` on stderr and exit with ``exit_status(error)``."""
    import sys

    try:
        sys.stdout.flush()
    except Exception:  # stdout closed or a broken pipe: the error line still goes out
        pass
    sys.stderr.write(f"{prog}: error: {one_line(error)}\n")
    sys.stderr.flush()
    raise SystemExit(exit_status(error))


def open_output(path, what: str):
    """``open(path, "w")`` for a file written by a caller of our API (``TraceWriter``);
    ``ConfigurationError`` naming the file and ``what`` it is if that fails. The files of a
    streaming run are checked and opened by ``outputs.py``'s rules instead."""
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as e:
        raise ConfigurationError(f"{path}: cannot write the {what} ({e.strerror or e})") from None

