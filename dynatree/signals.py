"""SIGTERM (`ray job stop`, systemd, Kubernetes, Slurm, a plain `kill`) ends a command as Ctrl-C
does: what it finished is kept and it says so (Ray's driver would print a native stack dump, a
bench would lose every row it measured)."""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading

_asked = False  # a command line asked for it (library callers keep their own SIGTERM handling)
_terminated = False  # a SIGTERM was raised and not yet reported (interrupted)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command runs (end_on_sigterm)."""


def ask() -> None:
    """A command line wants SIGTERM to end it as Ctrl-C does: from now (a job being planned died of
    it with no word), held while Ray starts (held_while_starting), and after."""
    global _asked
    if not _asked:  # (registered before ray.init registers its shutdown: run after it, last of all)
        atexit.register(_ignore_ctrl_c_in_finalization)
    _asked = True
    end_on_sigterm()  # (and no SIGTERM of an earlier command is pending)


def _ignore_ctrl_c_in_finalization() -> None:
    """After the last exit handler of a finished job, Python's finalization puts back the default
    SIGINT action in place of quiet_exit's handler (it keeps only an ignore): a Ctrl-C then ended
    a finished job with 130 (trial AM).  Ignored to the end."""
    if _finishing and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def end_on_sigterm(only_if_asked: bool = False) -> None:
    """Raise :class:`Terminated` on SIGTERM from here on (a job calls it after ray.init, which
    installs its own handler; ``only_if_asked``: only when a command line asked, see :func:`ask`).
    Main thread only (Python delivers signals there)."""
    global _terminated
    if (_asked or not only_if_asked) and threading.current_thread() is threading.main_thread():
        _terminated = False  # (one an earlier command caught elsewhere would mislabel a Ctrl-C as SIGTERM)

        def terminated(_signum, _frame):
            global _terminated
            _terminated = True
            raise Terminated()

        signal.signal(signal.SIGTERM, terminated)


def terminated_now(e: KeyboardInterrupt) -> bool:
    """Whether ``e`` is a SIGTERM's (as :func:`interrupted` tells, without taking the flag)."""
    return isinstance(e, Terminated) or _terminated


def interrupted(e: KeyboardInterrupt) -> tuple[str, int]:
    """How an interrupted command says it ended, and its exit code (the shell's, so scripts can
    tell Ctrl-C and SIGTERM from a failure).  By the flag the handler set, not only by ``e``'s
    type: Ray's ``get``/``wait`` turn any KeyboardInterrupt raised inside them into a plain one,
    and a job's SIGTERM mostly lands there."""
    global _terminated
    term, _terminated = isinstance(e, Terminated) or _terminated, False
    return ("terminated (SIGTERM)", 143) if term else ("interrupted", 130)


def _raised(signum: int) -> KeyboardInterrupt:
    global _terminated
    _terminated = _terminated or signum == signal.SIGTERM
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager
def held_while_starting(ray_utils=None):
    """Ctrl-C and SIGTERM held while the block starts a local Ray cluster, then raised as they would
    have been (also when the start fails): interrupted midway, the start leaves Ray's agent
    processes running (~200 MB), and ray.init's own SIGTERM handler exits with status 15 and no
    word of resuming.  A second signal raises at once (a start that hangs can still be stopped).
    After the block SIGTERM ends the command as Ctrl-C does (end_on_sigterm).  Only where a
    command line asked (:func:`ask`), from the main thread; ``ray_utils``: ray._private.utils,
    whose set_sigterm_handler ray.init calls, kept from replacing the hold meanwhile."""
    if not _asked or threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def hold(signum, _frame):
        if got:
            raise _raised(signum)
        got.append(signum)
        print("\n(stopping once the Ray cluster has started; again to stop at once)", file=sys.stderr, flush=True)

    old_int = signal.signal(signal.SIGINT, hold)
    signal.signal(signal.SIGTERM, hold)
    keep = getattr(ray_utils, "set_sigterm_handler", None)
    if keep is not None:
        ray_utils.set_sigterm_handler = lambda _handler: None
    try:
        yield
    except BaseException as e:
        if got and not isinstance(e, KeyboardInterrupt):  # (a second signal's stands)
            raise _raised(got[0]) from e
        raise
    finally:
        if keep is not None:
            ray_utils.set_sigterm_handler = keep
        signal.signal(signal.SIGINT, old_int)
        end_on_sigterm()  # (not the handler from before: no moment without one)
    if got:
        raise _raised(got[0])


_finishing = False  # quiet_exit registered (once per process)


def quiet_exit() -> None:
    """A finished job's command is only exiting: Ray's shutdown at exit (~3 s for a local cluster,
    longer where a head is slow to answer) runs first; a Ctrl-C then would print Ray's traceback
    under the finished job's table.  From exit on, the first Ctrl-C is ignored and a second one
    ends the process at once (atexit runs this before ray.init's own handler: last in, first out)."""
    global _finishing
    if _finishing:
        return
    _finishing = True

    def at_exit():
        pressed = []

        def second_ends(_signum, _frame):
            if pressed:
                os._exit(130)
            pressed.append(1)

        signal.signal(signal.SIGINT, second_ends)

    atexit.register(at_exit)
