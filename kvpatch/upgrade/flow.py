"""Running the upgrade audit: two trees, or a tree and a git ref."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional
from kvpatch.upgrade.gitref import RefTree, git_location, materialize, resolve_ref
from kvpatch.upgrade.model import Tree, Upgrade
from kvpatch.upgrade.pairing import Trees, compare_plans, compare_sites

# -- the flow ------------------------------------------------------------------------
def run_upgrade(old_root: Path, new_root: Path, select=None, jobs=None, progress=None, *,
                old_display: Optional[str] = None, ref: Optional[str] = None,
                commit: Optional[str] = None, ref_tree: Optional[RefTree] = None,
                excluded: Optional[Callable[[str], bool]] = None) -> Upgrade:
    """`excluded` (the config's exclude, as plain audit takes it) tests paths relative
    to a tree's root; both trees are scanned through it, so a file left out of one
    is left out of the other (the trees pair files by those paths)."""
    from kvpatch import patch as P
    from kvpatch.engine import scan_tree

    t0 = time.perf_counter()
    old_scan = scan_tree(old_root, select, jobs, progress, excluded)
    if ref_tree is not None:
        old_scan.files_scanned = len(ref_tree.blobs)  # every .py at REF passed the prefilter
    built = P.build(new_root, select, jobs, progress, excluded)
    new_scan = built.scan
    trees = Trees(old_scan.root, new_scan.root, [f.rel for f in new_scan.files], ref_tree)
    sites = compare_sites(old_scan.sites, new_scan.sites, trees)
    plans = compare_plans(old_scan.plans, new_scan.plans, trees)
    errors = [("old", e) for e in old_scan.all_errors] + [("new", e) for e in new_scan.all_errors]
    old = Tree(old_scan.root, old_display or str(old_root), ref, commit, old_scan)
    new = Tree(new_scan.root, str(new_root), None, None, new_scan)
    return Upgrade(old, new, sites, plans, built, errors, time.perf_counter() - t0)


def upgrade_against(root: Path, ref: str, select=None, jobs=None, progress=None,
                    excluded: Optional[Callable[[str], bool]] = None) -> Upgrade:
    root = root.resolve()
    top, prefix = git_location(root)
    commit = resolve_ref(top, ref)
    tmp = Path(tempfile.mkdtemp(prefix="kvpatch-audit-"))
    try:
        old_root, ref_tree = materialize(top, prefix, commit, tmp)
        up = run_upgrade(old_root, root, select, jobs, progress,
                         old_display=f"{root} @ {ref}" + (f" ({commit[:12]})" if not commit.startswith(ref) else ""),
                         ref=ref, commit=commit, ref_tree=ref_tree, excluded=excluded)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return up


