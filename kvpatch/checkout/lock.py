"""lock: one writing kvpatch command per checkout at a time.

apply, revert and recover hold an exclusive flock on the checkout directory
itself (nothing is created in the tree, and the kernel drops the lock when the
process dies, kill -9 included). status asks for a shared lock without waiting,
to tell a write in progress from one that was interrupted.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, commands run unlocked
    fcntl = None


class Busy(RuntimeError):
    """Another kvpatch command is writing to this checkout."""


@contextmanager
def exclusive(root: Path):
    """Hold the checkout's write lock for the block; Busy at once if another holds it."""
    if fcntl is None:
        yield
        return
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(f"another kvpatch command is writing to {root}: wait for it to finish") from None
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def held(root: Path) -> bool:
    """True while some process holds the checkout's write lock."""
    if fcntl is None or not root.is_dir():
        return False
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)
