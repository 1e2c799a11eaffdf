"""git: the one module that runs git, through GitPython (imported only when needed).

Every other module (checkout, gittxn, the upgrade audit's ref reader, verify's
target finder) asks here. Everything goes through the git command
(``repo.git.<cmd>``), never through GitPython's own index or object writers:
only git itself honours the user's hooks, ``commit.gpgsign``, identity rules,
``core.autocrlf`` and other filters, and the index lock. Paths are literal
pathspecs unless a caller asks for a glob, and byte output is taken whole
(GitPython strips a trailing newline from text output only).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Optional, Tuple, Union

from kvpatch.names import DOT_GIT

# Paths kvpatch hands git are file names, never pathspec magic or globs.
LITERAL_ENV = {"GIT_LITERAL_PATHSPECS": "1"}
NUL = b"\0"
BLOB = "blob"
HEADS = "refs/heads/"
BRANCH_PREFIX = "kvpatch/"  # the branches apply makes: refs/heads/kvpatch/...
INDEX_LOCK = "index.lock"  # in the git dir while a git command writes the index
NEXT_INDEX_LOCKS = "next-index-*.lock"  # in the git dir while `git commit -- <paths>` builds its commit
PACKED_REFS = "packed-refs"  # in the git dir: deleting a packed branch rewrites it (under packed-refs.lock)

Where = Union[str, os.PathLike, object]  # a directory, a git.Repo or a git.Git


class GitError(Exception):
    """A git command refused; the message is git's own (its last lines)."""


class GitMissing(GitError):
    """git (or GitPython) is not installed."""


class GitUnreadable(GitError):
    """A .git is there but cannot be read: the checkout is refused, not taken as plain."""


def _gitpython():
    try:
        import git  # GitPython: slow to import, so only when git is needed
    except ImportError as exc:  # GitPython finds no git executable, or is missing
        raise GitMissing(f"git is not available: {str(exc).splitlines()[0] if str(exc) else exc!r}") from None
    return git


def message(exc) -> str:
    """git's own words from a GitCommandError: the hook's output, or the fatal line."""
    def text(b):
        return (b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b or "")).strip()

    out = "\n".join(t for t in (text(getattr(exc, "stdout", "")), text(getattr(exc, "stderr", ""))) if t)
    # GitPython wraps its captures as "  stdout: '...'" / "  stderr: '...'".
    out = re.sub(r"^\s*std(out|err): '", "", out, flags=re.M).rstrip("'").strip()
    return out or str(exc)


def _cmd(where: Where):
    if isinstance(where, (str, os.PathLike)):
        return _gitpython().Git(os.fspath(where))
    return getattr(where, "git", where)


def _env(literal: bool) -> dict:
    return LITERAL_ENV if literal else {}


def run(where: Where, cmd: str, *args: str, raw: bool = False, literal: bool = True) -> Union[str, bytes]:
    """`git <cmd> args` in `where` (a directory or a repository): its stdout, as
    text without the final newline, or (raw) every byte. GitError on failure."""
    git = _gitpython()
    try:
        return getattr(_cmd(where), cmd.replace("-", "_"))(
            *args, env=_env(literal), stdout_as_string=not raw, strip_newline_in_stdout=not raw)
    except git.GitCommandError as exc:
        raise GitError(message(exc)) from None


def query(where: Where, cmd: str, *args: str, **kw) -> Optional[Union[str, bytes]]:
    """The output of a git query, or None when it fails (a ref that is not there)."""
    try:
        return run(where, cmd, *args, **kw)
    except GitMissing:
        raise
    except GitError:
        return None


def run_status(where: Where, cmd: str, *args: str, literal: bool = True) -> Tuple[int, bytes, str]:
    """(exit status, stdout, stderr) of a git command whose status is an answer (grep: 1 = no match)."""
    git = _gitpython()
    try:
        return getattr(_cmd(where), cmd.replace("-", "_"))(
            *args, env=_env(literal), stdout_as_string=False, strip_newline_in_stdout=False,
            with_extended_output=True, with_exceptions=False)
    except git.GitCommandError as exc:  # git itself could not be started
        raise GitError(message(exc)) from None


