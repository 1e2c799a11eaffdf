"""guarded: the steps apply and revert share around their writes.

The checkout's write lock, the refusal of a pending journal, git's preflight, and
the all-or-nothing write whose refused commit rolls every file back.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, List, Optional

from kvpatch.checkout import envfail
from kvpatch.checkout import repo
from kvpatch.checkout import gittxn
from kvpatch.checkout import lock
from kvpatch.checkout import write
from kvpatch.names import JOURNAL_FILE, STATE_DIR

# .kvpatch/ holds the originals and state.json: never part of a commit (git has
# the originals), so it ignores itself, the way .pytest_cache/ does.
GIT_IGNORE = f"{STATE_DIR}/.gitignore"
IGNORE_ALL = b"*\n"
NO_VERIFY_HINT = f"{repo.NO_VERIFY} skips the hooks"


class PatchError(Exception):
    """A refusal with a one-line reason (exit code 2)."""


def _git_record(info, no_commit: bool) -> Optional[dict]:
    """Where HEAD is before the git steps, for the journal: a kill in the middle
    of them is undone ref for ref. None when the write makes no git step."""
    return None if info is None or no_commit else gittxn.record(info)


def _write_and_commit(root: Path, writes: List[write.FileWrite], op: str, finish: Callable[[], None],
                      git: Optional[dict]) -> None:
    """All files or none; a refused commit (a hook, signing, identity) rolls
    the files back too, and its output is the error."""
    try:
        write.apply_writes(root, writes, op, before_finish=finish, git=git)
    except repo.GitError as exc:
        raise PatchError(f"git commit failed, every file was rolled back ({NO_VERIFY_HINT}):\n{exc}") from None
    except write.WriteError as exc:  # read-only, immutable, unwritable folder: refused before any write
        raise PatchError(f"{exc}; nothing was changed") from None
    except OSError as exc:  # the disk failed mid-way (full, read-only, EIO): rolled back, or left to recover
        raise PatchError(envfail.after_write(root, exc, write.pending(root) is not None)) from None


def _is_state(rel: str) -> bool:
    return rel == STATE_DIR or rel.startswith(STATE_DIR + "/")


def _git_preflight(info) -> None:
    try:
        repo.preflight(info)
    except repo.GitError as exc:
        raise PatchError(f"git would refuse the commit, nothing was changed: {exc}") from None


@contextmanager
def _locked(root: Path):
    try:
        with lock.exclusive(root):
            yield
    except lock.Busy as exc:
        raise PatchError(str(exc)) from None


def _refuse_pending(root: Path) -> None:
    """A journal is never rolled back on the side: it may not be this machine's
    (a cloned fork can ship one), so `kvpatch recover` shows it and asks nothing else."""
    j = write.pending(root)
    if j is not None:
        raise PatchError(f"an interrupted `kvpatch {j.get('op', '?')}` left {STATE_DIR}/{JOURNAL_FILE}: "
                         f"run `kvpatch recover --dry-run` to see what undoing it does, then `kvpatch recover`")
