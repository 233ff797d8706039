"""Writing files whole: a reader never sees a half-written file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

__all__ = ["atomic_write"]


# ------------------------------------------------------------------------ checkpoint
def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Write through a temporary file in the same folder, then rename it into place."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=folder)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
