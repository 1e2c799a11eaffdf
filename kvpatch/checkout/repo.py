"""repo: the checkout kvpatch works on, as git sees it (through kvpatch.checkout.git).

Which commit and branch a checkout is on, whether its tree is dirty, which
files git lists, the `kvpatch/<version-or-sha>` branch and the one commit an
apply or revert makes. A directory outside git (or untracked inside someone
else's repository) works too: `git_info` then answers None and `plain_reason`
says why.

Every command runs through kvpatch.checkout.git (the git command itself, so hooks,
signing, identity, filters and the index lock are git's). Every path list git
prints is read with ``-z`` (quoted non-ASCII names never match), and every path
kvpatch passes is a literal pathspec (a file named ``*.py`` is not a glob).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from kvpatch.checkout import git
from kvpatch.checkout.git import BRANCH_PREFIX, HEADS, INDEX_LOCK, NUL, GitError  # noqa: F401 - GitError: callers catch it as repo.GitError

# setuptools-scm checkouts carry a literal "0.0.0..." fallback: not a version.
NO_VERSION = re.compile(r"0\.0\.0(\.dev\d*)?")
VERSION_FILES = ("python/sglang/version.py", "sglang/version.py")
SHA_IN_VERSIONED_BRANCH = 7
SHA_IN_BARE_BRANCH = 10
NO_VERIFY = "--no-verify"


@dataclass
class GitInfo:
    repo: object  # git.Repo, opaque outside kvpatch.checkout.git
    workdir: Path
    commit: Optional[str]
    branch: Optional[str]  # None: detached HEAD or no commit yet

    def rel_to_repo(self, root: Path, rel: str) -> str:
        return (root / rel).resolve().relative_to(self.workdir.resolve()).as_posix()

    def prefix(self, root: Path) -> str:
        """root relative to the repository's top, '' for the top itself."""
        rel = root.resolve().relative_to(self.workdir.resolve()).as_posix()
        return "" if rel == "." else rel


def _git(info: GitInfo, cmd: str, *args: str, raw: bool = False):
    """`git <cmd> args` in the repository's top directory (paths are repo-relative)."""
    return git.run(info.repo, cmd, *args, raw=raw)


def _info(repo) -> GitInfo:
    commit, branch = git.head(repo)
    return GitInfo(repo, git.workdir(repo), commit, branch)


def _tracked_under(info: GitInfo, root: Path) -> bool:
    """Whether the repository tracks anything at or under root."""
    prefix = info.prefix(root)
    if not prefix:
        return True  # the repository itself, even with nothing committed yet
    return bool(_git(info, "ls-files", "-z", "--cached", "--", prefix, raw=True))


def git_info(root: Path) -> Optional[GitInfo]:
    """The repository root is part of, or None: outside git, or untracked in an
    unrelated repository (a dotfiles repo, an ignored build copy), where
    switching that repository's branch would be wrong."""
    if root.is_file():
        root = root.parent
    repo = git.repo_at(root)
    if repo is None:
        return None
    info = _info(repo)
    return info if _tracked_under(info, root) else None


def plain_reason(root: Path) -> str:
    """Why root is handled as a plain directory (git_info answered None)."""
    repo = git.repo_at(root)
    if repo is None:
        return "not a git checkout"
    return (f"not tracked by the git repository at {git.workdir(repo)}: "
            f"treated as a plain directory")


def listed_files(root: Path) -> Optional[List[str]]:
    """Files under root as git sees them (tracked, plus untracked that no ignore
    rule hides), relative to root and sorted; None when git does not manage root
    (the caller then walks the tree). Ignored copies such as python/build/lib/
    are left out, as ast-grep and semgrep leave them out."""
    fast = _listed_quick(root)
    if fast is not None:
        return fast
    info = git_info(root)
    if info is None:
        return None
    prefix = info.prefix(root)
    out = _git(info, "ls-files", "-z", "--cached", "--others", "--exclude-standard",
               *(["--", prefix] if prefix else []), raw=True)
    cut = len(prefix) + 1 if prefix else 0
    return sorted({p[cut:] for p in git.split_z(out)})


def _listed_quick(root: Path) -> Optional[List[str]]:
    """listed_files through two plain git queries (audit's listing, without
    GitPython): None whenever the answer is not a plain yes (outside git, a bare
    repository, nothing tracked under root, git refusing), and listed_files then
    asks the slow way, which also refuses an unreadable .git."""
    if root.is_file() or not git._inside_git(root):
        return None
    where = git.quick_query(root, "rev-parse", "--is-bare-repository", "--is-inside-work-tree")
    if where is None or where.split() != [b"false", b"true"]:
        return None
    # -t tags each entry: "? " untracked, any other tag a file git tracks. Paths
    # are relative to root (git's cwd), and only those under it are listed.
    out = git.quick_query(root, "ls-files", "-z", "-t", "--cached", "--others", "--exclude-standard")
    if out is None:
        return None
    entries = git.split_z(out)
    if not any(e[:2] != "? " for e in entries):
        return None  # nothing tracked under root: the slow way decides (plain directory)
    return sorted({e[2:] for e in entries})


