"""The patch on the new tree, and a git ref materialized as a tree."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from kvpatch.checkout import git
from kvpatch.names import CANDIDATE_MARKERS, MLA_WRAPPER
from kvpatch.checkout.safepath import UnsafePath, check_rel, create_new, inside
from kvpatch.upgrade.model import UpgradeError


# -- materializing a git ref -------------------------------------------------------------
@contextmanager
def _git_needed():
    try:
        yield
    except git.GitMissing as exc:
        raise UpgradeError(f"--against needs git ({exc})") from None


def git_location(root: Path) -> Tuple[Path, str]:
    """(repository top level, root's path inside it with a trailing slash or '')."""
    with _git_needed():
        where = git.toplevel(root if root.is_dir() else root.parent)
    if where is None:
        raise UpgradeError(f"{root}: not inside a git repository (--against REF compares with a git revision; "
                           f"to compare two trees use `kvpatch audit OLD_DIR NEW_DIR`)")
    return where


def resolve_ref(top: Path, ref: str) -> str:
    with _git_needed():
        sha = git.query(top, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}")
    if not sha or not sha.strip():
        raise UpgradeError(f"{ref}: not a commit in {top} (git rev-parse found no such revision)")
    return sha.strip()


# The markers of discover.is_candidate as fixed strings (git grep ORs them): a
# superset of the files the scan reads (every file naming the MLA wrapper is taken,
# plan call or not). Only these are written out: creating the ~5,000 files of a
# whole checkout costs seconds, most of them in the kernel.
GREP_MARKERS = CANDIDATE_MARKERS + (MLA_WRAPPER,)


@dataclass
class RefTree:
    """PATH at a git commit: which .py files it has, and their bytes on demand."""

    top: Path
    prefix: str  # PATH inside the repository, '' or ending in '/'
    commit: str
    blobs: Dict[str, str]  # every regular .py file under prefix (relative to it) -> blob sha

    def exists(self, rel: str) -> bool:
        return rel in self.blobs

    def read(self, rel: str) -> Optional[bytes]:
        sha = self.blobs.get(rel)
        if sha is None:
            return None
        try:
            return git.blobs(self.top, [sha])[0]
        except git.GitError:
            return None


def _blobs(top: Path, shas: List[str]) -> List[bytes]:
    """The contents of blobs, through one `git cat-file --batch` process."""
    try:
        return git.blobs(top, shas)
    except git.GitError as exc:
        raise UpgradeError(str(exc)) from None


def _safe(name: str) -> bool:
    """A crafted tree can hold `..` or absolute entries: such a file is never
    written (audit writes nothing outside its temp dir), only left out."""
    try:
        check_rel(name, "tree entry")
        return True
    except UnsafePath:
        return False


def materialize(top: Path, prefix: str, commit: str, dest: Path) -> Tuple[Path, RefTree]:
    """Write the files under prefix at commit that the audit reads into dest.
    Returns the old root and the commit's full list of .py files."""
    spec = ["--", prefix] if prefix else []
    try:
        listing = git.run(top, "ls-tree", "-r", "-z", commit, *spec, raw=True)
    except git.GitError as exc:
        raise UpgradeError(f"git ls-tree {commit[:12]} failed: {exc}") from None
    blobs: Dict[str, str] = {}
    for entry in listing.split(git.NUL):
        if not entry:
            continue
        meta, _, path = entry.partition(b"\t")
        mode, kind, sha = meta.split()
        name = path.decode("utf-8", "surrogateescape")
        # regular files only: links and submodules are never written (nor followed)
        if kind == b"blob" and mode in (b"100644", b"100755") and name.endswith(".py") \
                and name.startswith(prefix) and _safe(name):
            blobs[name[len(prefix):]] = sha.decode()
    if not blobs:
        raise UpgradeError(f"{prefix or '.'}: no Python files there at {commit[:12]}")
    args = ["grep", "-l", "-z", "-F"]
    for marker in GREP_MARKERS:
        args += ["-e", marker]
    # a glob pathspec, the one git command kvpatch gives one
    status, hits, err = git.run_status(top, *args, commit, "--", f"{prefix}*.py" if prefix else "*.py",
                                       literal=False)
    if status not in (0, 1):  # 1: nothing matched
        raise UpgradeError(f"git grep {commit[:12]} failed: {err.strip()}")
    head = f"{commit}:".encode()
    wanted = []
    for hit in hits.split(git.NUL):
        if hit.startswith(head):
            name = hit[len(head):].decode("utf-8", "surrogateescape")
            if name.startswith(prefix) and name[len(prefix):] in blobs:
                wanted.append(name[len(prefix):])
    old_root = dest / prefix if prefix else dest
    old_root.mkdir(parents=True, exist_ok=True)
    for rel, data in zip(wanted, _blobs(top, [blobs[r] for r in wanted])):
        target = inside(old_root, rel, "tree entry")
        target.parent.mkdir(parents=True, exist_ok=True)
        create_new(target, data)
    return old_root, RefTree(top, prefix, commit, blobs)


