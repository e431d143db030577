"""SIGTERM and SIGHUP end a command through its clean-up, whichever thread the kernel picks.

A Python signal handler runs in the main thread, and only once that thread gets back to the
interpreter. At the chat's prompt the main thread sits in readline's ``select()``, which runs
pending handlers only when the ``select()`` itself is interrupted. Two ways that never happens:

- the signal arrives after readline printed the prompt but before it entered ``select()``
  (the handler is marked pending, nothing wakes the main thread);
- the kernel hands a process-directed signal to another thread (a node link's reader, the
  heartbeat, a llama.cpp worker), so the main thread's ``select()`` is not interrupted.

Either way the chat sat at its prompt forever, holding its local ring's node processes. So a
forwarder thread watches the wakeup fd (written for every signal, on any thread) and, while
the handler has not run, re-sends the signal to the main thread itself every 0.2 s.
"""

from __future__ import annotations

import os
import signal
import threading

FORWARD_AFTER_S = 0.2  # how long the main thread gets to run the handler on its own
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def exit_on_hangup() -> None:
    """Make SIGTERM and SIGHUP (a closed terminal window) end the command as Ctrl-C does:
    through its ``with`` blocks, so a local ring's node processes are stopped, not orphaned.
    The exit code is 128 + the signal's number. Call from the main thread."""
    stopping = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        if stopping.is_set():  # a forwarded copy of the same stop: clean-up is under way
            return
        stopping.set()
        raise SystemExit(128 + signum)

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # a signal handler must never block on a full pipe
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    main = threading.main_thread().ident
    assert main is not None

    def forward() -> None:
        while True:
            try:
                numbers = os.read(read_end, 64)
            except OSError:
                return
            for signum in numbers:
                if signum not in STOP_SIGNALS:
                    continue  # SIGINT and the rest: as Python handles them
                while not stopping.wait(FORWARD_AFTER_S):
                    signal.pthread_kill(main, signum)

    threading.Thread(target=forward, name="edgespec-signals", daemon=True).start()
