"""SIGTERM (`ray job stop`, systemd, Kubernetes, Slurm, a plain `kill`) ends a command as Ctrl-C
does: what it finished is kept and it says so (Ray's driver would print a native stack dump, a
bench would lose every row it measured)."""
from __future__ import annotations

import signal
import threading

_asked = False  # a command line asked for it (library callers keep their own SIGTERM handling)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command runs (end_on_sigterm)."""


def ask() -> None:
    """A command line wants SIGTERM to end it as Ctrl-C does, from when it can (end_on_sigterm)."""
    global _asked
    _asked = True


def end_on_sigterm(only_if_asked: bool = False) -> None:
    """Raise :class:`Terminated` on SIGTERM from here on (a job calls it after ray.init, which
    installs its own handler; ``only_if_asked``: only when a command line asked, see :func:`ask`).
    Main thread only (Python delivers signals there)."""
    if (_asked or not only_if_asked) and threading.current_thread() is threading.main_thread():
        def terminated(_signum, _frame):
            raise Terminated()

        signal.signal(signal.SIGTERM, terminated)


def interrupted(e: KeyboardInterrupt) -> tuple[str, int]:
    """How an interrupted command says it ended, and its exit code (the shell's, so scripts can
    tell Ctrl-C and SIGTERM from a failure)."""
    return ("terminated (SIGTERM)", 143) if isinstance(e, Terminated) else ("interrupted", 130)
