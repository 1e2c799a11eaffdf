"""kvpatch/ and rules/ import each other without a cycle (issue 9), and each layer of
kvpatch imports only the layers below it (issue 19).

The graph is read statically with `ast`: every import in a module counts,
at module level or inside a function (a function-level import only hides a
cycle until the function runs), in the forms `import kvpatch.x`,
`from kvpatch.x import y`, `from kvpatch import x`, `from . import x` and
`from .x import y`. A name imported from a package is an edge to its
submodule when one exists, else to the package itself.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvpatch", "rules")


def _runtime_part(rel: Path) -> bool:
    """kvpatch/runtime/_*.py: the runtime's source parts, joined as text into the module
    apply injects and never imported; their imports of each other only let each read
    alone (tests/test_runtime_parts.py checks the join)."""
    return rel.parts[:2] == ("kvpatch", "runtime") and rel.name.startswith("_") and rel.name != "__init__.py"


def modules(root: Path = ROOT) -> Dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (the runtime parts aside)."""
    out: Dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            if _runtime_part(path.relative_to(root)):
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_package(name: str, mods: Dict[str, Path]) -> bool:
    return mods[name].name == "__init__.py"


def _target(name: str, mods: Dict[str, Path]) -> Optional[str]:
    """The module `name` (or its nearest enclosing module of ours) names, if ours."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, mods: Dict[str, Path]) -> Set[str]:
    """The modules of ours that module `name` imports, anywhere in its body."""
    tree = ast.parse(mods[name].read_text(encoding="utf-8"), str(mods[name]))
    package = name if _is_package(name, mods) else name.rpartition(".")[0]
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                t = _target(alias.name, mods)
                if t:
                    out.add(t)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            for alias in node.names:
                sub = f"{base_name}.{alias.name}"
                t = sub if sub in mods else _target(base_name, mods)
                if t:
                    out.add(t)
    out.discard(name)
    return out


def import_graph(root: Path = ROOT) -> Dict[str, Set[str]]:
    mods = modules(root)
    return {name: imports_of(name, mods) for name in mods}


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {n: WHITE for n in graph}
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        colour[start] = GREY
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                colour[path.pop()] = BLACK
                stack.pop()
            elif colour.get(nxt) == GREY:
                return path[path.index(nxt):] + [nxt]
            elif colour.get(nxt) == WHITE:
                colour[nxt] = GREY
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_rules_stay_plugins():
    """The engine imports no rule, and no rule imports another rule (a rules/_helper
    module of shared examples or logic is not a rule)."""
    graph = import_graph()

    def is_rule(m: str) -> bool:
        return m.startswith("rules.") and not m.rpartition(".")[2].startswith("_")

    engine = sorted((m, t) for m, ts in graph.items() if m.startswith("kvpatch") for t in ts if t.startswith("rules"))
    assert engine == [], engine
    cross = sorted((m, t) for m, ts in graph.items() if is_rule(m) for t in ts if is_rule(t))
    assert cross == [], cross
    assert any(is_rule(m) for m in graph)


def test_graph_sees_every_import_form(tmp_path):
    """The reader itself: each import form gives its edge, a function-level one too,
    and a cycle closed only inside a function is found."""
    pkg = tmp_path / "kvpatch"
    (pkg / "sub").mkdir(parents=True)
    (tmp_path / "rules").mkdir()
    files = {
        "kvpatch/__init__.py": "",
        "kvpatch/a.py": "from kvpatch.b import thing\n",
        "kvpatch/b.py": "def f():\n    from kvpatch import c\n",
        "kvpatch/c.py": "from . import d\nimport kvpatch.sub.e\n",
        "kvpatch/d.py": "from .sub import e\n",
        "kvpatch/sub/__init__.py": "from .e import name\n",
        "kvpatch/sub/e.py": "def g():\n    from ..a import x\n",
        "rules/__init__.py": "",
        "rules/r.py": "from ._helper import X\nfrom kvpatch.sub.e import g\n",
        "rules/_helper.py": "import os\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["kvpatch.a"] == {"kvpatch.b"}
    assert graph["kvpatch.b"] == {"kvpatch.c"}
    assert graph["kvpatch.c"] == {"kvpatch.d", "kvpatch.sub.e"}
    assert graph["kvpatch.d"] == {"kvpatch.sub.e"}
    assert graph["kvpatch.sub"] == {"kvpatch.sub.e"}
    assert graph["kvpatch.sub.e"] == {"kvpatch.a"}
    assert graph["rules.r"] == {"rules._helper", "kvpatch.sub.e"}
    assert graph["rules._helper"] == set()
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"kvpatch.a", "kvpatch.b", "kvpatch.c", "kvpatch.sub.e"} or \
        set(cycle) == {"kvpatch.a", "kvpatch.b", "kvpatch.c", "kvpatch.d", "kvpatch.sub.e"}
    (tmp_path / "kvpatch/sub/e.py").write_text("def g():\n    pass\n")
    assert find_cycle(import_graph(tmp_path)) is None


# -- the layering (issue 19) ---------------------------------------------------------
# Units: a subpackage of kvpatch (its modules import each other freely), a module at the
# top of kvpatch, rules/ (the plugins) and the entry points (every __main__). Top to
# bottom: a unit imports only units of lower layers. A new subpackage or top module gets
# a place here, or test_every_unit_has_a_layer fails.
LAYERS = (
    ("entry points", ("kvpatch.__main__",)),
    ("command line", ("kvpatch.cli",)),
    ("after apply: verify on a GPU, audit an upgrade", ("kvpatch.verify", "kvpatch.upgrade")),
    ("apply", ("kvpatch.patch",)),
    ("revert, status, a rule's examples", ("kvpatch.revert", "kvpatch.status", "kvpatch.ruletest")),
    ("output formats", ("kvpatch.output",)),
    ("the rules (plugins)", ("rules",)),
    ("rewrite", ("kvpatch.rewrite",)),
    ("engine", ("kvpatch.engine",)),
    ("which rule's rewrites stand", ("kvpatch.selection",)),
    ("source analysis", ("kvpatch.analysis",)),
    ("the checkout, settings, the runtime source", ("kvpatch.checkout", "kvpatch.config", "kvpatch.runtime")),
    ("the rule contract", ("kvpatch.rule",)),
    ("the records", ("kvpatch.sites",)),
    ("spellings, version", ("kvpatch.names", "kvpatch")),
)


def unit_of(module: str) -> str:
    """The layering unit a module belongs to."""
    if module.rpartition(".")[2] == "__main__":
        return "kvpatch.__main__"  # an entry point: imported by nothing
    parts = module.split(".")
    if parts[0] == "rules":
        return "rules"
    return ".".join(parts[:2])


def layer_of(unit: str, layers=LAYERS) -> Optional[int]:
    """0 for the top layer; None for a unit no layer lists."""
    return next((i for i, (_, units) in enumerate(layers) if unit in units), None)


def layering_violations(graph: Dict[str, Set[str]], layers=LAYERS) -> List[str]:
    """Every import from a unit to one of the same or a higher layer (another unit)."""
    out = []
    for mod in sorted(graph):
        src = unit_of(mod)
        for target in sorted(graph[mod]):
            dst = unit_of(target)
            if dst == src:
                continue
            a, b = layer_of(src, layers), layer_of(dst, layers)
            if a is None or b is None or b <= a:
                out.append(f"{mod} ({src}) imports {target} ({dst})")
    return out


def test_every_unit_has_a_layer():
    units = {unit_of(m) for m in import_graph()}
    assert sorted(u for u in units if layer_of(u) is None) == []
    listed = [u for _, us in LAYERS for u in us]
    assert len(listed) == len(set(listed)) and set(listed) == units, set(listed) ^ units


def test_each_layer_imports_only_layers_below():
    violations = layering_violations(import_graph())
    assert violations == [], "upward or sideways imports:\n" + "\n".join(violations)


def test_layering_check_catches_an_upward_import(tmp_path):
    """The checker over a synthetic module map: an analysis module importing the CLI, a
    rewrite module importing the output formats (a sideways-up import), and an
    unlisted package are caught; downward imports and imports inside a unit are not."""
    files = {
        "kvpatch/__init__.py": "",
        "kvpatch/names.py": "",
        "kvpatch/engine.py": "from kvpatch.analysis import match\n",
        "kvpatch/analysis/__init__.py": "",
        "kvpatch/analysis/match.py": "from kvpatch.analysis.units import x\nfrom kvpatch import names\n",
        "kvpatch/analysis/units.py": "",
        "kvpatch/cli/__init__.py": "",
        "kvpatch/cli/commands.py": "from kvpatch.engine import scan\n",
        "kvpatch/output/__init__.py": "",
        "kvpatch/output/report.py": "",
        "kvpatch/rewrite/__init__.py": "",
        "kvpatch/rewrite/codegen.py": "from kvpatch.engine import scan\n",
        "rules/__init__.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert layering_violations(import_graph(tmp_path)) == []
    (tmp_path / "kvpatch/analysis/units.py").write_text("def f():\n    from kvpatch.cli import commands\n")
    (tmp_path / "kvpatch/rewrite/codegen.py").write_text("from kvpatch.output.report import render\n")
    (tmp_path / "kvpatch/extra").mkdir()
    (tmp_path / "kvpatch/extra/__init__.py").write_text("")
    (tmp_path / "kvpatch/names.py").write_text("from kvpatch import extra\n")
    assert layering_violations(import_graph(tmp_path)) == [
        "kvpatch.analysis.units (kvpatch.analysis) imports kvpatch.cli.commands (kvpatch.cli)",
        "kvpatch.names (kvpatch.names) imports kvpatch.extra (kvpatch.extra)",
        "kvpatch.rewrite.codegen (kvpatch.rewrite) imports kvpatch.output.report (kvpatch.output)",
    ]
    # the same import, against a layering with the CLI at the bottom: allowed there
    low_cli = tuple((n, us) for n, us in LAYERS if "kvpatch.cli" not in us) + (("cli", ("kvpatch.cli",)),)
    assert not any(v.startswith("kvpatch.analysis.units") for v in layering_violations(import_graph(tmp_path), low_cli))


# -- the layout's size (issue 19) -----------------------------------------------------
MAX_LINES = 400
MAX_TOP_MODULES = 10  # beside __init__.py and __main__.py; the rest lives in the stage folders


def test_modules_stay_short_and_the_top_stays_small():
    long = {p.relative_to(ROOT).as_posix(): n for p in sorted((ROOT / "kvpatch").rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines: split by job (the runtime: one more part)"
    top = sorted(p.name for p in (ROOT / "kvpatch").glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= MAX_TOP_MODULES, f"kvpatch/ holds {len(top)} modules beside its folders: {top}"
