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
import importlib.util
import os
import pkgutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, List, Optional, Sequence, Tuple, Type, Union

import libcst as cst

from kvpatch.names import RULES_PATH_ENV
from kvpatch.sites import HOT, UNSUPPORTED


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
    status: str = HOT
    why: str = ""
    # With every rule loaded, a rule that runs earlier (lower PRIORITY) decides this site
    # first: its ID. The example then holds for this rule alone, and with all rules the
    # named rule must rewrite the site (its own examples pin the text).
    preempted_by: str = ""


Example = Union[Valid, Invalid]


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


Edit = Union[ReplaceNode, InsertStatement, NeedRuntime]


@dataclass
class Decision:
    status: str
    reason: str
    edits: List[Edit] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def fixable(self) -> bool:
        return any(isinstance(e, (ReplaceNode, InsertStatement)) for e in self.edits)


@dataclass
class Patched:
    """A rule recognised its own rewrite: `call` is the runtime call it emitted,
    `buffer` the pool it reads (no longer an uncast pool), `dtype` the target."""

    call: cst.Call
    buffer: cst.BaseExpression
    dtype: Optional[cst.BaseExpression]
    reason: str


def emitted_call(call: cst.Call, method: str, dtype_arg: int) -> Optional[Patched]:
    """``call`` as a rule's own rewrite when it is ``<alias>.METHOD(pool, ...)`` with the dtype as
    argument ``dtype_arg``: what a rule's ``patched()`` returns for the runtime call it emits."""
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value == method and len(call.args) > max(dtype_arg, 2):
        return Patched(call, call.args[0].value, call.args[dtype_arg].value,
                       f"kvpatch's page-gathered cast ({method}) is in place")
    return None


def refuse_unless_plain_cast(cand, ctx) -> Optional["Decision"]:
    """An UNSUPPORTED Decision unless the candidate is a simple ``.to(dtype)`` cast at its unit's own
    scope (the only form the page-gathering rewrites handle); None when it is."""
    if cand.form.kind != "to" or not cand.form.simple:
        return Decision(UNSUPPORTED, f"`{ctx.code(cand.call)}`: only `.to(dtype)` casts are rewritten")
    nested = ctx.in_nested_scope(cand.call)
    if nested:
        return Decision(UNSUPPORTED, f"the cast sits inside {nested}")
    return None


@dataclass
class Upstream:
    """A rule recognised an upstream fix: a pool getter `call` that reaches the
    kernel uncast, which `kernel` names."""

    call: cst.Call
    kernel: str
    reason: str


class Rule:
    """The plugin contract. A rule file under rules/ defines one subclass.

    The engine names no rule: it asks every loaded rule, in PRIORITY order,
    - ``patched(call, ctx)``: is this call the rule's own rewrite? (a Patched)
    - ``decide(candidate, ctx)``: a Decision for a candidate of its KIND, or None;
    - ``fixed_upstream(getter_call, ctx)``: for a pool read no cast touched, is
      this an upstream fix the rule knows? (an Upstream)
    A rule with ``FALLBACK = True`` decides what no other rule claimed; it is
    never selected by ID; ``--rules`` subsets choose who rewrites, not verdicts.
    ``PAIRS_WITH`` names a rule (or a tuple of rules, any one of which will do) whose
    rewrite (or patched form) must be in the same file for this rule's rewrites to
    apply; ``NEEDS_ALL`` names a rule
    every finding of which in the file must be rewritable or patched.
    ``EMITS`` lists the runtime functions the rule's rewrites call.
    """

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
    PAIRS_WITH: ClassVar[Union[None, str, Tuple[str, ...]]] = None
    # Rewrite only where every finding of this rule in the same file is rewritten
    # or patched: a gathered cast is right only if every call that tells the
    # kernel its rows also tells the runtime.
    NEEDS_ALL: ClassVar[Optional[str]] = None
    FALLBACK: ClassVar[bool] = False
    EMITS: ClassVar[Tuple[str, ...]] = ()
    # The rule's rewrite deletes the site's statement: nothing of it is left to audit as patched.
    REMOVES: ClassVar[bool] = False
    enabled: bool = True  # False: selected out by --rules; decides, never rewrites

    def patched(self, call: cst.Call, ctx) -> Optional[Patched]:
        return None

    def fixed_upstream(self, call: cst.Call, ctx) -> Optional[Upstream]:
        return None

    def decide(self, target, ctx) -> Optional[Decision]:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def fixes(self) -> bool:
        return any(ex.expected is not None for ex in self.INVALID)


