"""``QueueWorker``: items handled in order on one daemon thread, started when an item comes and
ended once none is left; the background fill of identity banks (``expert_cache``) and the tiers'
moves (``tiers``) each keep one."""

import threading
from typing import Callable, List, Optional


class QueueWorker:
    """Hands each ``put`` item to ``handle`` on a thread named ``name``, in order, one at a time."""

    def __init__(self, name: str, handle: Callable[[object], None]):
        self.name = name
        self.handle = handle
        self.lock = threading.Lock()
        self.items: List[object] = []
        # the running thread (None once it decided to end: a put starts another), and every one
        # started that may still be alive, which ``join`` waits for even while it is ending (one
        # that decided to end can still be alive when a put starts the next)
        self.thread: Optional[threading.Thread] = None
        self.started: List[threading.Thread] = []
        self.closed = False

    def put(self, item) -> bool:
        """Queue ``item`` (the thread started if none runs); False once closed: dropped."""
        with self.lock:
            if self.closed:
                return False
            self.items.append(item)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self.started = [t for t in self.started if t.is_alive()] + [self.thread]
                self.thread.start()
        return True

    def _run(self) -> None:
        while True:
            with self.lock:
                if self.closed or not self.items:
                    self.thread = None
                    return
                item = self.items.pop(0)
            self.handle(item)

    def close(self) -> None:
        """No item handled after the one running (those queued are dropped)."""
        with self.lock:
            self.closed = True
            self.items = []

    def join(self) -> None:
        """Wait for every thread started, but the caller."""
        with self.lock:
            started = list(self.started)
        for thread in started:
            if thread is not threading.current_thread():
                thread.join()
