"""Kernel selector: picks the kernel for each layer call by backend, quantization and row count.

``auto`` takes the highest-priority kernel that is available on this backend, exact here, and supports
the bank. A kernel named explicitly is used even if inexact (that is the user's opt-in, warned once); if
it cannot run on this backend, or does not support the bank, the selector says so once and falls back
to ``auto``.
"""

import threading
import warnings
import weakref

from .. import plugins
from ..errors import ConfigurationError
from ..runtime.devices import backend

# row counts whose choice is remembered per bank: decode repeats a few, prompts of every length
# would otherwise grow the memo without bound
MEMO_ROWS = 64


class KernelSelector:
    def __init__(self, choice: str = "auto"):
        self.kernels = plugins.kernels()
        if choice != "auto" and choice not in self.kernels:
            raise ConfigurationError(
                plugins.unknown_name(
                    "expert kernel",
                    choice,
                    ["auto", *self.kernels],
                    "--expert-kernel / MLX_LM_STREAMING_KERNEL / kernel=",
                )
            )
        self.choice = choice
        self.backend = backend()
        self._warned = set()
        # bank -> {rows: kernel}, kept on the bank object itself (weakly): an entry leaves with its
        # bank, so a new bank that reuses a freed one's id() never gets the freed one's choice
        self._memo = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def _warn_once(self, key, msg):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=3)

    def select(self, bank, rows: int):
        with self._lock:
            try:
                memo = self._memo.setdefault(bank, {})
            except TypeError:  # a bank that takes no weak reference: nothing is remembered
                memo = {}
            kernel = memo.get(rows)
        if kernel is None:
            kernel = self._select(bank, rows)
            with self._lock:
                while len(memo) >= MEMO_ROWS:
                    del memo[next(iter(memo))]  # the oldest
                memo[rows] = kernel
        return kernel

    def _select(self, bank, rows):
        if self.choice != "auto":
            kernel = self.kernels[self.choice]
            if not kernel.available():
                self._warn_once(
                    ("na", kernel.name),
                    f"expert kernel {kernel.name!r} cannot run on {self.backend}; using auto",
                )
            elif not kernel.supports(bank):
                self._warn_once(
                    ("ns", kernel.name, bank.path),
                    f"expert kernel {kernel.name!r} does not support {bank.path}; using auto",
                )
            else:
                if not kernel.exact(self.backend):
                    self._warn_once(
                        ("inexact", kernel.name),
                        f"expert kernel {kernel.name!r} is not bit-identical to stock mlx-lm on "
                        f"{self.backend}; outputs may differ slightly",
                    )
                return kernel
        candidates = [
            k
            for k in self.kernels.values()
            if k.available() and k.exact(self.backend) and k.supports(bank)
        ]
        if not candidates:
            raise ConfigurationError(
                f"no exact expert kernel supports {bank.path} on {self.backend}"
            )
        return max(candidates, key=lambda k: k.priority(self.backend, bank, rows))
