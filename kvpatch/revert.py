"""revert: restore a patched checkout's original bytes, holding its write lock.

Every recorded file goes back to its original (or, where it was edited away from
the patched regions since apply, has kvpatch's rewrite taken back hunk by hunk);
the runtime files kvpatch added go; in git, one commit records it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from kvpatch.checkout import recognise
from kvpatch.checkout import repo
from kvpatch.checkout import originals
from kvpatch.rewrite import reverse
from kvpatch.checkout import write
from kvpatch.checkout.guarded import (GIT_IGNORE, PatchError, _git_preflight, _git_record, _is_state, _locked,
                             _refuse_pending, _write_and_commit)
from kvpatch.names import STATE_DIR, STATE_FILE
from kvpatch.checkout.safepath import read_regular
from kvpatch.checkout.state import load, sha256

STATE_REL = f"{STATE_DIR}/{STATE_FILE}"


def original(root: Path, rel: str, copy: Optional[str], commit: Optional[str], want: Optional[str]) -> bytes:
    """The recorded original of rel (a copy, or git at the commit apply started from), hash-checked."""
    try:
        return originals.read(root, rel, copy, commit, want)
    except originals.OriginalError as exc:
        raise PatchError(f"{exc}; refusing to restore it, nothing was changed") from None


def _drop_copy(copy: Optional[str]) -> List[write.FileWrite]:
    """The removal of an original's copy; none where the original is in git."""
    return [] if copy is None else [write.FileWrite(copy, None)]


@dataclass
class RevertResult:
    restored: List[str]
    removed: List[str]
    commit: Optional[str]
    git: bool
    notice: str = ""
    kept_edits: List[str] = field(default_factory=list)  # restored with the user's later edits kept


def revert(root: Path, **kw) -> RevertResult:
    """Restore every original byte, holding the checkout's write lock."""
    root = root.resolve()
    with _locked(root):
        return _revert(root, **kw)


def _revert(root: Path, *, force=False, no_commit=False, allow_dirty=False, no_verify=False) -> RevertResult:
    _refuse_pending(root)
    st = load(root)
    if st is None:
        raise PatchError(recognise.no_record(root, repo.git_info(root)))
    info = repo.git_info(root)
    if info is not None and not allow_dirty and not no_commit:
        tracked = {info.rel_to_repo(root, f.path) for f in st.files}
        dirty = sorted(set(repo.dirty_paths(info, root)) - tracked - {info.rel_to_repo(root, STATE_REL)})
        if dirty:
            raise PatchError(f"the git tree has uncommitted changes ({dirty[0]}...): commit or stash them, "
                             f"or pass --allow-dirty / --no-commit")
    writes: List[write.FileWrite] = []
    restored, removed, edited = [], [], []
    for f in st.files:
        p = root / f.path
        cur = read_regular(p) if p.exists() else None
        orig = original(root, f.path, f.original_copy, f.original_commit, f.original_sha256)
        if cur is not None and sha256(cur) not in (f.patched_sha256, f.original_sha256) and not force:
            kept = _reverse_edited(f, cur, orig)
            if kept is not None:  # edited elsewhere: the rewrite is taken back, the edits stay
                writes.append(write.FileWrite(f.path, kept))
                writes.extend(_drop_copy(f.original_copy))
                restored.append(f.path)
                edited.append(f.path)
                continue
            raise PatchError(f"{f.path} was edited since apply (drift): `kvpatch status` shows where; "
                             f"pass --force to restore the original anyway (your edits are kept in "
                             f"{f.path}.kvpatch-drifted)")
        if cur is not None and sha256(cur) not in (f.patched_sha256, f.original_sha256):
            writes.append(write.FileWrite(f.path + ".kvpatch-drifted", cur))
        if cur != orig:
            writes.append(write.FileWrite(f.path, orig))
            restored.append(f.path)
        writes.extend(_drop_copy(f.original_copy))
    for r in st.runtime_files:
        p = root / r.path
        if r.created:
            if p.exists():
                writes.append(write.FileWrite(r.path, None))
                removed.append(r.path)
        elif r.original_copy or r.original_commit:
            writes.append(write.FileWrite(r.path, original(root, r.path, r.original_copy, r.original_commit,
                                                           r.original_sha256)))
            writes.extend(_drop_copy(r.original_copy))
            restored.append(r.path)
    writes.append(write.FileWrite(f"{STATE_DIR}/{STATE_FILE}", None))
    if (root / GIT_IGNORE).exists():
        writes.append(write.FileWrite(GIT_IGNORE, None))
    at_head = info is not None and recognise.head_has(info, root, writes)  # the user moved on (issue 18)
    if at_head and not restored and not removed:
        raise PatchError(recognise.nothing_here(info, st))
    if info is not None and not no_commit and not at_head:
        _git_preflight(info)
    commit_sha = None
    notice = "" if info is not None else f"{repo.plain_reason(root)}: files restored in place, no commit"
    if info is not None and no_commit:
        notice = "--no-commit: files restored in place, no commit"
    elif at_head:  # HEAD holds the originals: the patch was never committed here
        no_commit, notice = True, "HEAD already holds the originals (the patch was not committed on it): " \
                                  "files restored in place, no commit"

    def finish():
        nonlocal commit_sha
        if info is not None and not no_commit:
            commit_sha = _revert_commit(info, root, writes, len(restored), len(removed), no_verify)
        # .kvpatch/'s emptied folders go only once the commit is made (a refused
        # commit rolls the originals back into them) and before the journal goes.
        _prune_empty(root / STATE_DIR)

    _write_and_commit(root, writes, "revert", finish, _git_record(info, no_commit))
    _prune_empty(root / STATE_DIR)
    return RevertResult(restored, removed, commit_sha, info is not None, notice, edited)


def _reverse_edited(f, cur: bytes, orig: bytes) -> Optional[bytes]:
    """`cur` (edited since apply) with kvpatch's rewrite taken back, or None."""
    rules_used = sorted({s.rule for s in f.sites if s.rule})
    patched = reverse.rebuild_patched(f.path, orig, f.patched_sha256, (None, rules_used or None))
    return None if patched is None else reverse.reverse_patch(cur, patched, orig)


def _revert_commit(info, root: Path, writes: List[write.FileWrite], restored: int, removed: int,
                   no_verify: bool) -> str:
    # Removals only of what git tracks: .kvpatch/ is ignored (an apply by an
    # older kvpatch committed it, and then its removal is committed too).
    add = [info.rel_to_repo(root, w.rel) for w in writes if w.data is not None and not _is_state(w.rel)]
    rm = repo.tracked(info, [info.rel_to_repo(root, w.rel) for w in writes if w.data is None])
    return repo.commit(info, add + rm, f"kvpatch: revert ({restored} files restored, "
                                           f"{removed} runtime files removed)\n", no_verify)


def _prune_empty(d: Path) -> None:
    if not d.is_dir():
        return
    for sub in sorted(d.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if sub.is_dir() and not any(sub.iterdir()) and sub.name != write.TXN_DIR:
            sub.rmdir()
    if d.exists() and not any(d.iterdir()):
        d.rmdir()
