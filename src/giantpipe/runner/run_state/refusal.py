"""A checkpoint that cannot be read, refused in one line naming the setting that asked for it
(exit 2); a damaged one also names the kept ``step_N/`` to start from instead.

Example::

    with refusing(path, "trainer.resume"):      # CheckpointError -> ConfigError
        run = open_run(path)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from giantpipe.checkpoint.errors import CheckpointDamaged, CheckpointError
from giantpipe.config import ConfigError
from giantpipe.runner.run_state.state import RESUME
from giantpipe.runner.rundir import kept_beside


def refusal(err: CheckpointError, path: Path, key: str = RESUME) -> ConfigError:
    """``err`` as one line naming ``key``; a damaged file also says what to do (start from a
    kept ``step_N/`` beside ``path``)."""
    if not isinstance(err, CheckpointDamaged):
        return ConfigError(key, str(err))
    kept = kept_beside(path)
    if kept is not None:
        verb = "resume" if key == RESUME else "start"
        return ConfigError(key, f"{err}; {verb} from {kept} with {key}={kept}")
    return ConfigError(
        key,
        f"{err}; nothing was removed, and no other checkpoint is kept beside it "
        "(trainer.checkpoint_every keeps step_N/ copies)",
    )


@contextlib.contextmanager
def refusing(path: Path, key: str = RESUME) -> Iterator[None]:
    """A checkpoint that cannot be read inside becomes :func:`refusal`'s ConfigError."""
    try:
        yield
    except CheckpointError as err:
        raise refusal(err, path, key) from err
