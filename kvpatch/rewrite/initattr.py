"""initattr: keep something the model runner knows on the instance, for a method.

SGLang's attention backends and their plan updaters get the model runner only
in `__init__`. A rewrite in another method that needs what the runner knows
(its KV-cache dtype) has `__init__` keep it first:
`self.<attr> = getattr(<runner>, "<name>", None)`. The statement goes after the
last top-level assignment of an attribute the rewritten call reads (next to
the attributes it belongs with), else at the end of `__init__`, and is skipped
where `__init__` already assigns the attribute.
"""

from __future__ import annotations

from typing import Iterable, Optional, Set, Union

import libcst as cst

from kvpatch.analysis.locate import ClassFacts
from kvpatch.analysis.match import UnitContext
from kvpatch.names import MODEL_RUNNER_CLASS, MODEL_RUNNER_PARAM
from kvpatch.rule import InsertStatement


def runner_param(facts: Optional[ClassFacts]) -> Optional[str]:
    """The `__init__` parameter holding the model runner: `model_runner`, or one
    annotated as a ModelRunner; None when there is none."""
    if facts is None or facts.init is None:
        return None
    if MODEL_RUNNER_PARAM in facts.init_params:
        return MODEL_RUNNER_PARAM
    for name, ann in facts.init_annotations.items():
        if MODEL_RUNNER_CLASS in ann:
            return name
    return None


def _self_attrs(nodes: Iterable[cst.BaseExpression], self_name: str) -> Set[str]:
    """The attributes of `self_name` that nodes read directly (`self.<attr>`)."""
    return {n.attr.value for n in nodes if isinstance(n, cst.Attribute)
            and isinstance(n.value, cst.Name) and n.value.value == self_name}


def last_assignment(init: cst.FunctionDef, self_name: str, attrs: Set[str]) -> Optional[cst.CSTNode]:
    """The last top-level `self.<attr> = ...` of __init__ for an attr in `attrs`;
    None: there is none (append at the end)."""
    anchor = None
    body = init.body.body if isinstance(init.body, cst.IndentedBlock) else ()
    for stmt in body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, (cst.Assign, cst.AnnAssign)):
                    targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
                    for t in targets:
                        if isinstance(t, cst.Attribute) and isinstance(t.value, cst.Name) \
                                and t.value.value == self_name and t.attr.value in attrs:
                            anchor = stmt
    return anchor


def keep_runner_attr(ctx: UnitContext, attr: str, name: str, what: str,
                     reads: Iterable[cst.BaseExpression]) -> Union[InsertStatement, str]:
    """The edit that has the enclosing class's `__init__` keep `getattr(<runner>,
    name, None)` as `self.<attr>` (placed after the assignments of the attributes
    `reads` take from self), or why it cannot (`what` names the value in that line)."""
    facts = ctx.class_facts
    runner = runner_param(facts)
    if not ctx.unit.first_param or runner is None:
        cls = ctx.unit.class_qualname or "the enclosing scope"
        return f"{what} is not reachable (`{cls}.__init__` has no {MODEL_RUNNER_PARAM} parameter)"
    init = ctx.file.units.get(facts.init.qualname)
    if init is None:
        return f"`{facts.init.qualname}` could not be parsed on its own"
    init_self = facts.init.first_param or "self"
    anchor = last_assignment(init.func, init_self, _self_attrs(reads, init_self))
    return InsertStatement(facts.init.qualname, anchor, f'{init_self}.{attr} = getattr({runner}, "{name}", None)',
                           unless_assigned=attr)
