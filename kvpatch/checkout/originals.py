"""originals: where the original bytes of a rewritten file are kept (issue 10 item 3).

In a git checkout the original is already in git: apply records the commit it
started from (the kvpatch commit's parent) and the original's sha256, and
keeps no copy, whenever git gives back exactly those bytes for the file at that
commit with the checkout's filters applied (``git cat-file --filters``: the
bytes ``git checkout`` would write, core.autocrlf and .gitattributes
included). Everywhere else (no git, no commit yet, an untracked file, a file
with uncommitted changes) a byte-exact copy goes under ``.kvpatch/originals/``.
Reading an original back checks its hash against the record: a copy or a git
blob that is not the recorded original is refused, never restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

from kvpatch.checkout import git
from kvpatch.checkout.safepath import read_regular
from kvpatch.names import ORIGINALS, STATE_DIR
from kvpatch.checkout.state import sha256


class OriginalError(Exception):
    """The original cannot be had, or is not the recorded one (one line)."""


def copy_path(rel: str) -> str:
    return f"{STATE_DIR}/{ORIGINALS}/{rel}"


def keep(root: Path, info, rel: str, data: bytes) -> Tuple[Optional[str], Optional[str]]:
    """(copy, commit) for the original `data` of `rel`: (None, HEAD) when git has
    exactly these bytes at HEAD, else (the copy's path, None): the caller writes it."""
    if info is not None and info.commit:
        got = git.filtered(info.repo, info.commit, info.rel_to_repo(root, rel))
        if got is not None and sha256(got) == sha256(data):
            return None, info.commit
    return copy_path(rel), None


def _from_git(root: Path, rel: str, commit: str) -> bytes:
    repo = git.repo_at(root)
    if repo is None:
        raise OriginalError(f"the original of {rel} is in git at {commit[:12]}, but {root} is no longer "
                            f"in a git repository")
    path = (root / rel).resolve().relative_to(git.workdir(repo).resolve()).as_posix()
    data = git.filtered(repo, commit, path)
    if data is None and git.query(repo, "rev-parse", "--is-shallow-repository") == "true":
        raise OriginalError(f"git has no {commit[:12]}:{path} (the original of {rel}): this is a shallow "
                            f"clone without the kvpatch commit's parent; `git fetch --deepen=1` (or "
                            f"--unshallow) fetches it")
    if data is None:
        raise OriginalError(f"git has no {commit[:12]}:{path} (the original of {rel}); "
                            f"was the commit removed?")
    return data


def read(root: Path, rel: str, copy: Optional[str], commit: Optional[str], want: Optional[str]) -> bytes:
    """The original bytes of `rel`, from its copy or from git; OriginalError when
    they are not there or their sha256 is not `want` (None: not recorded)."""
    if copy is not None:
        p = root / copy
        if not p.is_file():
            raise OriginalError(f"original copy {copy} is missing")
        data, where = read_regular(p), copy
    elif commit is not None:
        data, where = _from_git(root, rel, commit), f"git {commit[:12]}:{rel}"
    else:
        raise OriginalError(f"the state records no original of {rel}")
    if want is not None and sha256(data) != want:
        hint = ("" if copy is not None else
                " (git's filters give other bytes now: were core.autocrlf or .gitattributes changed?)")
        raise OriginalError(f"{where}: not the recorded original of {rel} (sha256 differs){hint}")
    return data
