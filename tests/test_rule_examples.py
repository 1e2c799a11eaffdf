"""Every rule's VALID and INVALID examples (Fixit style): a new rule is one
new file under rules/, and its examples are tested here without a line of
test code of its own (kvpatch.ruletest, which `kvpatch test` runs too)."""

from __future__ import annotations

import pytest

from kvpatch import ruletest
from kvpatch.rule import load_rules

RULES = load_rules()


def test_every_rule_has_examples():
    for rule in RULES:
        assert ruletest.missing_metadata(rule) is None, ruletest.missing_metadata(rule)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in ruletest.cases(RULES)])
def test_example(case):
    why = ruletest.check(case, RULES)
    assert why is None, f"{case.rule.ID} {case.kind} example {case.index}: {why}"
