"""The runtime source is kept as parts under kvpatch/runtime/, joined into the one
_kvpatch_runtime.py apply injects (issue 19). No torch needed: these read text."""

from __future__ import annotations

import ast
from pathlib import Path

import kvpatch.runtime as R
from kvpatch.names import RUNTIME_VERSION_VAR

RUNTIME_DIR = Path(R.__file__).resolve().parent


def test_parts_are_the_files_in_order():
    files = {p.stem for p in RUNTIME_DIR.glob("_*.py") if p.name != "__init__.py"}
    assert set(R.PARTS) == files, "a part file missing from PARTS, or PARTS naming no file"
    assert R.PARTS[0] == "_modes"  # the head: docstring, imports, version, __all__
    for part in R.PARTS[1:]:
        assert R._FROM in (RUNTIME_DIR / f"{part}.py").read_text(), part


def test_joined_runtime_is_one_self_contained_module():
    text = R.joined()
    tree = ast.parse(text)
    assert ast.get_docstring(tree).startswith("kvpatch runtime:")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("kvpatch"), ast.unparse(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("kvpatch") for a in node.names), ast.unparse(node)
    for marker in (R._FROM, R._UP_TO, "A part of the kvpatch runtime"):
        assert marker not in text
    assert text.count(f"{RUNTIME_VERSION_VAR} = ") == 1
    # every name __all__ promises is defined at the top level of the joined module
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    exported = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))
    assert set(exported) <= defined, set(exported) - defined


def test_a_new_part_is_one_entry(tmp_path, monkeypatch):
    """A part added to PARTS lands in the joined source, after those before it, without
    its docstring and imports."""
    for part in R.PARTS:
        (tmp_path / f"{part}.py").write_text((RUNTIME_DIR / f"{part}.py").read_text())
    (tmp_path / "_fused.py").write_text('"""A part of the kvpatch runtime: fused."""\n\nimport torch\n\n'
                                        f"{R._FROM}\n\ndef fused_attention():\n    return torch\n")
    monkeypatch.setattr(R, "_HERE", tmp_path)
    monkeypatch.setattr(R, "PARTS", R.PARTS[:-1] + ("_fused",) + R.PARTS[-1:])
    R.joined.cache_clear()
    try:
        text = R.joined()
    finally:
        R.joined.cache_clear()
    assert "\n\ndef fused_attention():\n    return torch\n" in text
    assert text.index("def fused_attention") < text.index("def reset")
    assert "A part of the kvpatch runtime: fused" not in text
    ast.parse(text)


def test_runtime_source_is_stamped_and_versioned():
    src = R.runtime_source()
    assert R.runtime_version(src) == R.runtime_version() != "unknown"
    assert R.TEMPLATE.read_text() == R.joined()


def test_the_modes_verify_drives_are_the_runtimes():
    """kvpatch/names.py spells the mode switch and modes for verify; the runtime, which
    imports nothing of kvpatch, spells its own in _modes.py. They must agree."""
    from kvpatch.names import MODE_AUTO, MODE_ENV, MODE_FUSED, MODE_GATHER, MODE_NATIVE

    src = (Path(R.__file__).parent / "_modes.py").read_text(encoding="utf-8")
    tree = ast.parse(src)
    modes = next(ast.literal_eval(n.value) for n in tree.body
                 if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "_MODES" for t in n.targets))
    assert {MODE_AUTO, MODE_FUSED, MODE_GATHER, MODE_NATIVE} <= set(modes)
    assert f'os.environ.get("{MODE_ENV}"' in src


def _runtime_constant(part, name):
    tree = ast.parse((Path(R.__file__).parent / f"{part}.py").read_text(encoding="utf-8"))
    return next(ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == name for t in n.targets))


def test_the_routed_signatures_are_the_analysis_ones():
    """kvpatch/analysis/pagedcall.py binds sgl-kernel's flash_mla_decode by its parameter
    order, and the runtime's paged_mla binds the routed call by its own copy (the runtime
    imports nothing of kvpatch). A parameter moved in one and not the other would hand the
    table to the lengths: they must agree, and the rule must emit the runtime's entry."""
    from kvpatch.analysis.pagedcall import PAGED_KERNELS, ROUTABLE_PAGED_KERNELS
    from kvpatch.rule import load_rules

    assert ROUTABLE_PAGED_KERNELS == ("flash_mla_decode",)
    assert _runtime_constant("_paged_mla", "_PM_PARAMS") == PAGED_KERNELS["flash_mla_decode"]
    emitted = {name for rule in load_rules() for name in getattr(rule, "EMITS", ())}
    assert "paged_mla" in emitted and "paged_mla" in _runtime_constant("_modes", "__all__")
