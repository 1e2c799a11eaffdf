"""apply analyses each file once, and the rewrite itself says where each site went.

The scan's workers make the rewrite from the analysis they already hold
(scan_tree's `plan` hook), so the rewrite's records are the scan's own objects,
and each rewritten site's new line and statement are followed through the
transform instead of being matched back by qualname or line.
"""

from __future__ import annotations

import hashlib
from collections import Counter

from kvpatch import engine, patch
from kvpatch.rule import load_rules
from kvpatch.sites import PATCHED, PLAN_PATCHED

from conftest import FI_MLA


def test_apply_analyses_each_original_once(example, monkeypatch):
    seen = Counter()
    real = engine._analyze_source

    def counting(rel, data, rules):
        seen[(rel, hashlib.sha256(data).hexdigest())] += 1
        return real(rel, data, rules)

    monkeypatch.setattr(engine, "_analyze_source", counting)
    p = patch.build(example)
    assert p.rewrites, "the example tree has sites to rewrite"
    for rw in p.rewrites:
        original = hashlib.sha256((example / rw.rel).read_bytes()).hexdigest()
        assert seen[(rw.rel, original)] == 1, f"{rw.rel} analysed {seen[(rw.rel, original)]} times"
        # The rewritten text is analysed once too: the check that it re-audits as patched.
        assert seen[(rw.rel, hashlib.sha256(rw.new_bytes).hexdigest())] == 1
    # The rewrite holds the scan's own records, not look-alikes from a second analysis.
    scanned = {id(r) for f in p.scan.files for r in f.sites + f.plans}
    for rw in p.rewrites:
        assert rw.sites or rw.plans
        assert all(id(r) in scanned for r in rw.sites + rw.plans)
        assert [d.record for d in rw.done] == rw.sites + rw.plans


def _lines(statement: str) -> tuple:
    """A statement up to the indentation of its lines: the transform renders a
    builder's continuation lines at their column in the file, a parse renders them
    relative to the block; status compares them the same way."""
    return tuple(ln.strip() for ln in statement.splitlines())


def test_records_say_where_each_rewrite_went(example):
    """Each record's line and statement equal what a fresh audit of the new text
    finds for the patched sites and plan calls, one to one."""
    rules = load_rules()
    p = patch.build(example)
    assert any(rw.rel == FI_MLA for rw in p.rewrites)
    for rw in p.rewrites:
        again = engine.analyze_source(rw.rel, rw.new_bytes, rules)
        found = sorted((r.line, _lines(r.statement)) for r in again.sites + again.plans
                       if r.status in (PATCHED, PLAN_PATCHED))
        ours = sorted((d.line, _lines(d.statement)) for d in rw.done)
        assert ours == found, rw.rel
        lines = rw.new_text.splitlines()
        for d in rw.done:
            assert lines[d.line - 1].strip() in d.statement
            assert d.statement != d.record.statement  # it was rewritten


def test_state_records_the_new_places(example_git):
    from kvpatch.checkout.state import load

    res = patch.apply(example_git)
    assert res.commit
    st = load(example_git)
    recs = [(f.path, s) for f in st.files for s in f.sites]
    assert recs and {s.kind for _, s in recs} == {"cast", "plan"}
    for path, s in recs:
        lines = (example_git / path).read_text().splitlines()
        assert lines[s.line - 1].strip() in s.rewritten
        assert s.original != s.rewritten
