"""The README names only modules that exist, and "How it works" names every module of kvpatch/."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
# kvpatch/x.py, kvpatch/verify/, rules/*.py ...
PATHS = re.compile(r"(?<![\w/.-])((?:kvpatch|rules)/[\w/]*(?:\.py|/))")


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def test_every_path_the_readme_names_exists():
    named = set(PATHS.findall(README))
    assert len(named) > 20, named
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_how_it_works_names_every_module():
    named = set(PATHS.findall(_section("How it works")))
    modules = {f"kvpatch/{p.name}" for p in (REPO / "kvpatch").glob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    # packages are named as folders; cli_* modules by their short names next to kvpatch/cli/commands.py
    text = _section("How it works")
    unnamed = sorted(m for m in modules if m not in named and Path(m).name not in text)
    assert not unnamed, f"README.md's How it works leaves out: {unnamed}"
    packages = {f"kvpatch/{p.name}/" for p in (REPO / "kvpatch").iterdir() if (p / "__init__.py").is_file()}
    assert packages <= named, f"README.md's How it works leaves out: {sorted(packages - named)}"
