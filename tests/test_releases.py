"""SGLang releases as inputs: the wheel layout (`sglang/srt/...`, no `python/`), an
installed package (`site-packages/sglang`), and the real releases 0.5.16-0.5.23.

The layout tests use the bundled example tree rearranged, so they always run. The
real-release tests need the releases' Python source, which is never committed:
set KVPATCH_SGLANG_RELEASES to a folder holding unpacked wheels (`0.5.23/sglang/...`)
or the wheels themselves (`sglang-0.5.23-*.whl`), or set KVPATCH_DOWNLOAD_RELEASES=1
to let the test `pip download` them; otherwise they skip and say so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import EXAMPLE, FI_MLA, REPO, tree_hashes
from kvpatch.cli.commands import main
from kvpatch.engine import scan_tree
from kvpatch.sites import PATCHED, PLAN_PATCHED

RELEASES_ENV = "KVPATCH_SGLANG_RELEASES"
DOWNLOAD_ENV = "KVPATCH_DOWNLOAD_RELEASES"
RELEASES = tuple(f"0.5.{n}" for n in range(16, 24))
FI_MLA_IN_PACKAGE = FI_MLA.split("sglang/", 1)[1]  # srt/layers/attention/...
GOLDEN = REPO / "tests" / "golden" / "flashinfer_mla_backend.patched.py"


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def _wheel_layout(tmp_path: Path) -> Path:
    """The example tree as a wheel unpacks it: sglang/ at the top."""
    root = tmp_path / "wheel"
    shutil.copytree(EXAMPLE / "python" / "sglang", root / "sglang")
    return root


@pytest.mark.parametrize("target", ["wheel", "package"])
def test_apply_status_revert_on_wheel_layout_and_installed_package(tmp_path, target):
    root = _wheel_layout(tmp_path)
    path = root if target == "wheel" else root / "sglang"  # site-packages/sglang itself
    rel = ("sglang/" if target == "wheel" else "") + FI_MLA_IN_PACKAGE
    before = tree_hashes(root)
    r = run("apply", path)
    assert r.exit_code == 0, r.output
    assert (path / rel).read_text() == GOLDEN.read_text()
    assert run("status", path).exit_code == 0
    again = tree_hashes(root)
    assert run("apply", path).exit_code == 0 and tree_hashes(root) == again  # idempotent
    rv = run("revert", path)
    assert rv.exit_code == 0, rv.output
    assert tree_hashes(root) == before


# --- real releases ---------------------------------------------------------------------


def _release_root(version: str, cache: Path) -> Path:
    """An unpacked copy of release `version`, or pytest.skip with the reason."""
    base = os.environ.get(RELEASES_ENV)
    if base:
        tree = Path(base) / version
        if (tree / "sglang" / "srt").is_dir():
            return tree
        wheels = sorted(Path(base).glob(f"sglang-{version}-*.whl"))
        if not wheels:
            pytest.skip(f"{RELEASES_ENV}={base} has neither {version}/sglang/ nor sglang-{version}-*.whl")
    elif os.environ.get(DOWNLOAD_ENV) == "1":
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache),
                              f"sglang=={version}"], capture_output=True, text=True)
        wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
        if got.returncode != 0 or not wheels:
            pytest.skip(f"pip download sglang=={version} failed: {got.stderr.strip()[-300:]}")
    else:
        pytest.skip(f"set {RELEASES_ENV}=DIR (unpacked releases or their wheels) or {DOWNLOAD_ENV}=1 "
                    f"to run on SGLang {version}")
    tree = cache / version
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(tree, [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")])
    return tree


@pytest.mark.real_sglang
@pytest.mark.parametrize("version", RELEASES)
def test_release_every_plan_call_routed_and_revert_exact(tmp_path_factory, tmp_path, version):
    src = _release_root(version, tmp_path_factory.mktemp(f"whl-{version}"))
    root = tmp_path / "rel"
    shutil.copytree(src / "sglang", root / "sglang")
    before = tree_hashes(root)
    r = run("apply", root)
    assert r.exit_code in (0, 1), r.output
    after = scan_tree(root)
    fi = [s for s in after.sites if s.file.endswith(FI_MLA_IN_PACKAGE)]
    plans = [p for p in after.plans if p.file.endswith(FI_MLA_IN_PACKAGE)]
    # Both FlashInfer MLA casts rewritten, and every call that plans their wrappers
    # (stock plan, fast_mla_decode_plan, fast_mla_prefill_plan) tells the runtime its rows.
    assert sum(s.status == PATCHED for s in fi) == 2, [(s.line, s.status, s.reason) for s in fi]
    assert plans and all(p.status == PLAN_PATCHED for p in plans), [(p.line, p.status, p.reason) for p in plans]
    text = (root / "sglang" / FI_MLA_IN_PACKAGE).read_text()
    compile(text, FI_MLA_IN_PACKAGE, "exec")
    assert text.count("_kvpatch_rt.plan_rows(") == len(plans)
    assert run("revert", root).exit_code == 0
    assert tree_hashes(root) == before


@pytest.mark.real_sglang
@pytest.mark.parametrize("old,new", list(zip(RELEASES, RELEASES[1:])))
def test_upgrade_audit_between_two_releases_without_git(tmp_path_factory, tmp_path, old, new):
    """`kvpatch audit OLD NEW` on two unpacked wheels: no git checkout anywhere."""
    a = _release_root(old, tmp_path_factory.mktemp(f"whl-{old}"))
    b = _release_root(new, tmp_path_factory.mktemp(f"whl-{new}"))
    before = tree_hashes(a), tree_hashes(b)
    report = tmp_path / "upgrade.json"
    r = run("audit", "--json", "-o", report, a, b)
    assert r.exit_code in (0, 1), r.output  # 1: something new needs action; never an error
    doc = json.loads(report.read_text())
    assert doc["patch"]["applies"], doc["patch"]
    assert (tree_hashes(a), tree_hashes(b)) == before  # audit writes nothing
