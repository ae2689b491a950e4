"""Build objects from ``_target_`` specs, so models and data sets plug in as config options.

A spec is a schema dataclass or a plain mapping with a ``_target_`` (a dotted path to a
callable) and the keyword arguments to call it with. A new model needs only its builder and a
``conf/model/NAME.yaml``; the runner never changes.

Example::

    model = build_from_target({"_target_": "models.mlp.mlp", "depth": 2}, "model")
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from giantpipe.config import ConfigError
from giantpipe.data.options import MOVED_TARGETS


def spec_to_kwargs(spec: Any) -> dict[str, Any]:
    """A spec (schema dataclass or mapping) as a plain dict, ``_target_`` included."""
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    if isinstance(spec, Mapping):
        return dict(spec)
    raise TypeError(f"expected a schema dataclass or a mapping, got {type(spec).__name__}")


def current_target(path: str) -> str:
    """``path``, or where its builder lives now if it has moved (a saved run's old name).

    Example::

        current_target("giantpipe.data.tensors.classification")
        # "giantpipe.data.synthetic.classification"
    """
    return MOVED_TARGETS.get(path, path)


def locate(path: str, key: str) -> Callable[..., Any]:
    """Import ``package.module.name`` and return the callable; errors name the config ``key``.
    A builder's former name (:func:`current_target`) finds it where it lives now.

    Example::

        locate("models.mlp.mlp", "model._target_")
    """
    module_name, _, attr = current_target(path).rpartition(".")
    if not module_name:
        raise ConfigError(key, f"{path!r} is not a dotted path like package.module.function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(key, f"cannot import {module_name!r} ({err})") from err
    target = getattr(module, attr, None)
    if not callable(target):
        raise ConfigError(key, f"{module_name!r} has no callable {attr!r}")
    return target


def build_from_target(spec: Any, group: str, **context: Any) -> Any:
    """Call the spec's ``_target_`` with its other fields; ``group`` prefixes error keys.

    ``context`` holds what the run knows and a config cannot say (e.g. ``run_dir``, where a
    data builder keeps its vocabulary); each item is passed only to builders that name it.

    Example::

        bundle = build_from_target(cfg.data, "data", run_dir=Path("outputs/run"))
    """
    kwargs = spec_to_kwargs(spec)
    target = locate(str(kwargs.pop("_target_", "")), f"{group}._target_")
    wanted = inspect.signature(target).parameters
    kwargs.update({k: v for k, v in context.items() if k in wanted and k not in kwargs})
    try:
        # Checked before the call so a config field the builder lacks is reported as a config
        # mistake, while a TypeError raised inside the builder stays a real error.
        inspect.signature(target).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(group, f"does not fit {target.__qualname__}: {err}") from err
    return target(**kwargs)
