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
    assert len(named) > 15, named
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_how_it_works_names_every_module():
    named = set(PATHS.findall(_section("How it works")))
    modules = {f"kvpatch/{p.name}" for p in (REPO / "kvpatch").glob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    # top modules by path (or name); packages as folders
    text = _section("How it works")
    unnamed = sorted(m for m in modules if m not in named and Path(m).name not in text)
    assert not unnamed, f"README.md's How it works leaves out: {unnamed}"
    packages = {f"kvpatch/{p.name}/" for p in (REPO / "kvpatch").iterdir() if (p / "__init__.py").is_file()}
    assert packages <= named, f"README.md's How it works leaves out: {sorted(packages - named)}"
    # the stage packages list their modules by file name under their folder
    staged = sorted(f"kvpatch/{pkg}/{f.name}" for pkg in STAGES for f in (REPO / "kvpatch" / pkg).glob("*.py")
                    if f.name != "__init__.py" and not re.search(rf"(?<![\w.]){re.escape(f.name)}", text))
    assert not staged, f"README.md's How it works leaves out: {staged}"


# The stages of the flow as folders (issue 19); verify/, upgrade/ and runtime/ are described in prose.
STAGES = ("analysis", "rewrite", "checkout", "output", "cli")


def test_how_it_works_module_lists_name_files_that_exist():
    """Under a stage folder's line ("    analysis  kvpatch/analysis/"), the modules it lists
    by file name ("      discover.py  ...") exist in that folder."""
    folder, listed = None, []
    for line in _section("How it works").splitlines():
        head = re.match(r"^    \w+\s+(kvpatch/\w+/)\s*$", line)
        if head:
            folder = head.group(1)
            continue
        item = re.match(r"^      (\w+\.py)\s", line)
        if item and folder:
            listed.append(folder + item.group(1))
        elif not line.startswith("      "):
            folder = None if not line.startswith("    ") or re.match(r"^    \w", line) else folder
    assert len(listed) >= 25, listed
    missing = [p for p in listed if not (REPO / p).is_file()]
    assert not missing, f"README.md's How it works names modules that do not exist: {missing}"
