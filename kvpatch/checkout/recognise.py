"""recognise: a patched checkout as git and its files show it (issue 18).

`apply` commits its record, ``.kvpatch/state.json``, in the kvpatch commit with
the files it rewrote (force-added past ``.kvpatch/``'s own ignore file; the
originals stay in git at the commit's parent and are never committed), so a
clone of the patched branch, a CI checkout of it, ``git clean -fdx`` and
``git stash -u`` all keep it, and it is read (and validated: every path inside
the checkout) as any record is. Where no record is found the tree still speaks:

- ``status``: files that carry kvpatch's rewrites are `patched` (or `partly
  patched`), never `not patched`; the detail says the record is missing.
- ``revert`` without a record names what to do: the kvpatch branch whose tip
  holds a record, or that the files must be restored from git by hand.
- ``revert`` on a branch that does not carry the patch (the user moved on)
  refuses before touching anything; where the files carry an uncommitted patch
  and HEAD already holds the originals (``apply --no-commit``, then a switch of
  branch), it restores them without a commit, which git would refuse as empty.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import List, Optional, Tuple

from kvpatch.checkout import git
from kvpatch.checkout.git import BRANCH_PREFIX, HEADS
from kvpatch.names import RUNTIME_FILENAME, STATE_DIR, STATE_FILE
from kvpatch.sites import PATCHED, PLAN_PATCHED
from kvpatch.checkout.state import sha256

STATE_REL = f"{STATE_DIR}/{STATE_FILE}"


def unrecorded(scan, fixable) -> Optional[Tuple[str, List[Tuple[str, str, Optional[int]]], str]]:
    """(status, places as (file, what, line), detail) for a tree whose files carry
    kvpatch's rewrites but which has no record; None when nothing is patched."""
    done = [s for s in scan.sites if s.status == PATCHED] + [p for p in scan.plans if p.status == PLAN_PATCHED]
    if not done:
        return None
    why = (f"{len(done)} site(s) and plan call(s) carry kvpatch's rewrite, but no {STATE_REL} records "
           f"them (removed by hand, or made without `kvpatch apply`): `kvpatch revert` needs the record, "
           f"which a checkout of the kvpatch commit has")
    # The runtime module each patched file imports sits next to it.
    gone = sorted({str(PurePosixPath(r.file).parent / RUNTIME_FILENAME) for r in done}
                  - {str(PurePosixPath(r.file).parent / RUNTIME_FILENAME) for r in done
                     if (scan.root / PurePosixPath(r.file).parent / RUNTIME_FILENAME).is_file()})
    places = [(g, "runtime module is missing", None) for g in gone]
    places += [(r.file, f"{r.qualname}: not rewritten yet", r.line) for r in fixable]
    return ("partly patched" if places else "patched"), places, why


def record_branches(info) -> List[str]:
    """The kvpatch branches whose tip holds a state record (at the repository's top)."""
    found = []
    for ref in git.branches(info.repo, HEADS + BRANCH_PREFIX):
        if git.query(info.repo, "cat-file", "-e", f"{ref}:{STATE_REL}") is not None:
            found.append(ref[len(HEADS):])
    return found


def _here(info) -> str:
    return f"HEAD ({info.branch})" if info.branch else f"HEAD ({(info.commit or 'no commit')[:12]}, detached)"


def no_record(root: Path, info) -> str:
    """One line for `revert` on a checkout with no record: what it is and what to do."""
    base = f"{root} has no {STATE_REL}: it was not patched by kvpatch apply (or the record was removed)"
    if info is None:
        return base
    branches = [b for b in record_branches(info) if b != info.branch]
    if branches:
        return (f"{base}; {_here(info)} does not carry kvpatch's commit, the branch {branches[0]} does: "
                f"`git checkout {branches[0]}` and revert there")
    return base


def nothing_here(info, st) -> str:
    """One line for `revert` where every recorded file is already its original."""
    branches = [b for b in record_branches(info) if b != info.branch]
    where = f"the branch {branches[0]} carries it: `git checkout {branches[0]}` and revert there, or" \
        if branches else "if you reverted by hand,"
    return (f"nothing to revert: every file kvpatch patched is its original at {_here(info)}, which does not "
            f"carry kvpatch's patch; {where} remove the stale {STATE_DIR}/ (nothing was changed)")


def head_has(info, root: Path, writes) -> bool:
    """Whether HEAD already holds every checkout file the writes leave (so a commit
    of them would be empty, which git refuses): the written bytes, and no file
    where they delete one. The state record and .kvpatch/ are not checkout files."""
    for w in writes:
        if w.rel == STATE_DIR or w.rel.startswith(STATE_DIR + "/"):
            if w.rel == STATE_REL and git.query(info.repo, "cat-file", "-e",
                                                f"HEAD:{info.rel_to_repo(root, w.rel)}") is not None:
                return False  # a committed record: its removal is a change
            continue
        at_head = git.filtered(info.repo, "HEAD", info.rel_to_repo(root, w.rel)) if info.commit else None
        if (w.data is None) != (at_head is None):
            return False
        if w.data is not None and sha256(w.data) != sha256(at_head):
            return False
    return True
