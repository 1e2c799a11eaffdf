"""envfail: a failing environment is an error, not a crash (issue 18 item 2).

A full disk, a read-only file, folder or filesystem, an immutable file, an
output path kvpatch cannot write, git refusing the repository ("dubious
ownership"): none of these is a bug of kvpatch's. Each is one line naming the
path and the cause and saying what was left unchanged, with exit 2 (the code
for errors and refusals, kvpatch/output/exitcodes.py). `describe` is the one mapping,
used by the command group before it calls anything a crash, and by the
commands that report their own errors; "kvpatch crashed" stays for kvpatch's
own bugs (any other exception).
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import List, Optional

from kvpatch.checkout.git import GitError, GitUnreadable
from kvpatch.checkout.safepath import open_denied
from kvpatch.names import CANNOT_READ

# The errors a machine, not kvpatch, causes.
ENV_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
CAUSES = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
          errno.EROFS: "the filesystem is read-only",
          errno.EACCES: "permission denied (a read-only file or folder, or one kvpatch may not read)",
          errno.EPERM: "operation not permitted (an immutable file, chattr +i?)",
          errno.EIO: "an input/output error"}
# What each command leaves as it was when it fails this way.
UNCHANGED = {"apply": "nothing was changed", "revert": "nothing was changed",
             "recover": "the journal is kept: run `kvpatch recover` again once that is fixed",
             "status": "nothing was written", "audit": "nothing was written", "config": "nothing was written",
             "verify": "the checkout was not changed", "rules": "nothing was written", "test": "nothing was written"}
_DUBIOUS = re.compile(r"dubious ownership in repository at '([^']*)'")


class EnvFailure(Exception):
    """An environment failure already phrased as its one line."""


def unchanged(command: Optional[str]) -> str:
    return UNCHANGED.get(command or "", "nothing was changed")


def _env_oserror(exc: BaseException) -> Optional[OSError]:
    """The environment OSError behind exc (itself, or what it was raised from)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in ENV_ERRNOS:
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def oserror_line(exc: OSError, tail: str, where: str = "kvpatch") -> str:
    """'PATH: the cause; tail' for an OSError (both paths of a rename)."""
    where = " -> ".join(os.fsdecode(p) for p in (exc.filename, exc.filename2) if p is not None) or where
    cause = CAUSES.get(exc.errno, exc.strerror or str(exc))
    return f"{where}: {cause} [{errno.errorcode.get(exc.errno, exc.errno)}]; {tail}"


def git_line(exc: GitError, tail: str) -> str:
    """One line for git's refusal: the fatal line, with the way out for dubious ownership."""
    text = str(exc)
    if isinstance(exc, GitUnreadable):
        return f"{text}; {tail}"
    m = _DUBIOUS.search(text)
    if m:
        return (f"git refuses the repository at {m.group(1)}: detected dubious ownership (it belongs to "
                f"another user; `git config --global --add safe.directory {m.group(1)}` trusts it); {tail}")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    fatal = [ln for ln in lines if ln.startswith(("fatal:", "error:"))]
    return f"git refused: {(fatal or lines or ['failed'])[0]}; {tail}"


def describe(exc: BaseException, command: Optional[str]) -> Optional[str]:
    """The one line for an environment failure, or None: then it is kvpatch's own bug."""
    if isinstance(exc, EnvFailure):
        return str(exc)
    if isinstance(exc, GitError):
        return git_line(exc, unchanged(command))
    found = _env_oserror(exc)
    if found is not None:
        return oserror_line(found, unchanged(command))
    return None


def line(exc: BaseException, command: str, fallback: str) -> str:
    """describe(), or `fallback` (a command's own wording) where it is not the environment."""
    return describe(exc, command) or fallback


def write_output(path: Path, text: str) -> None:
    """Write a report to -o PATH; any OSError there is the environment's (one line)."""
    try:
        path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    except OSError as exc:
        cause = CAUSES.get(exc.errno, exc.strerror or str(exc))
        raise EnvFailure(f"{path}: cannot write the output: {cause}; nothing was written") from None


def after_write(root: Path, exc: OSError, pending: bool) -> str:
    """A write that failed on the disk: rolled back, or (rollback cut short too) left to recover."""
    if pending:
        return oserror_line(exc, "the write was cut short and its journal kept: `kvpatch recover` rolls "
                                 "it back once that is fixed", str(root))
    return oserror_line(exc, "nothing was changed (every file was rolled back)", str(root))


def unreadable(errors) -> List:
    """The scan errors of files that could not be read (not: that did not parse)."""
    return [e for e in errors if e.message.startswith(CANNOT_READ)]


def unreadable_paths(top: Path, rels) -> Optional[str]:
    """refuse_unreadable's line for the first of rels (relative to top) that cannot be
    opened for reading, or None."""
    for rel in rels:
        # A deleted file, a link, a FIFO: an uncommitted change like any other, not opened.
        exc = open_denied(top / rel)
        if exc is not None:
            return (f"{rel}: {CANNOT_READ}: {exc.strerror or exc}: apply must read every file it may rewrite; "
                    f"refusing to apply, nothing was written")
    return None


def refuse_unreadable(errors) -> Optional[str]:
    """apply must see every file it may rewrite: one it cannot read refuses the whole apply."""
    bad = unreadable(errors)
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return (f"{bad[0].file}: {bad[0].message}{more}: apply must read every file it may rewrite; "
            f"refusing to apply, nothing was written")


def check_rollback(root: Path, j: dict) -> None:
    """Before recover touches anything: EnvFailure (one line) for a file it must
    restore or remove that it cannot write (read-only, immutable, read-only folder)."""
    from kvpatch.checkout import write

    if j.get("phase") == write.PHASE_STAGING:
        return  # no target was touched: only scratch files go
    targets = [write.FileWrite(f["rel"], b"") for f in j.get("files", [])
               if (f.get("backup") and (root / f["backup"]).exists())
               or (f.get("created") and (root / f["rel"]).exists())]
    problems = write.preflight(root, targets)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise EnvFailure(f"{problems[0]}{more}: refusing to recover, nothing was touched (the journal is kept)")
