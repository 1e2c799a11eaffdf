"""gittxn: the git side of a write, undone with its files (issue 10, items 16-18).

apply and revert end with git steps (a branch, the index, a commit) that a
kill -9 can cut anywhere. So before the first byte is staged the journal
records where HEAD was (its branch and commit) and which kvpatch branches
already existed; `recover` (and an in-process rollback) then puts HEAD, the
branch, the index entries of the written paths and any branch the write made
back as they were. The working tree is the file rollback's job, so nothing here
checks out files.

The journal may come from a cloned fork, so undo is conservative: it moves a
branch only back from commits that change nothing but the journal's own paths,
deletes only a kvpatch branch it did not find at the start, and every git
command gets literal pathspecs.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from kvpatch.checkout import repo
from kvpatch.checkout import git
from kvpatch.checkout.git import BRANCH_PREFIX, HEADS, INDEX_LOCK, NEXT_INDEX_LOCKS, PACKED_REFS
from kvpatch.checkout.safepath import UnsafePath

# How many commits a write makes (apply: one; revert: one): undo strips no more.
MAX_COMMITS = 1
_SHA = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class GitUndoError(RuntimeError):
    """The git side cannot be undone now (one line: what to do)."""


def record(info: repo.GitInfo) -> dict:
    """Where HEAD is, before a write's git steps."""
    workdir = Path(info.workdir)
    return {"head": HEADS + info.branch if info.branch else None, "commit": info.commit,
            "branches": sorted(_kvpatch_branches(workdir))}


def check(rec) -> None:
    """A journal's git record: ref names under refs/heads/, full hex shas; UnsafePath otherwise."""
    if not isinstance(rec, dict):
        raise UnsafePath("the journal's git record is not an object")
    head, commit, branches = rec.get("head"), rec.get("commit"), rec.get("branches", [])
    if head is not None:
        _check_ref(head)
    if commit is not None and (not isinstance(commit, str) or not _SHA.fullmatch(commit)):
        raise UnsafePath(f"journal git commit {commit!r} is not a commit id")
    if not isinstance(branches, list):
        raise UnsafePath("the journal's git branches is not a list")
    for b in branches:
        _check_ref(b)


def _check_ref(ref) -> None:
    if (not isinstance(ref, str) or not ref.startswith(HEADS)
            or not git.valid_ref(ref)):
        raise UnsafePath(f"journal git ref {ref!r} is not a branch name")


def plan(root: Path, rec: dict, files: List[dict]) -> List[Tuple[str, List[str]]]:
    """The git commands that put HEAD, the branches and the index back, each with a
    line saying what it does; [] when git is already as recorded. `files`: the
    journal's entries (each written path and the sha256 of what it wrote)."""
    check(rec)
    info = repo.git_info(root)
    if info is None:
        return []
    workdir = Path(info.workdir)
    git_dir = Path(_git(workdir, "rev-parse", "--absolute-git-dir"))
    head, commit = rec.get("head"), rec.get("commit")
    ours = _written(root, info, files)
    made = _kvpatch_branches(workdir) - set(rec.get("branches", [])) - {head}
    steps: List[Tuple[str, List[str]]] = []
    final = _try(workdir, "rev-parse", "-q", "--verify", "HEAD")  # where HEAD ends up
    tip = _try(workdir, "rev-parse", "-q", "--verify", head) if head is not None else None
    if head is not None and commit and tip and tip != commit and _only_ours(workdir, tip, commit, ours):
        steps.append((f"move {head[len(HEADS):]} back from {tip[:12]} to {commit[:12]}",
                      ["update-ref", head, commit, tip]))
        final = commit if final == tip else final
        tip = commit
    # HEAD moves back only from a branch the write made: a journal cannot
    # switch the user off a branch of their own.
    if _try(workdir, "symbolic-ref", "-q", "HEAD") in made:
        if head is not None and tip:
            steps.append((f"switch HEAD back to {head[len(HEADS):]}", ["symbolic-ref", "HEAD", head]))
            final = tip
        elif head is None and commit:
            steps.append((f"detach HEAD at {commit[:12]} again", ["update-ref", "--no-deref", "HEAD", commit]))
            final = commit
    # A branch the write made goes only if no commit is lost with it: it sits at
    # the recorded commit, where HEAD ends up, or one commit of ours past it.
    for ref in sorted(made):
        made_tip = _try(workdir, "rev-parse", "-q", "--verify", ref)
        if made_tip and commit and ((made_tip == commit and final == commit)
                                    or _only_ours(workdir, made_tip, commit, ours)):
            steps.append((f"delete branch {ref[len(HEADS):]} (made by the interrupted write)",
                          ["update-ref", "-d", ref, made_tip]))
    # Index entries go back to the recorded commit only where HEAD ends up there
    # and the entry holds what the write staged (never a change of the user's).
    if commit and final == commit and ours:
        staged, base = _blobs(workdir, None, list(ours)), _blobs(workdir, commit, list(ours))
        back = [p for p, want in ours.items() if staged.get(p) != base.get(p)
                and (staged.get(p) is None if want is None else _sha256(workdir, staged.get(p)) == want)]
        if back:
            n = len(back)
            steps.append((f"reset {n} index entr{'y' if n == 1 else 'ies'} to {commit[:12]}",
                          ["reset", "-q", commit, "--", *back]))
    _refuse_stale_locks(git_dir, steps)
    return steps


