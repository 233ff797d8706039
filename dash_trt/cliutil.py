"""What every dash-trt command line shares: the exit code and the one-line report of an
unexpected error, and ``--verbose`` for its traceback.

Each command handles the errors a user can act on itself (exit 2 for bad input, 1 only for
a mismatch, its own codes for the rest, each listed in its ``--help``). An error nobody
foresaw, a bug, must not become a Python traceback on a user's terminal either, nor exit
1 (which would read as "mismatch"): :func:`cli_main` turns it into one line and exit
:data:`EXIT_INTERNAL` (70, ``EX_SOFTWARE`` of sysexits.h), and with ``--verbose`` (or
``DASH_TRT_VERBOSE=1``) prints the traceback before that line. Ctrl-C that a command does
not handle itself exits 130 with one line.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable, Sequence

#: exit code of an unexpected internal error (sysexits.h EX_SOFTWARE)
EXIT_INTERNAL = 70
#: exit code after Ctrl-C (the shell's 128 + SIGINT)
EXIT_INTERRUPTED = 130
#: the environment variable that asks every command for tracebacks
VERBOSE_ENV = "DASH_TRT_VERBOSE"
#: the sentence each command's ``--help`` carries after its own exit codes
EXIT_CODES_NOTE = (
    f"{EXIT_INTERNAL} an unexpected internal error (one line; --verbose prints its traceback), "
    f"{EXIT_INTERRUPTED} Ctrl-C."
)
VERBOSE_HELP = "print the traceback of an unexpected error (also DASH_TRT_VERBOSE=1)"


def verbose_requested(argv: Sequence[str] | None) -> bool:
    """``--verbose`` anywhere on the command line (whatever the command's own meaning of it),
    or DASH_TRT_VERBOSE set to anything but empty / 0."""
    if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
        return True
    args = sys.argv[1:] if argv is None else list(argv)
    return any(a == "--verbose" or a.startswith("--verbose=") for a in args)


def _one_line(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[:limit] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def report_internal_error(prog: str, exc: BaseException, argv: Sequence[str] | None, stream=None) -> int:
    """Print the one-line report of ``exc`` (after its traceback with --verbose); returns
    :data:`EXIT_INTERNAL`."""
    stream = stream if stream is not None else sys.stderr
    if verbose_requested(argv):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=stream)
        hint = "please report it with the traceback above"
    else:
        hint = "rerun with --verbose for the traceback, and please report it"
    print(f"{prog}: internal error: {_one_line(exc)} ({hint})", file=stream, flush=True)
    return EXIT_INTERNAL


def cli_main(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorator of a command's ``main(argv=None, ..., stderr=None) -> int``: an exception
    that escapes it becomes :func:`report_internal_error` (exit 70), Ctrl-C exit 130.
    ``SystemExit`` (argparse's exit 2, ``--help``) passes through."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(argv: Sequence[str] | None = None, *args, **kwargs) -> int:
            stream = kwargs.get("stderr")
            try:
                return main(argv, *args, **kwargs)
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=stream if stream is not None else sys.stderr, flush=True)
                return EXIT_INTERRUPTED
            except Exception as exc:  # noqa: BLE001 - the point: no traceback unless asked for
                return report_internal_error(prog, exc, argv, stream)

        return run

    return wrap
