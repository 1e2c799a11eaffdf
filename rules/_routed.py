"""What the rules that route a kernel call through the runtime share (KVP106 for FA3's
keyword calls, KVP108 for sgl-kernel's positional paged MLA decode): both hand the pool on
as stored through one runtime function, spelled here once, refuse a cast a closure reads,
and make the same edits. A module of rules/ whose name starts with `_` is no rule (the
loader skips it), so both may import it."""

from __future__ import annotations

from typing import List

import libcst as cst

from kvpatch.analysis.candidates import CastCandidate
from kvpatch.analysis.match import UnitContext
from kvpatch.analysis.pagedcall import walk
from kvpatch.analysis.stable import nested_scopes
from kvpatch.rewrite.codegen import RUNTIME_ALIAS, cast_builder, route_call_builder
from kvpatch.rule import NeedRuntime, ReplaceNode

# The cast's runtime function: the pool as stored (KVPATCH_MODE=off: the whole cast); the
# routed call decides what to cast.
ROUTED_CAST_FN = "kv_for_routed_kernel"


def read_by_a_closure(cand: CastCandidate, ctx: UnitContext) -> bool:
    """Whether a nested function reads a name the cast flows through. The data flow follows
    no value into a nested function: a closure (context parallel) would get the FP8 pool as
    stored, so the routing rules leave such a cast to KVP103, which casts for it."""
    names = {n for c in cand.consumers for n in c.via}
    return any(isinstance(n, cst.Name) and n.value in names for scope in nested_scopes(ctx) for n in walk(scope))


def routed_edits(cand: CastCandidate, ctx: UnitContext, emits: tuple, calls: List[cst.Call]) -> list:
    """The cast becomes emits[0] (the pool as stored), each call emits[1](kernel, its own
    arguments), and the runtime is injected."""
    edits = [ReplaceNode(ctx.unit.qualname, cand.call, cast_builder(cand, ctx, f"{RUNTIME_ALIAS}.{emits[0]}"))]
    edits += [ReplaceNode(ctx.unit.qualname, call, route_call_builder(f"{RUNTIME_ALIAS}.{emits[1]}"))
              for call in calls]
    return edits + [NeedRuntime()]
