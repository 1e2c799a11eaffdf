"""checkout: the git side of a checkout (GitPython, imported only when needed).

Which commit and branch a checkout is on, whether its tree is dirty, the
`kvpatch/<version-or-sha>` branch and the one commit an apply makes. A
directory outside git works too: every function here then answers None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from kvpatch.gittxn import BRANCH_PREFIX


@dataclass
class GitInfo:
    repo: object  # git.Repo
    workdir: Path
    commit: Optional[str]
    branch: Optional[str]  # None: detached HEAD or no commit yet

    def rel_to_repo(self, root: Path, rel: str) -> str:
        return (root / rel).resolve().relative_to(self.workdir.resolve()).as_posix()


def git_info(root: Path) -> Optional[GitInfo]:
    try:
        import git  # GitPython: slow to import, so only here
    except ImportError:  # pragma: no cover - a declared dependency
        return None
    try:
        repo = git.Repo(root, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return None
    if repo.bare:
        return None
    try:
        commit = repo.head.commit.hexsha
    except ValueError:
        commit = None
    try:
        branch = repo.active_branch.name
    except TypeError:
        branch = None
    return GitInfo(repo, Path(repo.working_tree_dir), commit, branch)


def dirty_paths(info: GitInfo, root: Path) -> List[str]:
    """Tracked files with uncommitted changes (staged or not) under root."""
    repo = info.repo
    out = set()
    for diff in list(repo.index.diff(None)) + (list(repo.index.diff("HEAD")) if info.commit else []):
        for p in (diff.a_path, diff.b_path):
            if p:
                out.add(p)
    try:
        prefix = root.resolve().relative_to(info.workdir.resolve()).as_posix()
    except ValueError:
        prefix = ""
    if prefix in ("", "."):
        return sorted(out)
    return sorted(p for p in out if p == prefix or p.startswith(prefix + "/"))


def sglang_version(root: Path) -> Optional[str]:
    for rel in ("python/sglang/version.py", "sglang/version.py"):
        p = root / rel
        if p.exists():
            m = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", p.read_text(encoding="utf-8", errors="replace"))
            # setuptools-scm checkouts carry a literal "0.0.0..." fallback: not a version.
            if m and not re.fullmatch(r"0\.0\.0(\.dev\d*)?", m.group(1)):
                return m.group(1)
    return None


def branch_name(info: GitInfo, root: Path) -> str:
    """kvpatch/v<sglang version>-<sha7>, or kvpatch/<sha10>; -2, -3... if taken."""
    version = sglang_version(root)
    sha = info.commit or "0" * 10
    tag = f"v{version}-{sha[:7]}" if version else sha[:10]
    base = BRANCH_PREFIX + re.sub(r"[^A-Za-z0-9._-]", "-", tag)
    existing = {h.name for h in info.repo.heads}
    name, n = base, 2
    while name in existing:
        name, n = f"{base}-{n}", n + 1
    return name


def create_branch(info: GitInfo, name: str) -> None:
    head = info.repo.create_head(name)
    head.checkout()


def commit(info: GitInfo, paths: List[str], removed: List[str], message: str) -> str:
    repo = info.repo
    if paths:
        repo.index.add(paths)
    if removed:
        repo.index.remove(removed, working_tree=False, ignore_unmatch=True)
    c = repo.index.commit(message)
    return c.hexsha


def restore_branch(info: GitInfo, original_branch: Optional[str], created: Optional[str]) -> None:
    """Undo create_branch after a failed apply."""
    repo = info.repo
    if original_branch:
        repo.heads[original_branch].checkout()
    elif info.commit:
        repo.git.checkout(info.commit)
    if created and created in [h.name for h in repo.heads]:
        repo.delete_head(created, force=True)
