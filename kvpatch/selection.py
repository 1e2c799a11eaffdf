"""Which rule's rewrites stand in a file: a site a rule left out by --rules would
rewrite goes on to a later selected rule (hand_on); a rule paired with another, or
needing all of another's findings rewritable, keeps its rewrites only with it (pair);
the findings of the rules left out are dropped (select). Called by the engine."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

from kvpatch.rule import Decision, Rule, partners
from kvpatch.sites import HOT, PATCHED, PLAN_IGNORED, PLAN_PATCHED, PLAN_REWRITE, UNSUPPORTED, Site


def hand_on(cast_rules: Sequence[Rule], rule: Optional[Rule], decision: Optional[Decision],
            ask: Callable[[Sequence[Rule]], Tuple[Optional[Rule], Optional[Decision]]]):
    """(rule, decision) for a cast: the first rule's, unless --rules left it out and a
    later, selected rule rewrites the site too (KVP106 would route an FA3 call; KVP103
    gathers the same site's pages). Else the verdict stands, unrewritten (select)."""
    if rule is not None and not rule.enabled and decision.fixable:
        later = [r for r in cast_rules[cast_rules.index(rule) + 1:] if r.enabled]
        alt_rule, alt = ask(later)
        if alt is not None and alt.fixable:
            return alt_rule, alt
    return rule, decision


def select(fa, rules: Sequence[Rule]) -> None:
    """--rules limits what is reported and rewritten, never a verdict: every
    rule decided above; the findings of rules left out are dropped here."""
    off = {r.ID for r in rules if not r.enabled}
    if off:
        for d in fa.decided:
            if d.rule is None or d.decision is None or not d.decision.fixable:
                continue
            pals = partners(d.rule)
            left_out = d.rule.ID if d.rule.ID in off else None
            if pals and all(i in off for i in pals):
                left_out = " / ".join(pals)
            if left_out:  # the verdict stands; nothing is rewritten
                d.decision = Decision(d.decision.status, d.decision.reason, [], d.decision.notes
                                      + [f"not rewritten: {left_out} is not among the selected rules"])
                d.record.fixable = False
                if isinstance(d.record, Site):
                    d.record.notes.append(d.decision.notes[-1])
        fa.sites = [s for s in fa.sites if s.rule not in off]
        fa.plans = [p for p in fa.plans if p.rule not in off]
        fa.decided = [d for d in fa.decided if d.rule is None or d.rule.ID not in off]


def pair(fa) -> None:
    """Drop the rewrites of a rule whose NEEDS_ALL rule cannot rewrite some finding
    in this file, then those of a rule whose partner rule changes nothing here."""
    records = list(fa.sites) + list(fa.plans)
    for d in fa.decided:
        needed = getattr(d.rule, "NEEDS_ALL", None)
        if not needed or d.decision is None or not d.decision.fixable:
            continue
        stuck = [r for r in records if r.rule == needed and not r.fixable
                 and r.status not in (PATCHED, PLAN_PATCHED)]
        if stuck:
            r = stuck[0]
            reason = (f"left as is: {needed} cannot rewrite line {r.line} ({r.reason}), so the runtime "
                      f"would not learn every row the kernel reads")
            d.decision = Decision(UNSUPPORTED, reason)
            d.record.status, d.record.reason, d.record.fixable = UNSUPPORTED, reason, False
    for d in fa.decided:
        pals = partners(d.rule)
        if not pals or d.decision is None or not d.decision.fixable:
            continue
        if any(s.rule in pals and (s.fixable or s.status == PATCHED) for s in fa.sites):
            continue
        partner = " or ".join(pals)
        reason = (f"left as is: no {partner} cast is rewritten or patched in this file, so run() still "
                  f"receives what this plan declares")
        status = PLAN_IGNORED if d.decision.status == PLAN_REWRITE else HOT
        d.decision = Decision(status, reason)
        d.record.status, d.record.reason, d.record.fixable = status, reason, False
