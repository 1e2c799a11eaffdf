"""The patch on the new tree, and a git ref materialized as a tree."""

from __future__ import annotations


import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from kvpatch.safepath import UnsafePath, check_rel, create_new, inside
from kvpatch.upgrade.model import UpgradeError

# -- materializing a git ref -------------------------------------------------------------
def _git(args: List[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, **kw)
    except FileNotFoundError as exc:
        raise UpgradeError("--against needs git on PATH") from exc


def git_location(root: Path) -> Tuple[Path, str]:
    """(repository top level, root's path inside it with a trailing slash or '')."""
    d = root if root.is_dir() else root.parent
    r = _git(["rev-parse", "--show-toplevel", "--show-prefix"], d, text=True)
    if r.returncode != 0:
        raise UpgradeError(f"{root}: not inside a git repository (--against REF compares with a git revision; "
                           f"to compare two trees use `kvpatch audit OLD_DIR NEW_DIR`)")
    top, prefix = (r.stdout.splitlines() + ["", ""])[:2]
    return Path(top), prefix


def resolve_ref(top: Path, ref: str) -> str:
    r = _git(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"], top, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise UpgradeError(f"{ref}: not a commit in {top} (git rev-parse found no such revision)")
    return r.stdout.strip()


# The markers of discover.is_candidate as fixed strings (git grep ORs them): a
# superset of the files the scan reads (every file naming the MLA wrapper is taken,
# plan call or not). Only these are written out: creating the ~5,000 files of a
# whole checkout costs seconds, most of them in the kernel.
GREP_MARKERS = ("get_key_buffer", "get_value_buffer", "get_kv_buffer", "get_mla_kv_buffer",
                "_kvpatch_runtime", "kv_for_kernel", "plan_kv_dtype", "BatchMLAPagedAttentionWrapper")


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
        r = _git(["cat-file", "blob", sha], self.top)
        return r.stdout if r.returncode == 0 else None


def _blobs(top: Path, shas: List[str]) -> List[bytes]:
    """The contents of blobs, through one `git cat-file --batch`."""
    if not shas:
        return []
    r = _git(["cat-file", "--batch"], top, input=("\n".join(shas) + "\n").encode())
    if r.returncode != 0:
        raise UpgradeError(f"git cat-file failed: {r.stderr.decode('utf-8', 'replace').strip()}")
    out, pos, data = [], 0, r.stdout
    for _ in shas:
        nl = data.index(b"\n", pos)
        header = data[pos:nl].split()
        if len(header) < 3 or header[1] != b"blob":
            raise UpgradeError(f"git cat-file: unexpected {data[pos:nl][:80]!r}")
        size = int(header[2])
        out.append(data[nl + 1:nl + 1 + size])
        pos = nl + 1 + size + 1
    return out


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
    ls = _git(["ls-tree", "-r", "-z", commit, *spec], top)
    if ls.returncode != 0:
        raise UpgradeError(f"git ls-tree {commit[:12]} failed: {ls.stderr.decode('utf-8', 'replace').strip()}")
    blobs: Dict[str, str] = {}
    for entry in ls.stdout.split(b"\0"):
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
    grep = _git(args + [commit, "--", f"{prefix}*.py" if prefix else "*.py"], top)
    if grep.returncode not in (0, 1):  # 1: nothing matched
        raise UpgradeError(f"git grep {commit[:12]} failed: {grep.stderr.decode('utf-8', 'replace').strip()}")
    head = f"{commit}:".encode()
    wanted = []
    for hit in grep.stdout.split(b"\0"):
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


