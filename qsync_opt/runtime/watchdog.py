"""A rank dies with its launcher: the watchdog every training rank starts first.

Under ``qsync-opt train`` (``QSYNC_LAUNCHER_PID`` set) or torchrun (``TORCHELASTIC_RUN_ID``),
:func:`watch_parents` starts a daemon thread that ends the rank within a second once the
launcher or the rank's parent (torchrun) is gone, even when they were killed by SIGKILL. The
launcher (:mod:`qsync_opt.job.launch`) and the worker's entry (:mod:`qsync_opt.job.rank`) both use it; it imports
neither, so they form no import cycle.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

__all__ = ["pid_alive", "watch_parents"]


def pid_alive(pid: int) -> bool:
    """``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: alive as far as we can tell
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def watch_parents(rank: int, interval_s: float = 0.5) -> threading.Thread | None:
    """End this rank (exit code 1) once the launcher or the rank's parent is gone.

    Under ``qsync-opt train`` the launcher's pid is in ``QSYNC_LAUNCHER_PID``; the rank's
    parent is torchrun (``TORCHELASTIC_RUN_ID`` set). The launcher starts torchrun in its own
    session with a parent-death signal (SIGTERM), so a killed launcher takes torchrun down,
    and torchrun's death reparents the rank: either way the watchdog (a daemon thread polling
    twice a second) sees it, even after a SIGKILL no handler can catch. A rank started by hand
    (neither variable set) is not watched. Returns the thread, or None.
    """
    launcher = os.environ.get("QSYNC_LAUNCHER_PID", "")
    watch_launcher = launcher.isdigit() and int(launcher) > 1
    watch_parent = "TORCHELASTIC_RUN_ID" in os.environ
    if not (watch_launcher or watch_parent):
        return None
    parent = os.getppid()

    def gone() -> str | None:
        if watch_parent and os.getppid() != parent:
            return "its parent (torchrun)"
        if watch_launcher and not pid_alive(int(launcher)):
            return f"the launcher (pid {launcher})"
        return None

    def loop() -> None:
        while True:
            who = gone()
            if who is not None:
                try:
                    os.write(2, f"qsync-opt train: rank {rank}: {who} is gone; stopping\n"
                             .encode())
                except OSError:
                    pass  # the stream went with the launcher
                os._exit(1)
            time.sleep(interval_s)

    t = threading.Thread(target=loop, name="qsync-watch-parents", daemon=True)
    t.start()
    return t
