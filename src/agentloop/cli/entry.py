"""The ``agentloop`` console script's entry point.

The script an installer writes imports its target before calling it, outside any handler of
ours. Importing the command line takes most of a second (typer, rich, pydantic, the kernel), and
a Ctrl-C in that second used to end in a ``KeyboardInterrupt`` traceback: the user changed their
mind, nothing failed. So the target is this module, which imports nothing heavy itself (nor does
the ``agentloop`` package before it), and whose ``main`` imports the rest inside the same guard
that covers typer's set-up, before a command's own handling takes over.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    """Run the command line; a Ctrl-C that no command has taken yet ends it quietly with 130."""
    try:
        from agentloop.cli.main import app

        app()
    except KeyboardInterrupt:
        return _interrupted()
    except RuntimeError as exc:
        # Python 3.11 wraps what a class body's ``__set_name__`` raises in a RuntimeError: a Ctrl-C
        # landing while pydantic builds a model at import is one all the same
        if not isinstance(exc.__cause__, KeyboardInterrupt):
            raise
        return _interrupted()
    return 0


def _interrupted() -> int:
    """Say "aborted" and give the exit status of a Ctrl-C (130)."""
    try:
        sys.stderr.write("\naborted\n")
        sys.stdout.flush()
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # (a stream closed or gone: the exit code says it)
        pass
    import threading

    if any(t is not threading.main_thread() and t.is_alive() and not t.daemon for t in threading.enumerate()):
        os._exit(130)  # a thread nobody stopped would keep the interpreter waiting; the user said stop
    return 130


if __name__ == "__main__":
    sys.exit(main())
