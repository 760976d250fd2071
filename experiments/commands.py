"""What every ``python -m experiments.<x>`` command does with a user's mistake.

:func:`command` wraps a module's ``main(argv) -> exit status``: a mistake in what the user
gave (a bad config value, override, path or policy name: ``ValueError``, ``KeyError``,
``OSError`` such as ``FileNotFoundError``) ends the command with one line on stderr,
``error: <the message>``, and exit status 2, as the ``fp4lab`` command line does; any other
exception is a bug and keeps its traceback. ``FP4LAB_TRACEBACK=1`` shows the traceback of
every error.
"""

from __future__ import annotations

import functools
import os
import sys

__all__ = ["USER_ERRORS", "command"]

USER_ERRORS = (ValueError, KeyError, OSError)


def _message(e: BaseException) -> str:
    if isinstance(e, KeyError) and len(e.args) == 1:  # str(KeyError) quotes its message
        return str(e.args[0])
    return str(e) or type(e).__name__


def command(main):
    """``main`` ending a user's mistake with one line, ``error: ...``, and exit status 2."""
    @functools.wraps(main)
    def run(argv=None) -> int:
        try:
            return main(argv)
        except USER_ERRORS as e:
            if os.environ.get("FP4LAB_TRACEBACK"):
                raise
            print(f"error: {_message(e)}", file=sys.stderr)
            return 2

    return run
