"""Exceptions. Each names the file, tensor, layer or option at fault and hints at the fix."""


class StreamingError(Exception):
    """Base class of every error mlx_lm_streaming raises on purpose."""


class CheckpointError(StreamingError, ValueError):
    """A checkpoint file or tensor is missing, damaged, or disagrees with the config."""


class CheckpointChangedError(CheckpointError):
    """A checkpoint file changed on disk after the model was loaded."""


class UnsupportedModelError(StreamingError, ValueError):
    """The model type has no streaming adapter, or uses a feature we cannot stream."""


class ExpertIOError(StreamingError, OSError):
    """Reading expert bytes failed for a reason that retrying does not fix."""


class ConfigurationError(StreamingError, ValueError):
    """An option has a value we cannot use (unknown store or kernel, budget too small)."""


class IncompatibleMlxLmError(StreamingError, RuntimeError):
    """The installed mlx-lm is outside the supported range, or not shaped as we expect."""
