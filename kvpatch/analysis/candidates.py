"""candidates: what the engine hands to the rules.

A ``CastCandidate`` is a cast of a whole KV pool that is not provably a no-op;
a ``PlanCandidate`` is a FlashInfer MLA ``plan()`` call with its dtype,
page-size and causal arguments picked out of either calling convention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import libcst as cst

from kvpatch.analysis.locate import mla_plan_shape
from kvpatch.analysis.match import CastForm, Consumer, Origin, is_attr
from kvpatch.names import PLAN_METHOD

# BatchMLAPagedAttentionWrapper.plan's parameters, in order.
PLAN_PARAMS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads",
               "head_dim_ckv", "head_dim_kpe", "page_size", "causal", "sm_scale",
               "q_data_type", "kv_data_type")
# SGLang's fast_mla_decode_plan / fast_mla_prefill_plan name three of them after
# the host arrays they take; a call through `wrapper.plan = partial(...)` uses
# those keywords.
PLAN_PARAM_ALIASES = {"qo_indptr_cpu": "qo_indptr", "kv_indptr_cpu": "kv_indptr",
                      "kv_len_arr_cpu": "kv_len_arr"}


@dataclass
class CastCandidate:
    call: cst.Call  # the cast, e.g. X.to(q.dtype)
    receiver: cst.BaseExpression  # X
    form: CastForm
    origin: Origin
    consumers: List[Consumer]
    guard_note: str = ""  # why an earlier q cast did not make it a no-op


@dataclass
class PlanCandidate:
    call: cst.Call
    receiver: Optional[cst.BaseExpression]  # the wrapper (None for a plain function)
    form: str  # positional | keyword | function
    args: dict = field(default_factory=dict)  # param name -> cst.Arg

    def arg(self, name: str) -> Optional[cst.Arg]:
        return self.args.get(name)

    @property
    def wrapper(self) -> Optional[cst.BaseExpression]:
        """The wrapper the plan configures: the receiver of `wrapper.plan(...)`, the
        first positional argument of a plan function (None: it has none)."""
        if self.form != "function":
            return self.receiver
        pos = [a for a in self.call.args if a.keyword is None and not a.star]
        return pos[0].value if pos else None


def bind_plan_args(call: cst.Call, skip_first: bool = False) -> Optional[dict]:
    """Map plan()'s parameters to the call's arguments; None on *args/**kw."""
    pos = [a for a in call.args if a.keyword is None]
    if any(a.star for a in call.args):
        return None
    if skip_first:
        pos = pos[1:]
    out = {}
    for name, a in zip(PLAN_PARAMS, pos):
        out[name] = a
    for a in call.args:
        if a.keyword is not None:
            out[PLAN_PARAM_ALIASES.get(a.keyword.value, a.keyword.value)] = a
    return out


class _Calls(cst.CSTVisitor):
    def __init__(self) -> None:
        self.calls: List[cst.Call] = []

    def visit_Call(self, node: cst.Call) -> None:
        self.calls.append(node)


def calls_in(node: cst.CSTNode) -> List[cst.Call]:
    """Every call under `node`, in the order libcst visits them: where candidates come from."""
    v = _Calls()
    node.visit(v)
    return v.calls


def is_mla_plan(call: cst.Call) -> bool:
    """`X.plan(...)` with the arguments of a FlashInfer MLA wrapper's plan (locate.mla_plan_shape)."""
    if not is_attr(call.func, (PLAN_METHOD,)):
        return False
    return mla_plan_shape({a.keyword.value for a in call.args if a.keyword is not None},
                          sum(1 for a in call.args if a.keyword is None and not a.star),
                          any(a.star for a in call.args))
