"""safepath: every file kvpatch reads or writes stays inside the checkout.

A checkout is untrusted input: someone may clone a fork that ships a crafted
`.kvpatch/state.json` or journal, or plants symbolic links where kvpatch
writes. So every path taken from state or journal is checked (relative,
normalised, inside the root, no symbolic link on the way), files are created
exclusively and never through a link, and only regular files are read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Optional

from kvpatch.names import DOT_GIT as GIT_DIR

# O_NOFOLLOW/O_CLOEXEC are POSIX; where missing (Windows) the flag is simply 0.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafePath(ValueError):
    """A path that would leave the checkout, go through a link or name a non-file."""


def check_rel(rel, what: str) -> str:
    """`rel` if it is a normalised relative POSIX path (no '..', '.', '' parts), else UnsafePath."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        raise UnsafePath(f"{what}: {rel!r} is not a relative path")
    p = PurePosixPath(rel)
    if p.is_absolute() or rel.startswith("/"):
        raise UnsafePath(f"{what}: {rel!r} is absolute")
    if any(part in ("..", ".", "") for part in rel.split("/")) or p.as_posix() != rel:
        raise UnsafePath(f"{what}: {rel!r} is not normalised (no '..', '.' or empty parts)")
    # Git's own files (config, hooks) run code: a state or journal naming one is
    # an attack, never kvpatch's write. Any case: .GIT is .git on macOS and Windows.
    if any(part.lower() == GIT_DIR for part in rel.split("/")):
        raise UnsafePath(f"{what}: {rel!r} is inside a {GIT_DIR} folder")
    return rel


def inside(root: Path, rel, what: str) -> Path:
    """root/rel after check_rel, with no symbolic link on any existing component."""
    check_rel(rel, what)
    p = root
    for part in rel.split("/"):
        p = p / part
        try:
            if stat.S_ISLNK(os.lstat(p).st_mode):
                raise UnsafePath(f"{what}: {rel!r} goes through the symbolic link {p.relative_to(root)}")
        except FileNotFoundError:
            break  # nothing below a missing component can be a link yet
    return root / rel


def under(rel: str, prefix: str, what: str) -> str:
    """rel, which must lie under the folder `prefix` (itself a checked relative path)."""
    if not rel.startswith(prefix.rstrip("/") + "/"):
        raise UnsafePath(f"{what}: {rel!r} is not under {prefix}")
    return rel


def is_link(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def open_denied(path: Path) -> Optional[OSError]:
    """The permission error opening path for reading raises, or None (it opens, or fails
    otherwise): never through a link, never blocking on a FIFO, nothing read."""
    try:
        os.close(os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC))
    except PermissionError as exc:
        return exc
    except OSError:
        return None
    return None


def read_regular(path: Path) -> bytes:
    """The bytes of a regular file, never through a link, never blocking on a FIFO."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePath(f"{path}: not a regular file")
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


def create_new(path: Path, data: bytes, mode: Optional[int] = None) -> None:
    """Create `path` with `data`, fsynced; fails if anything (a link too) is there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        if mode is not None:
            os.fchmod(fd, mode)
    except OSError as exc:  # a full disk names the file it was writing (kvpatch/checkout/envfail.py)
        exc.filename = exc.filename or os.fspath(path)
        raise
    finally:
        os.close(fd)


def remove_stale(path: Path) -> None:
    """Remove what sits at one of kvpatch's own scratch names (a link is removed, not followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path}: a directory sits where kvpatch keeps a scratch file")
    os.unlink(path)


def tmp_path(path: Path) -> Path:
    """The sibling kvpatch stages `path`'s new bytes in before an atomic rename."""
    return path.with_name(f".{path.name}.kvpatch-tmp")


def write_replace(path: Path, data: bytes, mode: Optional[int] = None) -> None:
    """Write `path` atomically through an exclusive sibling temp file; a link at
    `path` itself is replaced, never written through."""
    tmp = tmp_path(path)
    remove_stale(tmp)
    create_new(tmp, data, mode)
    os.replace(tmp, path)
