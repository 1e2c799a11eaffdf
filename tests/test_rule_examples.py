"""Every rule's VALID and INVALID examples (Fixit style): a new rule is one
new file under rules/, and its examples are tested here without a line of
test code of its own."""

from __future__ import annotations

import textwrap

import pytest

from kvpatch.engine import analyze_source
from kvpatch.rewrite import plan_rewrite
from kvpatch.rule import load_rules
from kvpatch.sites import NEEDS_ACTION, PATCHED, PLAN_PATCHED, PLAN_REWRITE

RULES = load_rules()
REL = "python/sglang/srt/layers/attention/example_backend.py"


def _cases(kind):
    for rule in RULES:
        for i, ex in enumerate(getattr(rule, kind)):
            yield pytest.param(rule, ex, id=f"{rule.ID}-{kind.lower()}-{i}")


def _analyze(code: str, rules=RULES):
    return analyze_source(REL, textwrap.dedent(code).encode(), rules)


def _alone(rule):
    """The rule by itself (with the rules it pairs with or needs, without
    which it never rewrites)."""
    return [r for r in RULES if r.ID in (rule.ID, rule.PAIRS_WITH, rule.NEEDS_ALL)]


def _decided_by(fa, rule):
    return [r for r in fa.sites + fa.plans if r.rule == rule.ID]


def test_every_rule_has_examples():
    for rule in RULES:
        assert rule.INVALID, f"{rule.ID} has no INVALID example"
        assert rule.VALID, f"{rule.ID} has no VALID example"
        assert rule.ID and rule.NAME and rule.SUMMARY and rule.CHECKED_ON


ALONE = pytest.mark.parametrize("alone", [False, True], ids=["all-rules", "alone"])


@ALONE
@pytest.mark.parametrize("rule,ex", list(_cases("VALID")))
def test_valid(rule, ex, alone):
    rules = _alone(rule) if alone else RULES
    compile(textwrap.dedent(ex.code), "<valid>", "exec")
    fa = _analyze(ex.code, rules)
    assert not fa.errors, fa.errors
    bad = [r for r in _decided_by(fa, rule) if r.status in NEEDS_ACTION + (PLAN_REWRITE,) or r.fixable]
    assert not bad, f"{rule.ID} must not act on VALID example ({ex.why}): {bad}"
    assert plan_rewrite(fa, rules) is None


@ALONE
@pytest.mark.parametrize("rule,ex", list(_cases("INVALID")))
def test_invalid(rule, ex, alone):
    rules = _alone(rule) if alone else RULES
    compile(textwrap.dedent(ex.code), "<invalid>", "exec")
    fa = _analyze(ex.code, rules)
    assert not fa.errors, fa.errors
    mine = _decided_by(fa, rule)
    assert any(r.status == ex.status for r in mine), \
        f"{rule.ID} should report status {ex.status!r} ({ex.why}); got {[(r.status, r.reason) for r in mine]}"
    rw = plan_rewrite(fa, rules)
    if ex.expected is None:
        assert not any(r.fixable for r in mine), "a report-only example must not be rewritten"
        return
    assert rw is not None, "expected a rewrite"
    assert rw.new_text == textwrap.dedent(ex.expected)
    again = analyze_source(REL, rw.new_bytes, rules)
    assert plan_rewrite(again, rules) is None, "a second apply must change nothing"
    patched = [r for r in _decided_by(again, rule) + [s for s in again.sites if s.status == PATCHED]
               if r.status in (PATCHED, PLAN_PATCHED)]
    assert patched, "the rewritten example must audit as patched"
