"""One-line errors: any failure as ONE line that names the config key or the path, and why (and
any warning as one line: :func:`one_line_warning`).

Hydra, OmegaConf and YAML report over several lines, often with the reason on the second;
:func:`one_line` condenses each to the line ``train.py`` prints after ``error:``, and
:func:`is_config_error` tells a refused config (exit 2) from a run that failed (exit 1)::

    $ python train.py pipeline.chunk=4
    error: pipeline.chunk: unknown key (Key 'chunk' not in 'PipelineConfig'); did you mean
    pipeline.chunks?
"""

from __future__ import annotations

import difflib

import yaml
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

from giantpipe.cli.checks import near_key, renamed
from giantpipe.cli.registration import OPTION_SCHEMAS
from giantpipe.config import ConfigError


def is_config_error(err: BaseException) -> bool:
    """A refused config (exit 2), as opposed to a run that failed (exit 1)."""
    return isinstance(err, ConfigError | OmegaConfBaseException | ConfigCompositionException)


def _first_line(text: str) -> str:
    return next((part.strip() for part in text.splitlines() if part.strip()), text.strip())


def one_line(err: BaseException) -> str:
    """A one-line description of ``err`` naming the config key or the path involved, and the
    reason (never only the first line of a message whose reason is on the next)."""
    if isinstance(err, ConfigError):
        return str(err)
    if isinstance(err, MissingConfigException):
        return _missing_option(err)
    cause = err.__cause__ if isinstance(err, ConfigCompositionException) else err
    if isinstance(cause, OmegaConfBaseException):
        return _omegaconf_line(cause)
    if isinstance(cause, yaml.MarkedYAMLError):
        return _yaml_line(cause)
    if isinstance(err, OSError) and err.filename:
        return f"{err.filename}: {err.strerror or err}"
    io = err.__cause__
    if isinstance(err, ValueError) and isinstance(io, OSError) and io.filename:
        # logging.config could not open Hydra's log file: the run directory is not writable
        return f"hydra.run.dir: cannot write {io.filename} ({io.strerror or io})"
    if isinstance(err, ConfigCompositionException):
        return _joined(str(err))
    return f"{type(err).__name__}: {_joined(str(err))}"


def _joined(text: str) -> str:
    """A message's lines on one line (its reason is often on the second)."""
    return "; ".join(part.strip() for part in text.splitlines() if part.strip()) or text.strip()


def _omegaconf_line(cause: OmegaConfBaseException) -> str:
    key = getattr(cause, "full_key", None) or ""
    if renamed(key):
        return f"{key}: renamed to {renamed(key)}"
    problem = _first_line(str(cause))
    if "not in" in problem and key:  # a typo: name the field it was probably meant to be
        return f"{key}: unknown key ({problem}){near_key(key, getattr(cause, 'object_type', None))}"
    return f"{key}: {problem}" if key else _joined(str(cause))


def _yaml_line(err: yaml.MarkedYAMLError) -> str:
    """``conf/optim/adamw.yaml:10: while parsing a flow sequence: expected ',' or ']'``."""
    mark = err.problem_mark or err.context_mark
    where = f"{mark.name}:{mark.line + 1}" if mark is not None else "a config file"
    reason = ": ".join(part for part in (err.context, err.problem) if part)
    return f"{where}: {reason or type(err).__name__}"


def _missing_option(err: MissingConfigException) -> str:
    """``model=foo``: an option that does not exist; list the real ones (schemas left out) and
    name the one spelt nearly the same, if any (``recipe=mlp_quickstrat``)."""
    group, _, option = (err.missing_cfg_file or "").rpartition("/")
    if not group or err.options is None:  # not a GROUP=OPTION choice: the primary config
        return _first_line(str(err))
    real = [o for o in err.options if o not in OPTION_SCHEMAS]
    shown = f" (available: {', '.join(real)})" if real else ""
    close = difflib.get_close_matches(option, real, n=1)
    near = f"; did you mean {group}={close[0]}?" if close else ""
    return f"{group}={option}: no such option{shown}{near}"


def one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    """A warning as one line, for ``warnings.formatwarning`` (Python's own adds the line of
    source that warned): giantpipe's own warnings as ``warning: TimingNoise: ...``, other
    packages' with the place that warned.

    >>> print(one_line_warning("spread 82%", UserWarning, "/x/costs.py", 252, "warn()"), end="")
    /x/costs.py:252: UserWarning: spread 82%
    """
    text = _joined(str(message))
    if category.__module__.split(".")[0] in ("giantpipe", "models"):
        return f"warning: {category.__name__}: {text}\n"
    return f"{filename}:{lineno}: {category.__name__}: {text}\n"