def dirty_paths(info: GitInfo, root: Path) -> List[str]:
    """Tracked files with uncommitted changes (staged or not) under root,
    relative to the repository's top."""
    out = _git(info, "status", "--porcelain=v1", "-z", "--untracked-files=no", raw=True)
    paths = set()
    entries = out.split(NUL)
    i = 0
    while i < len(entries):
        e = entries[i]
        i += 1
        if len(e) < 4:
            continue
        paths.add(os.fsdecode(e[3:]))
        if e[:1] in (b"R", b"C"):  # a rename or copy: its source follows
            paths.add(os.fsdecode(entries[i]))
            i += 1
    prefix = info.prefix(root)
    if not prefix:
        return sorted(paths)
    return sorted(p for p in paths if p == prefix or p.startswith(prefix + "/"))


def tracked(info: GitInfo, paths: Iterable[str]) -> List[str]:
    """Those of paths (relative to the repository's top) that git tracks."""
    paths = list(paths)
    if not paths:
        return []
    out = _git(info, "ls-files", "-z", "--cached", "--", *paths, raw=True)
    return sorted(set(git.split_z(out)))


def preflight(info: GitInfo) -> None:
    """Refuse before anything is written where the commit would be refused:
    another git process holds the index, or git has no identity to commit as
    (with user.useConfigOnly git refuses to invent one, and so does kvpatch)."""
    lock = Path(_git(info, "rev-parse", "--git-path", INDEX_LOCK))
    if not lock.is_absolute():
        lock = info.workdir / lock
    if lock.exists():
        raise GitError(f"{lock} exists: another git process is running in this repository, "
                       f"or one crashed (remove the file if none is running)")
    for ident in ("GIT_AUTHOR_IDENT", "GIT_COMMITTER_IDENT"):
        try:
            _git(info, "var", ident)
        except GitError as exc:
            raise GitError(_last_line(str(exc))) from None


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else text


def sglang_version(root: Path) -> Optional[str]:
    for rel in VERSION_FILES:
        p = root / rel
        if p.exists():
            m = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", p.read_text(encoding="utf-8", errors="replace"))
            if m and not NO_VERSION.fullmatch(m.group(1)):
                return m.group(1)
    return None


def branch_name(info: GitInfo, root: Path) -> str:
    """kvpatch/v<sglang version>-<sha7>, or kvpatch/<sha10> where the checkout
    names no version; -2, -3... if taken (the README says the same)."""
    version = sglang_version(root)
    sha = info.commit or "0" * SHA_IN_BARE_BRANCH
    tag = f"v{version}-{sha[:SHA_IN_VERSIONED_BRANCH]}" if version else sha[:SHA_IN_BARE_BRANCH]
    base = BRANCH_PREFIX + re.sub(r"[^A-Za-z0-9._-]", "-", tag)
    existing = {ref[len(HEADS):] for ref in git.branches(info.repo)}
    name, n = base, 2
    while name in existing:
        name, n = f"{base}-{n}", n + 1
    return name


def create_branch(info: GitInfo, name: str) -> None:
    # One git command: if it fails (an index lock), no branch is left behind.
    _git(info, "checkout", "-q", "-b", name)


def commit(info: GitInfo, paths: List[str], message: str, no_verify: bool = False, force: Iterable[str] = ()) -> str:
    """Commit exactly `paths` (repository-relative; present files are added,
    missing ones recorded as removed) with `git commit --only`, so the user's
    other staged changes stay staged and out of kvpatch's commit. Hooks,
    signing and identity are git's. On failure the index entries of `paths`
    are put back as they were and GitError carries the hook's output. `force`:
    those of `paths` that .kvpatch/'s own ignore file hides (the state record)."""
    force = set(force)
    present = [p for p in paths if (info.workdir / p).exists()]
    try:
        if [p for p in present if p not in force]:
            _git(info, "add", "--", *[p for p in present if p not in force])
        if [p for p in present if p in force]:
            _git(info, "add", "-f", "--", *[p for p in present if p in force])
        _git(info, "commit", "-q", "--only", "-m", message, *([NO_VERIFY] if no_verify else []), "--", *paths)
    except GitError:
        try:
            # HEAD did not move: its entries are the index as it was for these
            # paths (apply and revert refuse a path with staged changes).
            if info.commit:
                _git(info, "reset", "-q", "HEAD", "--", *paths)
            else:
                _git(info, "rm", "-q", "--cached", "--ignore-unmatch", "--", *paths)
        except GitError:
            pass  # the commit's own error is the one to report
        raise
    return git.head(info.repo)[0]


def restore_branch(info: GitInfo, original_branch: Optional[str], created: Optional[str]) -> None:
    """Undo create_branch after a failed apply."""
    if original_branch and info.commit is None:  # an unborn branch: nothing to check out
        _git(info, "symbolic-ref", "HEAD", HEADS + original_branch)
    elif original_branch:
        _git(info, "checkout", "-q", original_branch)
    elif info.commit:
        _git(info, "checkout", "-q", "--detach", info.commit)
    if created and HEADS + created in git.branches(info.repo):
        _git(info, "branch", "-q", "-D", created)
