"""Writing files whole: a reader never sees a half-written file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

__all__ = ["atomic_write", "current_umask", "file_mode"]


def current_umask() -> int:
    """The process's umask (from /proc on Linux, else by setting and restoring it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode(*, directory: bool = False, private: bool = False) -> int:
    """The mode of a file or folder this package writes: what ``open`` and ``mkdir`` would give
    (0666 / 0777 less the umask), or with ``private`` readable by the owner only (0600 / 0700)."""
    if private:
        return 0o700 if directory else 0o600
    return (0o777 if directory else 0o666) & ~current_umask()


# ------------------------------------------------------------------------ checkpoint
def atomic_write(path: str, write: Callable[[str], None], *, private: bool = False) -> None:
    """Write through a temporary file in the same folder, then rename it into place. The file
    gets the mode of :func:`file_mode` (the umask's; 0600 with ``private``), not the 0600 of
    the temporary file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=folder)
    mode = file_mode(private=private)
    try:
        os.fchmod(fd, mode)
        os.close(fd)
        fd = -1
        write(tmp)
        # again: a writer may replace the file (safetensors' save_file leaves it 0600)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