def partners(rule) -> Tuple[str, ...]:
    """The IDs a rule's PAIRS_WITH names: one, several (any of which pairs), or none."""
    p = getattr(rule, "PAIRS_WITH", None)
    if not p:
        return ()
    return (p,) if isinstance(p, str) else tuple(p)


# Extra rule folders (os.pathsep-separated), loaded after rules/: a rule
# family can live outside this repository with no edit to kvpatch/.


def _rule_classes(mod) -> List[Type[Rule]]:
    return [obj for obj in vars(mod).values()
            if isinstance(obj, type) and issubclass(obj, Rule) and obj is not Rule
            and obj.__module__ == mod.__name__ and getattr(obj, "ID", None)]


# The built-in rules: rules/ at the top of the repository, installed as this
# package (pyproject's package-dir; an editable install maps it the same way).
BUILTIN_RULES = "kvpatch.rules"


def _builtin_package():
    """kvpatch.rules: inside the package where kvpatch is installed (a wheel,
    `pip install .`); where kvpatch is imported from a source tree (a clone, an
    editable install, `python -m pytest` in a clone with or without another kvpatch
    installed), that tree's own rules/ folder, so the rules always come from the
    same tree as the engine."""
    pkg = sys.modules.get(BUILTIN_RULES)
    if pkg is not None:
        return pkg
    here = Path(__file__).resolve().parent
    source = here.parent / "rules"
    if (here / "rules").is_dir() or not (source / "__init__.py").is_file():
        return importlib.import_module(BUILTIN_RULES)
    spec = importlib.util.spec_from_file_location(BUILTIN_RULES, source / "__init__.py",
                                                  submodule_search_locations=[str(source)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[BUILTIN_RULES] = pkg
    spec.loader.exec_module(pkg)
    return pkg


def _modules() -> List[object]:
    pkg = _builtin_package()
    mods = [importlib.import_module(f"{pkg.__name__}.{info.name}")
            for info in pkgutil.iter_modules(pkg.__path__) if not info.name.startswith("_")]
    listed = filter(None, os.environ.get(RULES_PATH_ENV, "").split(os.pathsep))
    for folder in dict.fromkeys(str(Path(f).resolve()) for f in listed):  # a folder named twice loads once
        for path in sorted(Path(folder).glob("*.py")):
            if path.name.startswith("_"):
                continue
            name = f"kvpatch_extra_rules.p{abs(hash(str(path.resolve())))}"
            mod = sys.modules.get(name)
            if mod is None:
                spec = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[name] = mod
                spec.loader.exec_module(mod)
            mods.append(mod)
    return mods


def load_rules(select: Optional[Sequence[str]] = None) -> List[Rule]:
    """Every Rule subclass in rules/ (and $KVPATCH_RULES_PATH), by priority.

    `select` names (by ID or NAME) the rules that may rewrite; every rule
    still decides, so a subset never changes a verdict, only what ``apply``
    touches and which rule rewrites (the others are returned with ``enabled =
    False``; a site one of them would rewrite goes to a later selected rule that
    rewrites it too, as KVP103 does the FA3 calls KVP106 would route). An unknown
    name raises KeyError naming the known ones.
    """
    found: List[Type[Rule]] = [c for m in _modules() for c in _rule_classes(m)]
    rules = sorted((cls() for cls in found), key=lambda r: (r.PRIORITY, r.ID))
    ids = [r.ID for r in rules]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"two rules share the id {', '.join(dup)}")
    if select:
        wanted = {s.strip() for s in select if s.strip()}
        known = {r.ID for r in rules} | {r.NAME for r in rules}
        unknown = sorted(wanted - known)
        if unknown:
            raise KeyError(
                f"unknown rule {', '.join(unknown)}; known: "
                + ", ".join(f"{r.ID} ({r.NAME})" for r in rules)
            )
        for r in rules:
            r.enabled = r.ID in wanted or r.NAME in wanted
    return rules
