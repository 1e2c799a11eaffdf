"""ruletest: run a rule's own VALID / INVALID examples (as `fixit test`,
`ast-grep test`, `semgrep --test`), for `kvpatch test` and the test suite.

Each example is checked with every loaded rule and with the rule alone (plus
the rules it pairs with or needs, without which it never rewrites). A check
returns None when the example holds, else one line saying what went wrong.
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

from kvpatch.engine import FileAnalysis, analyze_source
from kvpatch.rewrite.transform import plan_rewrite
from kvpatch.rule import Example, Rule, partners
from kvpatch.sites import HOT, NEEDS_ACTION, PATCHED, PLAN_PATCHED, PLAN_REWRITE, Record

REL = "python/sglang/srt/layers/attention/example_backend.py"
VALID, INVALID = "VALID", "INVALID"


@dataclass
class Case:
    rule: Rule
    kind: str  # VALID | INVALID
    index: int
    example: Example
    alone: bool

    @property
    def name(self) -> str:
        return f"{self.rule.ID}-{self.kind.lower()}-{self.index}-{'alone' if self.alone else 'all-rules'}"


def alone(rule: Rule, rules: Sequence[Rule]) -> List[Rule]:
    return [r for r in rules if r.ID in (rule.ID, *partners(rule), rule.NEEDS_ALL)]


def cases(rules: Sequence[Rule], chosen: Optional[Sequence[Rule]] = None) -> Iterator[Case]:
    for rule in chosen if chosen is not None else rules:
        for kind in (VALID, INVALID):
            for i, ex in enumerate(getattr(rule, kind)):
                for solo in (False, True):
                    yield Case(rule, kind, i, ex, solo)


def missing_metadata(rule: Rule) -> Optional[str]:
    if not rule.INVALID:
        return f"{rule.ID} has no INVALID example"
    if not rule.VALID:
        return f"{rule.ID} has no VALID example"
    if not (rule.ID and rule.NAME and rule.SUMMARY and rule.CHECKED_ON):
        return f"{rule.ID}: ID, NAME, SUMMARY and CHECKED_ON must all be set"
    return None


def _decided_by(fa: FileAnalysis, rule: Rule) -> List[Record]:
    return [r for r in fa.sites + fa.plans if r.rule == rule.ID]


def check(case: Case, rules: Sequence[Rule]) -> Optional[str]:
    """None if the example holds, else why not."""
    use = alone(case.rule, rules) if case.alone else list(rules)
    ex, rule = case.example, case.rule
    code = textwrap.dedent(ex.code)
    try:
        compile(code, f"<{case.name}>", "exec")
    except SyntaxError as exc:
        return f"the example does not compile: {exc}"
    fa = analyze_source(REL, code.encode(), use)
    if fa.errors:
        return f"analysis errors: {[e.message for e in fa.errors]}"
    if case.kind == INVALID and ex.preempted_by and not case.alone:
        rule = next((r for r in use if r.ID == ex.preempted_by), None)
        if rule is None:
            return f"preempted_by names {ex.preempted_by!r}, which is not loaded"
        if not _decided_by(fa, rule):
            return f"{ex.preempted_by} should decide this site first, with every rule loaded; it does not"
        ex = dataclasses.replace(ex, expected=None, status=HOT)  # it must rewrite the site
    mine = _decided_by(fa, rule)
    rw = plan_rewrite(fa, use)
    if case.kind == VALID:
        bad = [r for r in mine if r.status in NEEDS_ACTION + (PLAN_REWRITE,) or r.fixable]
        if bad:
            return f"must not act on VALID example ({ex.why}): line {bad[0].line} is {bad[0].status}"
        return "a VALID example must not be rewritten" if rw is not None else None
    if not any(r.status == ex.status for r in mine):
        return f"should report status {ex.status!r} ({ex.why}); got {[(r.status, r.reason) for r in mine]}"
    if ex.expected is None and (case.alone or not ex.preempted_by):
        return "a report-only example must not be rewritten" if any(r.fixable for r in mine) else None
    if rw is None:
        return "expected a rewrite, got none"
    if ex.expected is not None and rw.new_text != textwrap.dedent(ex.expected):
        import difflib

        diff = difflib.unified_diff(textwrap.dedent(ex.expected).splitlines(), rw.new_text.splitlines(),
                                    "expected", "got", lineterm="")
        return "the rewrite differs from the expected code:\n" + "\n".join(diff)
    again = analyze_source(REL, rw.new_bytes, use)
    if plan_rewrite(again, use) is not None:
        return "a second apply must change nothing"
    patched = [r for r in _decided_by(again, rule) + [s for s in again.sites if s.status == PATCHED]
               if r.status in (PATCHED, PLAN_PATCHED)]
    if rule.REMOVES:  # the site's statement is gone: none of its casts may be left
        left = [r for r in _decided_by(again, rule)]
        return f"the deleted site is still there (line {left[0].line})" if left else None
    return None if patched else "the rewritten example must audit as patched"
