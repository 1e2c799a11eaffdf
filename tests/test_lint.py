"""pyflakes reports nothing on the project's own code (unused imports and names, undefined names).

tests/data is left out: its files are hand-written SGLang-shaped fixtures whose imports are part of
what kvpatch reads, not code of ours. A name kept on purpose as a re-export goes in the module's
``__all__`` (pyflakes does not honour ``# noqa``).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api", reason="pyflakes is in the test extra: pip install -e .[test]")
from pyflakes.reporter import Reporter  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DIRS = ("kvpatch", "rules", "tests", "benchmarks", "gpu", "tools")
SKIP = (REPO / "tests" / "data",)
# Findings kept on purpose, each exactly: (file, message). The runtime probes whether Triton
# loads by importing it; the runtime is copied into checkouts as it is and was verified on the
# GPU byte for byte, so it keeps its plain import rather than a rewrite for the linter.
ALLOWED = {("kvpatch/runtime/_modes.py", "'triton' imported but unused"),
           # _modes is the head of the joined runtime: it imports the stdlib modules of every part.
           ("kvpatch/runtime/_modes.py", "'math' imported but unused")}


def _sources():
    for name in DIRS:
        for path in sorted((REPO / name).rglob("*.py")):
            if not any(path.is_relative_to(s) for s in SKIP):
                yield path


def test_pyflakes_reports_nothing():
    out, err = io.StringIO(), io.StringIO()
    reporter = Reporter(out, err)
    files = list(_sources())
    assert len(files) > 50, "the package dirs were not found"
    found = sum(pyflakes_api.checkPath(str(p), reporter) for p in files)
    text = (out.getvalue() + err.getvalue()).replace(str(REPO) + "/", "")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    left = [ln for ln in lines if not any(ln.startswith(f + ":") and ln.endswith(m) for f, m in ALLOWED)]
    assert found == len(lines) and not left, "pyflakes findings:\n" + "\n".join(left)
    # Each allowance still matches a finding: one that no longer does is removed, not kept.
    for f, m in ALLOWED:
        assert any(ln.startswith(f + ":") and ln.endswith(m) for ln in lines), f"stale allowance {f}: {m}"
