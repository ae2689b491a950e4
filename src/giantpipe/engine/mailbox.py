"""The mailbox: how the workers of one step hand each other activations and gradients.

Keys are ``("act", stage, m)`` (input of ``stage`` for micro-batch ``m``) and
``("grad", stage, m)`` (gradient of ``stage``'s output). A ``get`` blocks until the item
arrives, the pipeline is aborted (another worker failed), or the timeout passes; nothing waits
forever. The distributed executor's mailbox (:mod:`giantpipe.engine.distributed.p2p`) keeps this
interface and reaches other processes.

Example::

    >>> box = Mailbox(timeout=1.0)
    >>> box.put(("act", 1, 0), "x")
    >>> box.get(("act", 1, 0))
    'x'
"""

from __future__ import annotations

import threading
import time
from typing import Any

from giantpipe.engine.failures import Aborted, PipelineTimeout

__all__ = ["Key", "Mailbox"]

Key = tuple[str, int, int]


class Mailbox:
    """Thread-safe hand-over of values between workers, with abort and timeout."""

    def __init__(self, timeout: float) -> None:
        self._items: dict[Key, Any] = {}
        self._cond = threading.Condition()
        self._aborted = False
        self.timeout = timeout

    def put(self, key: Key, value: Any) -> None:
        with self._cond:
            self._items[key] = value
            self._cond.notify_all()

    def get(self, key: Key) -> Any:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while key not in self._items:
                if self._aborted:
                    raise Aborted
                left = deadline - time.monotonic()
                if left <= 0:
                    kind, stage, m = key
                    what = "activation" if kind == "act" else "gradient"
                    raise PipelineTimeout(
                        f"waited {self.timeout:g}s for the {what} of micro-batch {m} "
                        f"into stage {stage}"
                    )
                self._cond.wait(left)
            return self._items.pop(key)

    def holds(self, key: Key) -> bool:
        """Whether ``key`` has arrived (a :meth:`get` of it would not wait)."""
        with self._cond:
            return key in self._items

    def consumed_here(self, key: Key) -> bool:
        """Whether a worker of this process takes ``key`` (a mailbox across processes sends
        some elsewhere: nobody here waits for their CUDA events)."""
        return True

    def abort(self) -> None:
        """Wakes every waiting worker with :class:`Aborted`; the others see :attr:`aborted`
        before their next action."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    @property
    def aborted(self) -> bool:
        return self._aborted
