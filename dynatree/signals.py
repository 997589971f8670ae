"""SIGTERM (`ray job stop`, systemd, Kubernetes, Slurm, a plain `kill`) ends a command as Ctrl-C
does: what it finished is kept and it says so (Ray's driver would print a native stack dump, a
bench would lose every row it measured)."""
from __future__ import annotations

import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command runs (end_on_sigterm)."""


def end_on_sigterm() -> None:
    """Raise :class:`Terminated` on SIGTERM from here on (after ray.init, which installs its own
    handler).  Main thread only (Python delivers signals there)."""
    if threading.current_thread() is threading.main_thread():
        def terminated(_signum, _frame):
            raise Terminated()

        signal.signal(signal.SIGTERM, terminated)
