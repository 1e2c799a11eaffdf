"""rule: what a rule is, what it returns, and how rules are found.

In the style of Fixit 2: a rule is a class in its own file under ``rules/``
that carries its metadata, its ``VALID`` / ``INVALID`` examples (the test
suite runs all of them) and the decision it makes for one candidate. The
engine finds the candidates (casts of a KV buffer, MLA ``plan()`` calls) and
asks the rules, most specific first; a rule answers with a ``Decision`` or
``None`` (not mine).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, ClassVar, List, Optional, Sequence, Tuple, Type

import libcst as cst


@dataclass(frozen=True)
class Valid:
    """Code the rule must neither report as needing action nor change."""

    code: str
    why: str = ""


@dataclass(frozen=True)
class Invalid:
    """Code the rule must report with `status`; `expected` is the exact result
    of ``apply`` (None: the rule reports but does not rewrite)."""

    code: str
    expected: Optional[str] = None
    status: str = "hot"
    why: str = ""


# -- edits a decision asks for ------------------------------------------------
@dataclass
class ReplaceNode:
    """Replace `node` of unit `unit` by build(updated_node)."""

    unit: str
    node: cst.CSTNode
    build: Callable[[cst.CSTNode], cst.CSTNode]


@dataclass
class InsertStatement:
    """Insert `code` (one statement line, unindented) into the body of unit
    `unit`'s function, after the top-level statement `after` (None: at the end).
    Skipped when `unless_assigned` is already assigned there."""

    unit: str
    after: Optional[cst.CSTNode]
    code: str
    unless_assigned: str = ""


@dataclass
class NeedRuntime:
    """The file imports the runtime; the runtime file sits next to it."""


Edit = object  # ReplaceNode | InsertStatement | NeedRuntime


@dataclass
class Decision:
    status: str
    reason: str
    edits: List[Edit] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def fixable(self) -> bool:
        return any(isinstance(e, (ReplaceNode, InsertStatement)) for e in self.edits)


class Rule:
    ID: ClassVar[str]
    NAME: ClassVar[str]
    SUMMARY: ClassVar[str]
    KIND: ClassVar[str]  # "cast" or "plan"
    PRIORITY: ClassVar[int] = 50  # lower runs first
    # SGLang versions the rule was checked on (commit dates of real checkouts).
    CHECKED_ON: ClassVar[Tuple[str, ...]] = ()
    VALID: ClassVar[Sequence[Valid]] = ()
    INVALID: ClassVar[Sequence[Invalid]] = ()
    # Rewrite only in a file where this rule rewrites or has patched a site too
    # (a plan retargeted for a kernel input nobody changed would mismatch it).
    PAIRS_WITH: ClassVar[Optional[str]] = None

    def decide(self, target, ctx) -> Optional[Decision]:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def fixes(self) -> bool:
        return any(ex.expected is not None for ex in self.INVALID)


def load_rules(select: Optional[Sequence[str]] = None) -> List[Rule]:
    """Every Rule subclass in kvpatch.rules, ordered by priority.

    `select` keeps the rules whose ID or NAME is listed; an unknown name
    raises KeyError naming the known ones.
    """
    import kvpatch.rules as pkg

    found: List[Type[Rule]] = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"kvpatch.rules.{info.name}")
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, Rule) and obj is not Rule \
                    and obj.__module__ == mod.__name__ and getattr(obj, "ID", None):
                found.append(obj)
    rules = sorted((cls() for cls in found), key=lambda r: (r.PRIORITY, r.ID))
    if select:
        wanted = {s.strip() for s in select if s.strip()}
        known = {r.ID for r in rules} | {r.NAME for r in rules}
        unknown = sorted(wanted - known)
        if unknown:
            raise KeyError(
                f"unknown rule {', '.join(unknown)}; known: "
                + ", ".join(f"{r.ID} ({r.NAME})" for r in rules)
            )
        rules = [r for r in rules if r.ID in wanted or r.NAME in wanted]
    return rules
