"""Several banks' loads issued together (``load_together``), each bank's landings taken when its
layer runs again (``later=True``; ``CacheTuning.replay_as_landed``) or all at once (``finish``).

A verified step that missed reads the missed layer's experts and those the pass beyond it named, all
at once, then runs the forward again from the missed layer. Taking every landing before that run
leaves the device idle while the last reads land, and the disk idle while the run computes. Here
each bank's lock is held from its reads' issue until its own landings are taken (``take``: by the
step's MoE call of that bank, before it maps the ids to slots), so the layers run again, each
evaluated as it is built (``VerifiedStep.layer_call``), while the later banks' reads land. No work
reads a bank's slots before its landings are taken: the pass was evaluated before the reads were
issued, and a layer run again reads only its own bank. Verified bit-exact on the CPU
(tests/test_verified_step.py) and on an H100 (every step stock's), where it was 1.05x faster at the
median of 18 cold rounds: on by default on mlx-cuda only; Metal (staged writes) unmeasured.
"""

from typing import Dict


class LaterLandings:
    """The banks of one ``load_together`` whose landings are not taken yet."""

    def __init__(self):
        self.pending: Dict[int, tuple] = {}  # id(bank) -> (bank, landings, ahead)

    def issue(self, loads) -> "LaterLandings":
        """Every bank's lock taken and its reads issued, in ``loads``' order; where one fails,
        the reads already issued end and every lock goes before the error is raised."""
        try:
            for bank, experts, options in loads:
                bank.lock.acquire()
                try:
                    bank.last_stream = None
                    # beside other banks' loads, an expert's ranges are never spread over the
                    # store's readers: each expert is one demand thread's
                    landed, ahead = bank.issue(experts, alone=True, **options)
                except BaseException:
                    bank.lock.release()
                    raise
                self.pending[id(bank)] = (bank, landed, ahead)
        except BaseException:
            self.close()
            raise
        return self

    def take(self, bank) -> None:
        """``bank``'s landings taken (each expert mapped to its slot as it lands), its lock
        released; nothing where it has none pending. A read's error is raised once the bank's
        reads have ended."""
        item = self.pending.pop(id(bank), None)
        if item is None:
            return
        bank, landed, ahead = item
        try:
            for _ in landed:
                pass
            bank._ahead_used.extend(ahead)
        finally:
            landed.close()
            bank.lock.release()

    def finish(self) -> None:
        """Every bank's landings taken, bank after bank, every lock held until all have landed
        (``load_together``'s own way); the first error raised once every read has ended."""
        try:
            for bank, landed, ahead in self.pending.values():
                for _ in landed:
                    pass
                bank._ahead_used.extend(ahead)
        finally:
            self.close()

    def close(self) -> None:
        """Every pending bank's reads ended (those not taken: not mapped), then every lock
        released: an error's, and ``finish``'s end."""
        pending = list(self.pending.values())
        self.pending.clear()
        try:
            for _, landed, _ in pending:
                landed.close()
        finally:
            for bank, _, _ in pending:
                bank.lock.release()
