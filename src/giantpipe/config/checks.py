"""ConfigError and the check helpers every schema's ``__post_init__`` uses.

Every check raises :class:`ConfigError`, whose message starts with the dotted key, so a user sees
``trainer.max_steps: must be >= 1, got 0`` rather than a stack trace. The schemas of the model
and data options (``models/``, ``giantpipe/data/``) use these helpers too; this module imports
no torch, so the command line runs them before torch is imported.

Example::

    from giantpipe.config import ConfigError, check_min

    try:
        check_min(0, 1, "trainer.max_steps")
    except ConfigError as err:
        print(err)                          # trainer.max_steps: must be >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; ``key`` is the dotted key that names it.

    Example::

        raise ConfigError("trainer.max_steps", "must be >= 1, got 0")
    """

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


def check(ok: bool, key: str, problem: str) -> None:
    """Raise ``ConfigError(key, problem)`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, problem)


def check_choice(value: object, choices: tuple[str, ...], key: str) -> None:
    """``value`` is one of ``choices``."""
    check(value in choices, key, f"must be one of {', '.join(choices)}; got {value!r}")


def check_min(value: float, low: float, key: str) -> None:
    """``value >= low``."""
    check(value >= low, key, f"must be >= {low}, got {value}")


FP32_MAX = 3.4028234663852886e38


def check_finite(value: Any, key: str) -> None:
    """Every float in ``value`` (a number, or lists and mappings of them) is finite: ``nan`` and
    ``inf`` are never a setting, and any other check would refuse them for the wrong reason.

    Example::

        check_finite(float("nan"), "optim.weight_decay")
        # ConfigError: optim.weight_decay: must be a finite number, got nan
    """
    if isinstance(value, float):
        check(math.isfinite(value), key, f"must be a finite number, got {value}")
    elif isinstance(value, list | tuple):
        for item in value:
            check(
                not isinstance(item, float) or math.isfinite(item),
                key,
                f"must hold finite numbers, got {list(value)}",
            )
    elif isinstance(value, dict):
        for name, item in value.items():
            check_finite(item, f"{key}.{name}" if key else str(name))


def check_fields_finite(schema: Any, group: str) -> None:
    """:func:`check_finite` on every field of a config dataclass (nested ones have their own)."""
    for item in dataclasses.fields(schema):
        value = getattr(schema, item.name)
        if not dataclasses.is_dataclass(value):
            check_finite(value, f"{group}.{item.name}")


def check_fp32(value: float, key: str) -> None:
    """``value`` fits a float32, the type of the weights it is applied to."""
    check(
        abs(value) <= FP32_MAX,
        key,
        f"{value} overflows float32, the weights' type (at most {FP32_MAX:.3g})",
    )


def host_memory_bytes() -> int:
    """This machine's physical memory (RAM), the most any data held in memory can take."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits_memory(nbytes: int, keys: str, what: str) -> None:
    """Refuse, before allocating, data that could never fit this machine's memory.

    A size typed with a few zeros too many would otherwise be rendered or drawn for minutes
    and then die out of memory; this says so at once, naming the keys that set it::

        check_fits_memory(10**12 * 64, "data.train_size, data.features", "the training set")
        # ConfigError: data.train_size, data.features: the training set would take 58 TiB of
        # memory; this machine has 24 GiB
    """
    ram = host_memory_bytes()
    check(
        nbytes <= ram,
        keys,
        f"{what} would take {human_bytes(nbytes)} of memory; this machine has {human_bytes(ram)}",
    )


def human_bytes(n: float, decimals: int | None = None) -> str:
    """A byte count as people read it: whole bytes, else three significant digits of the
    largest binary unit below it; ``decimals``: that many digits after the point instead (a
    table's column, which lines up).

    >>> human_bytes(512), human_bytes(3 * 2**30), human_bytes(1.5 * 2**20)
    ('512 B', '3 GiB', '1.5 MiB')
    >>> human_bytes(2048, decimals=1)
    '2.0 KiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            if unit == "B":
                return f"{n:.0f} B"
            return f"{n:.{decimals}f} {unit}" if decimals is not None else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_optional_path(value: Any, key: str) -> None:
    """``value`` is a path (a string) or None."""
    check(value is None or isinstance(value, str), key, f"must be a path or null, got {value!r}")
