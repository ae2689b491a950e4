"""The mailbox through which stage workers hand each other activations and gradients.

Keys are ``("act", stage, m)`` (input of ``stage`` for micro-batch ``m``) and
``("grad", stage, m)`` (gradient of ``stage``'s output). A ``get`` blocks until the item arrives,
the pipeline is aborted (another worker failed), or the timeout passes; nothing waits forever.

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

Key = tuple[str, int, int]


class Aborted(Exception):
    """Raised in a waiting worker when another worker has failed."""


class PipelineTimeout(RuntimeError):
    """A worker waited longer than the timeout for an activation or gradient."""


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
                        f"waited {self.timeout:.0f}s for the {what} of micro-batch {m} "
                        f"into stage {stage}"
                    )
                self._cond.wait(left)
            return self._items.pop(key)

    def abort(self) -> None:
        """Wakes every waiting worker with :class:`Aborted`."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    @property
    def aborted(self) -> bool:
        return self._aborted