def _refuse_stale_locks(git_dir: Path, steps: List[Tuple[str, List[str]]]) -> None:
    """Asked before any file is touched: a lock git leaves when killed while writing
    the index or a ref that a step writes would fail that step half-way through the
    rollback. kvpatch cannot tell it from a live git command's lock, so it names it."""
    locks = [INDEX_LOCK, f"{PACKED_REFS}.lock"]
    for _, args in steps:
        locks += [f"{a}.lock" for a in args if a == "HEAD" or a.startswith(HEADS)]
    # A branch lock no step writes is named too: apply killed while creating its branch
    # leaves refs/heads/<branch>.lock, and the next apply would fail on it half-way.
    heads = git_dir / HEADS
    if heads.is_dir():
        locks += sorted(p.relative_to(git_dir).as_posix() for p in heads.rglob("*.lock") if p.is_file())
    # `git commit -- <paths>` (apply's commit) builds its commit in a temporary index,
    # next-index-<pid>.lock: killed there, git leaves it, and it may be a live commit's.
    locks += sorted(p.name for p in git_dir.glob(NEXT_INDEX_LOCKS) if p.is_file())
    for name in dict.fromkeys(locks):
        if (git_dir / name).exists():
            raise GitUndoError(f"{git_dir / name} exists (a git command was killed while writing it): "
                               f"if no git command is running, remove it and run kvpatch recover again")


def undo(root: Path, steps: List[Tuple[str, List[str]]]) -> None:
    info = repo.git_info(root)
    for _, args in steps:
        _git(Path(info.workdir), *args)


def _written(root: Path, info: repo.GitInfo, files: List[dict]) -> Dict[str, Optional[str]]:
    """repo path -> sha256 of the bytes the write put there (None: it deleted the path)."""
    out: Dict[str, Optional[str]] = {}
    for f in files:
        want = f.get("new_sha256") if f.get("tmp") else None
        if f.get("tmp") and not (isinstance(want, str) and _SHA256.fullmatch(want)):
            continue  # not a hash: no commit or index entry can be shown to be the write's
        out[info.rel_to_repo(root, f["rel"])] = want
    return out


def _only_ours(workdir: Path, tip: str, base: str, ours: Dict[str, Optional[str]]) -> bool:
    """tip is at most MAX_COMMITS first-parent commits past base, and changes only
    the write's paths, each to exactly what the write put there."""
    chain = _try(workdir, "rev-list", "--first-parent", f"--max-count={MAX_COMMITS + 1}", f"{base}..{tip}")
    if not chain or len(chain.splitlines()) > MAX_COMMITS:
        return False
    if _try(workdir, "merge-base", "--is-ancestor", base, tip) is None:
        return False
    changed = _try(workdir, "diff", "--name-only", "-z", "--no-renames", base, tip)
    if changed is None:
        return False
    paths = [p for p in changed.split("\0") if p]
    if not set(paths) <= set(ours):
        return False
    blobs = _blobs(workdir, tip, paths)
    return all((blobs.get(p) is None) if ours[p] is None else
               (blobs.get(p) is not None and _sha256(workdir, blobs[p]) == ours[p]) for p in paths)


def _blobs(workdir: Path, treeish: Optional[str], paths: List[str]) -> Dict[str, str]:
    """path -> blob id, in a commit's tree or (treeish None) in the index."""
    args = ["ls-files", "-s", "-z"] if treeish is None else ["ls-tree", "-r", "-z", treeish]
    out = _git(workdir, *args, "--", *paths)
    blobs = {}
    for entry in out.split("\0"):
        if "\t" in entry:
            meta, path = entry.split("\t", 1)
            blobs[path] = meta.split()[1 if treeish is None else 2]
    return blobs


def _sha256(workdir: Path, blob: str) -> str:
    try:
        return hashlib.sha256(git.blobs(workdir, [blob])[0]).hexdigest()
    except git.GitError:
        return ""


def _kvpatch_branches(workdir: Path) -> set:
    return set(git.branches(workdir, HEADS + BRANCH_PREFIX))


def _git(workdir: Path, cmd: str, *args: str) -> str:
    """A git command of recover's (each one a kill point in the fault tests)."""
    try:
        return git.run(workdir, cmd, *args).strip()
    except git.GitError as exc:
        msg = (str(exc).strip().splitlines() or ["failed"])[-1]
        raise GitUndoError(f"git {' '.join((cmd, *args))[:80]}: {msg}") from None


def _try(workdir: Path, cmd: str, *args: str) -> Optional[str]:
    """The output of a git query, or None when it fails (a ref that is not there)."""
    out = git.query(workdir, cmd, *args)
    return None if out is None else out.strip()