def blobs(where: Where, shas: List[str]) -> List[bytes]:
    """The bytes of blobs, through one `git cat-file --batch` process."""
    if not shas:
        return []
    _gitpython()
    g = _cmd(where)
    out = []
    try:
        for sha in shas:
            try:
                _, kind, _, data = g.get_object_data(sha)
            except ValueError as exc:  # "missing": GitPython's word for an unknown object
                raise GitError(f"git cat-file {sha[:12]}: {exc}") from None
            kind = os.fsdecode(kind)  # bytes or text, by GitPython version
            if kind != BLOB:
                raise GitError(f"git cat-file {sha[:12]}: a {kind}, not a blob")
            out.append(data)
    finally:
        g.clear_cache()  # the cat-file process ends here, not at garbage collection
    return out


def filtered(where: Where, commit: str, path: str) -> Optional[bytes]:
    """The bytes `git checkout` would write for path at commit (core.autocrlf,
    .gitattributes eol and smudge filters applied), or None when it has none."""
    return query(where, "cat-file", "--filters", f"{commit}:{path}", raw=True)


def valid_ref(ref: str) -> bool:
    """Whether git accepts ref as a reference name."""
    return run_status(os.curdir, "check-ref-format", ref)[0] == 0


def quick_query(root: Path, *args: str) -> Optional[bytes]:
    """stdout of a read-only `git -C root args`, run without GitPython (whose import
    and Repo setup cost more than a whole file listing); None on any failure or when
    GIT_DIR/GIT_WORK_TREE redirect git, and the caller then asks the slow way, which
    names the error."""
    if os.environ.get("GIT_DIR") or os.environ.get("GIT_WORK_TREE"):
        return None
    import subprocess

    try:
        p = subprocess.run(["git", "-C", os.fspath(root), *args], stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           env={**os.environ, **LITERAL_ENV, "GIT_OPTIONAL_LOCKS": "0"})
    except OSError:
        return None
    return p.stdout if p.returncode == 0 else None


def split_z(out: bytes) -> List[str]:
    return [os.fsdecode(p) for p in out.split(NUL) if p]


def _inside_git(root: Path) -> bool:
    """A cheap look for a .git above root: outside git, GitPython (slow to
    import) is never loaded, so audit of a plain tree starts fast."""
    if os.environ.get("GIT_DIR"):
        return True
    root = root.resolve()
    return any((d / DOT_GIT).exists() for d in (root, *root.parents))


def repo_at(root: Path):
    """The (non-bare) repository root is in, or None (outside git, or no git)."""
    if not _inside_git(root):
        return None
    try:
        git = _gitpython()
    except GitMissing:
        return None
    try:
        repo = git.Repo(root, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, PermissionError):
        unreadable_git_dir(root)  # a .git kvpatch cannot read is refused, never taken for no git (issue 18)
        return None
    return None if repo.bare else repo


def unreadable_git_dir(root: Path) -> None:
    """GitError when the nearest .git at or above root exists but cannot be read."""
    root = root.resolve()
    dot = next((d / DOT_GIT for d in (root, *root.parents) if (d / DOT_GIT).exists()), None)
    if dot is None:
        return
    need = os.R_OK | (os.X_OK if dot.is_dir() else 0)
    try:
        readable = os.access(dot, need) and (not dot.is_dir() or (os.listdir(dot) is not None))
    except OSError:
        readable = False
    if not readable:
        raise GitUnreadable(f"{dot} cannot be read (permission denied): refusing to treat {root} "
                            f"as a plain directory (outside git)")


def workdir(repo) -> Path:
    return Path(repo.working_tree_dir)


def head(repo) -> Tuple[Optional[str], Optional[str]]:
    """(HEAD's commit, its branch name): None for no commit yet, or a detached HEAD."""
    commit = query(repo, "rev-parse", "-q", "--verify", "HEAD")
    ref = query(repo, "symbolic-ref", "-q", "HEAD") or ""
    return commit or None, ref[len(HEADS):] if ref.startswith(HEADS) else None


def branches(repo, prefix: str = HEADS) -> List[str]:
    """Full names of the refs under prefix."""
    out = query(repo, "for-each-ref", "--format=%(refname)", prefix) or ""
    return out.splitlines()


def toplevel(d: Path) -> Optional[Tuple[Path, str]]:
    """(the repository's top directory, d's path inside it: '' or ending in '/'),
    or None outside a repository."""
    out = query(d, "rev-parse", "--show-toplevel", "--show-prefix")
    if out is None:
        return None
    top, prefix = (out.splitlines() + ["", ""])[:2]
    return Path(top), prefix
