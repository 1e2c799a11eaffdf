"""`python -m kvpatch` and the `kvpatch` script.

The CLI is imported inside run(), not at the top: importing it (libcst, click,
GitPython) takes a large share of a short command's life, and a Ctrl-C or a
process-group SIGINT landing there must end like any other interrupt (one line,
exit 130), not as a KeyboardInterrupt traceback. Nothing is written before the
CLI is loaded, so there is nothing to roll back.
"""

from __future__ import annotations

import signal
import sys

from kvpatch.output.exitcodes import EXIT_USER_INTERRUPT


def run(argv: list[str] | None = None) -> None:
    try:
        from kvpatch.cli.commands import main
    except KeyboardInterrupt:
        sys.stderr.write("Error: interrupted (nothing was written)\n")
        sys.exit(EXIT_USER_INTERRUPT)
    try:
        main(argv, prog_name="kvpatch")
    finally:
        # The command is over: done, or rolled back. A Ctrl-C (or SIGTERM) landing while the
        # interpreter shuts down (Python 3.10 waits on its threads there) has nothing left
        # to stop, and must not print a KeyboardInterrupt traceback after the last line.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


if __name__ == "__main__":
    run()
