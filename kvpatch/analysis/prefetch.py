"""prefetch: audit's listing and byte prefilter, done in a forked helper while the
command loads its rules.

Before it can analyse a file, audit's process imports libcst and the rules
(~0.18 s, one core). Listing the tree and reading and byte-filtering every .py
(discover) need neither, so on Linux a helper forked before that import does them
on another core and hands back the listing, the candidates' bytes and the read
errors: the same calls scan_tree would make, on the same root and exclude test (the listing comes back as its length).
scan_tree uses the answer only for that root and that very test, and only from a
helper that finished cleanly; anything else (a killed helper, a short read) and
it lists and reads the tree itself, as with no helper. The helper writes nothing
in the checkout, takes no lock and dies with its parent.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from kvpatch.analysis import workers
from kvpatch.analysis import discover

Found = List[Tuple[int, object]]  # discover.read_candidates' answer


class Prefetch:
    """A running helper; `take` its answer once, or `close` it unread."""

    def __init__(self, root: Path, excluded: Optional[Callable[[str], bool]], pid: int, fd: int,
                 started: float) -> None:
        self.root, self.excluded, self.started = root, excluded, started
        self.pid: Optional[int] = pid  # None once reaped
        self._fd: Optional[int] = fd

    def take(self, root: Path, excluded) -> Optional[Tuple[int, Found]]:
        """(number of paths, found) for this root (resolved) and exclude test; None if the helper
        was for another, or did not finish cleanly."""
        try:
            if root != self.root or excluded is not self.excluded or self._fd is None:
                return None
            with os.fdopen(self._fd, "rb") as f:
                self._fd = None
                data = f.read()
            pid, self.pid = self.pid, None
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                return None
            return pickle.loads(data)
        except Exception:  # noqa: BLE001 - e.g. the helper reaped elsewhere: read the tree here
            return None
        finally:
            self.close()

    def close(self) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            pid, self.pid = self.pid, None
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:  # reaped already (SIGCHLD ignored)
                pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def start(root: Path, excluded: Optional[Callable[[str], bool]]) -> Optional[Prefetch]:
    """Fork the helper for the directory `root`; None where none is started (not
    Linux, another thread running, which a fork must not copy mid-step, or root no
    directory)."""
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return None
    root = root.resolve()
    if not root.is_dir():
        return None
    r, w = os.pipe()
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the helper: never returns
        _helper(root, excluded, r, w)
    os.close(w)
    return Prefetch(root, excluded, pid, r, started)


def _helper(root: Path, excluded, r: int, w: int) -> None:
    code = 1
    try:
        # A Ctrl-C reaches the whole process group: the parent reports it and kills this.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        workers.die_with_parent()
        os.close(r)
        paths = list(discover.iter_python_paths(root, excluded))
        found = discover.read_candidates(root, enumerate(paths))
        with os.fdopen(w, "wb") as f:
            # The count, not the paths: 3,000 Path objects take the parent ~20 ms to unpickle.
            f.write(pickle.dumps((len(paths), found), pickle.HIGHEST_PROTOCOL))
        code = 0
    except BaseException:  # noqa: BLE001 - any failure: the parent reads the tree itself
        pass
    finally:
        os._exit(code)  # no atexit, no flush of the parent's buffers, no click teardown
