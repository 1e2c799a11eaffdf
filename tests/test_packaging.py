"""Where the built-in rules come from: rules/ sits at the top of the repository and
is installed as kvpatch.rules (pyproject's package-dir), with no import-path trick in
kvpatch/__init__.py. A wheel carries it inside the package; a source tree (a clone,
installed or not) loads its own rules/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RULE_FILES = sorted(p.name for p in (REPO / "rules").glob("*.py"))
PROBE = ("import json, kvpatch, kvpatch.rule as r; rules = r.load_rules(); "
         "print(json.dumps({'kvpatch': kvpatch.__file__, 'ids': [x.ID for x in rules], "
         "'files': sorted({sys.modules[type(x).__module__].__file__ for x in rules}), "
         "'path': list(kvpatch.__path__)}))")


def _probe(cwd: Path, pythonpath: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    env.pop("KVPATCH_RULES_PATH", None)
    out = subprocess.run([sys.executable, "-c", "import sys; " + PROBE], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _expected_ids():
    from kvpatch.rule import load_rules

    return [r.ID for r in load_rules()]


def test_init_does_not_extend_the_package_path():
    src = (REPO / "kvpatch" / "__init__.py").read_text(encoding="utf-8")
    assert "__path__" not in src
    got = _probe(REPO, REPO)
    assert got["path"] == [str(REPO / "kvpatch")]


def test_source_tree_loads_its_own_rules(tmp_path):
    """A clone (here a copy of kvpatch/ and rules/ only) loads the rules beside it,
    never the ones of another kvpatch on the path."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "kvpatch", clone / "kvpatch", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "rules", clone / "rules", ignore=shutil.ignore_patterns("__pycache__"))
    got = _probe(clone, clone)
    assert got["kvpatch"] == str(clone / "kvpatch" / "__init__.py")
    assert got["ids"] == _expected_ids()
    assert {Path(f).parent for f in got["files"]} == {clone / "rules"}


def test_wheel_installs_rules_inside_the_package(tmp_path):
    """`pip wheel .` puts rules/ at kvpatch/rules/ in the wheel, and kvpatch imported
    from the unpacked wheel loads them from there."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:  # pyproject's [build-system] requires
        pytest.skip(f"building the wheel needs setuptools>=77 (this interpreter has {setuptools.__version__})")
    src = tmp_path / "src"
    # only what the build needs: a copy keeps build/ and *.egg-info out of the repo
    for name in ("kvpatch", "rules"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0 and "No module named pip" in out.stderr:
        pytest.skip("no pip in this interpreter")
    assert out.returncode == 0, out.stderr
    wheel, = (tmp_path / "dist").glob("kvpatch-*.whl")
    _installed_wheel_runs_the_example(tmp_path, wheel)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    assert {f"kvpatch/rules/{n}" for n in RULE_FILES} <= names
    assert not any(n.startswith("rules/") for n in names)
    # every module ships: the stage subpackages (setuptools lists packages by name) and the
    # runtime's parts, which apply joins from the installed package
    ours = {f.relative_to(REPO).as_posix() for f in (REPO / "kvpatch").rglob("*.py")}
    assert ours <= names, sorted(ours - names)
    got = _probe(tmp_path, tmp_path / "site")
    assert got["kvpatch"] == str(tmp_path / "site" / "kvpatch" / "__init__.py")
    assert got["ids"] == _expected_ids()
    assert {Path(f).parent for f in got["files"]} == {tmp_path / "site" / "kvpatch" / "rules"}


def _installed_wheel_runs_the_example(tmp_path: Path, wheel: Path):
    """The README's wheel route: `pip install dist/kvpatch-*.whl`, then its `kvpatch`
    console script rewrites the quick start's examples/ tree (not a git checkout)."""
    target = tmp_path / "installed"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                          "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    script = target / "bin" / "kvpatch"
    assert script.is_file(), sorted(p.name for p in target.iterdir())
    tree = tmp_path / "example"
    shutil.copytree(REPO / "examples", tree)
    env = {**os.environ, "PYTHONPATH": str(target)}  # the dependencies come from this interpreter
    env.pop("KVPATCH_RULES_PATH", None)
    run = subprocess.run([sys.executable, str(script), "--color", "never", "apply", "--no-commit", str(tree)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "sites rewritten" in run.stdout, run.stdout
    probe = subprocess.run([sys.executable, "-c", "import kvpatch; print(kvpatch.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == str(target / "kvpatch" / "__init__.py")
    again = subprocess.run([sys.executable, str(script), "audit", "--json", str(tree)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    statuses = [x["status"] for x in json.loads(again.stdout)["sites"]]
    # what apply rewrote audits as patched; the example's one unsupported site stays, by design
    assert "patched" in statuses and "hot" not in statuses, statuses
