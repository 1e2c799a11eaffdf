"""`python -m kvpatch` and the `kvpatch` script.

The CLI is imported inside run(), not at the top: importing it (libcst, click,
GitPython) takes a large share of a short command's life, and a Ctrl-C or a
process-group SIGINT landing there must end like any other interrupt (one line,
exit 130), not as a KeyboardInterrupt traceback. Nothing is written before the
CLI is loaded, so there is nothing to roll back.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import time

from kvpatch.output.exitcodes import EXIT_USER_INTERRUPT


def _resend(signum):
    time.sleep(0.001)
    os.kill(os.getpid(), signum)


@contextlib.contextmanager
def redeliver_interrupts():
    """A Ctrl-C (or SIGTERM, raised as an interrupt while writing) that lands in code whose
    exceptions Python only reports, a weakref callback such as importlib's module-lock
    cleanup or a __del__, is swallowed there: "Exception ignored in ..." and a traceback on
    stderr, and the command goes on as if nobody had pressed Ctrl-C. Here the interrupt is
    raised again as its signal, so that it lands in the command's own code at its next
    step (the write rolls back; the CLI prints its one line), and nothing is printed."""
    prev = sys.unraisablehook

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, KeyboardInterrupt):
            # Sent again from another thread, a moment later: raised in the hook (itself
            # only reported) it would be swallowed again, and threading.Thread.start()
            # waits for the thread, so the signal could land in that wait. Should it land in
            # such a callback once more, this hook sends it once more.
            _thread.start_new_thread(_resend, (getattr(exc, "signum", signal.SIGINT),))
            return
        prev(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = prev


def run(argv: list[str] | None = None) -> None:
    try:
        from kvpatch.cli.commands import main
    except KeyboardInterrupt:
        sys.stderr.write("Error: interrupted (nothing was written)\n")
        sys.exit(EXIT_USER_INTERRUPT)
    try:
        with redeliver_interrupts():
            main(argv, prog_name="kvpatch")
    finally:
        # The command is over: done, or rolled back. A Ctrl-C (or SIGTERM) landing while the
        # interpreter shuts down (Python 3.10 waits on its threads there) has nothing left
        # to stop, and must not print a KeyboardInterrupt traceback after the last line.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


if __name__ == "__main__":
    run()
