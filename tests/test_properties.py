"""Property-based tests: many spellings of the FlashInfer MLA pool cast.

Hypothesis builds variants of `forward_decode` (receivers, layer arguments,
dtype expressions, line breaks and parentheses, comments inside the call,
one- and two-statement forms with and without a guard, nesting in if/else
and with-blocks, get_key_buffer / get_value_buffer, inline in the run()
call) inside an otherwise valid module, and checks kvpatch against an
independent oracle written with Python's ast:

- every cast the oracle counts (a `.to(` on an expression rooted at a KV
  getter, or on a name bound to one) is a hot site kvpatch finds and rewrites;
- the rewrite compiles, and a second apply changes nothing;
- without a guard, the run() consumer reads the kv_for_kernel result.

The number of variants run is printed (pytest -s) and recorded in
notes/upgrade-audit.md.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from typing import List, Optional, Set

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvpatch.engine import analyze_source  # noqa: E402
from kvpatch.rewrite.transform import plan_rewrite  # noqa: E402
from kvpatch.rule import load_rules  # noqa: E402

RULES = load_rules()
REL = "python/sglang/srt/layers/attention/flashinfer_mla_backend.py"
GETTERS = {"get_key_buffer", "get_value_buffer"}
MAX_EXAMPLES = int(os.environ.get("KVPATCH_PROPERTY_EXAMPLES", "300"))  # more: a longer hunt

HEADER = '''\
from __future__ import annotations

import torch
from flashinfer import BatchMLAPagedAttentionWrapper


def get_token_to_kv_pool():
    return None


class FlashInferMLAAttnBackend:
    def __init__(self, model_runner):
        self.data_type = model_runner.dtype
        self.layer_index = 0
        self.use_mla = model_runner.use_mla
{init_extra}
    def forward_decode(self, q, q_rope, layer, forward_batch, q_nope=None, layer_id=0, token_to_kv_pool=None):
        decode_wrapper = self.forward_metadata.decode_wrapper
'''


@dataclass
class Variant:
    source: str
    shape: tuple  # the choices that made it
    guarded: bool


RECEIVERS = {
    "forward_batch": ("forward_batch.token_to_kv_pool", []),
    "self": ("self.token_to_kv_pool", []),
    "getter_fn": ("get_token_to_kv_pool()", []),
    "alias": ("pool", ["pool = self.token_to_kv_pool"]),
    "param": ("token_to_kv_pool", []),
    "alias_of_param": ("kv_pool", ["kv_pool = token_to_kv_pool"]),
}
LAYERS = ["layer.layer_id", "layer_id", "self.layer_index", "int(layer.layer_id)"]
DTYPES = {"q": ("q.dtype", []), "q_nope": ("q_nope.dtype", []), "self": ("self.data_type", []),
          "alias": ("dtype", ["dtype = q.dtype"]), "alias_self": ("target_dtype", ["target_dtype = self.data_type"])}
LAYOUTS = ["one-line", "break-getter", "break-to", "parens", "comment", "comment-getter"]
FORMS = ["assign", "two-statement", "two-statement-guarded", "inline-run"]
NESTING = ["none", "if", "if-else", "else-only", "with", "if-in-with", "with-in-else"]


def cast_expr(recv: str, getter: str, layer: str, dtype: str, layout: str, ind: str) -> str:
    """The cast, laid out at statement indentation `ind` (continuation lines deeper)."""
    i1 = ind + "    "
    pool = f"{recv}.{getter}({layer})"
    if layout == "one-line":
        return f"{pool}.to({dtype})"
    if layout == "break-getter":
        return f"{recv}.{getter}(\n{i1}{layer}\n{ind}).to({dtype})"
    if layout == "break-to":
        return f"{pool}.to(\n{i1}{dtype}\n{ind})"
    if layout == "parens":
        return f"(\n{i1}{pool}\n{i1}.to({dtype})\n{ind})"
    if layout == "comment":
        return f"{pool}.to(\n{i1}{dtype}  # fp8 -> bf16\n{ind})"
    return f"{recv}.{getter}(  # the layer's pool\n{i1}{layer}\n{ind}).to({dtype})"  # comment-getter


@st.composite
def variants(draw) -> Variant:
    rk = draw(st.sampled_from(sorted(RECEIVERS)))
    getter = draw(st.sampled_from(sorted(GETTERS)))
    layer = draw(st.sampled_from(LAYERS))
    dk = draw(st.sampled_from(sorted(DTYPES)))
    layout = draw(st.sampled_from(LAYOUTS))
    form = draw(st.sampled_from(FORMS))
    nesting = draw(st.sampled_from(NESTING))
    kv_indptr = draw(st.booleans())
    trailing = draw(st.booleans())
    recv, recv_pre = RECEIVERS[rk]
    dtype, dtype_pre = DTYPES[dk]
    if form == "inline-run":
        nesting = nesting if nesting in ("none", "with") else "none"

    def cast_block(ind: str) -> List[str]:
        tail = "  # cast for the kernel" if trailing else ""
        if form == "assign":
            return [f"{ind}k_buffer = {cast_expr(recv, getter, layer, dtype, layout, ind)}{tail}"]
        if form == "inline-run":
            return []
        pool_line = f"{ind}k_buffer = {recv}.{getter}({layer})"
        if layout in ("break-getter", "comment-getter"):
            pool_line = f"{ind}k_buffer = {recv}.{getter}(\n{ind}    {layer}\n{ind})"
        cast = f"k_buffer.to({dtype})" if layout != "comment" else f"k_buffer.to(\n{ind}    {dtype}  # fp8\n{ind})"
        if form == "two-statement":
            return [pool_line, f"{ind}k_buffer = {cast}{tail}"]
        cast = cast.replace(f"\n{ind}", f"\n{ind}    ")
        return [pool_line, f"{ind}if k_buffer.dtype != {dtype}:", f"{ind}    k_buffer = {cast}{tail}"]

    def run_line(ind: str) -> List[str]:
        if form != "inline-run":
            return [f"{ind}o = decode_wrapper.run(q_nope, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:])"]
        a = cast_expr(recv, getter, layer, dtype, layout, ind + "    ")
        return [f"{ind}o = decode_wrapper.run(", f"{ind}    q_nope,", f"{ind}    q_rope,",
                f"{ind}    {a}[:, :, :512],", f"{ind}    {a}[:, :, 512:],", f"{ind})"]

    ind = " " * 8
    body: List[str] = [ind + x for x in recv_pre + dtype_pre]
    if nesting == "none":
        body += cast_block(ind) + run_line(ind)
    elif nesting == "if":
        body += [f"{ind}k_buffer = None", f"{ind}if self.use_mla:"] + cast_block(ind + "    ") + run_line(ind)
    elif nesting == "if-else":
        body += [f"{ind}if self.use_mla:"] + cast_block(ind + "    ") + [f"{ind}else:"] + \
            cast_block(ind + "    ") + run_line(ind)
    elif nesting == "else-only":
        body += [f"{ind}if layer.is_cross_attention:", f"{ind}    raise NotImplementedError", f"{ind}else:"] + \
            cast_block(ind + "    ") + run_line(ind)
    elif nesting == "with":
        body += [f"{ind}with torch.cuda.nvtx.range(\"decode\"):"] + cast_block(ind + "    ") + \
            run_line(ind + "    ")
    elif nesting == "if-in-with":
        body += [f"{ind}with torch.no_grad():", f"{ind}    k_buffer = None", f"{ind}    if self.use_mla:"] + \
            cast_block(ind + "        ") + run_line(ind + "    ")
    else:  # with-in-else
        body += [f"{ind}if layer.is_cross_attention:", f"{ind}    return None", f"{ind}else:",
                 f"{ind}    with torch.no_grad():"] + cast_block(ind + "        ") + run_line(ind + "        ")
    body.append(f"{ind}return o")
    init_extra = "        self.kv_indptr = model_runner.kv_indptr\n" if kv_indptr else ""
    src = HEADER.format(init_extra=init_extra) + "\n".join(body) + "\n"
    shape = (rk, getter, layer, dk, layout, form, nesting, kv_indptr, trailing)
    return Variant(src, shape, guarded=form == "two-statement-guarded" or nesting == "if")


# -- the oracle (plain ast, nothing from kvpatch) ------------------------------------
def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(name)


def _is_getter_call(e: ast.AST) -> bool:
    return isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in GETTERS


def oracle_casts(source: str) -> int:
    """`.to(` calls on a KV-getter call, or on a name bound (transitively) to one."""
    fn = _function(ast.parse(source), "forward_decode")
    bound: Set[str] = set()
    changed = True
    while changed:
        changed = False
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and (_is_getter_call(n.value) or (
                    isinstance(n.value, ast.Name) and n.value.id in bound)):
                for t in n.targets:
                    if isinstance(t, ast.Name) and t.id not in bound:
                        bound.add(t.id)
                        changed = True
    count = 0
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "to":
            recv = n.func.value
            if _is_getter_call(recv) or (isinstance(recv, ast.Name) and recv.id in bound):
                count += 1
    return count


def consumer_reads_runtime(source: str) -> Optional[str]:
    """None if run() reads what the runtime hands it, else why not. Two forms:
    routed, `_kvpatch_rt.mla_run(<wrapper>.run, q, q_rope, ckv, kpe)` with both caches
    kv_for_mla_run results; gathered, `<wrapper>.run(q, q_rope, ckv, kpe,
    **_kvpatch_rt.run_kwargs(...))` with both caches kv_for_kernel results (directly, or
    through the last assignment of their name before the call)."""
    fn = _function(ast.parse(source), "forward_decode")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    routed = [n for n in calls if n.func.attr == "mla_run"]
    runs = [n for n in calls if n.func.attr == "run"]
    if len(routed) + len(runs) != 1:
        return f"{len(runs)} run() calls, {len(routed)} mla_run() calls"
    if routed:
        call, producer = routed[0], "kv_for_mla_run"
        first = call.args[0] if call.args else None
        if not (isinstance(first, ast.Attribute) and first.attr == "run"):
            return "mla_run() does not get the wrapper's run() first"
        caches = call.args[3:5]
    else:
        call, producer = runs[0], "kv_for_kernel"
        if not any(k.arg is None and isinstance(k.value, ast.Call) and isinstance(k.value.func, ast.Attribute)
                   and k.value.func.attr == "run_kwargs" for k in call.keywords):
            return "run() lacks **_kvpatch_rt.run_kwargs(...)"
        caches = call.args[2:4]
    assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign)]

    def made_by_runtime(e: ast.AST) -> bool:
        return isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == producer

    for arg in caches:
        e = arg.value if isinstance(arg, ast.Subscript) else arg
        if made_by_runtime(e):
            continue
        if not isinstance(e, ast.Name):
            return f"cache argument `{ast.unparse(arg)}`"
        before = [a for a in assigns if a.lineno < call.lineno
                  and any(isinstance(t, ast.Name) and t.id == e.id for t in a.targets)]
        if not before or not made_by_runtime(max(before, key=lambda a: a.lineno).value):
            return f"`{e.id}` is not last bound to {producer}()"
    return None


# -- the property ------------------------------------------------------------------------
def check_variant(v: Variant) -> None:
    compile(v.source, REL, "exec")
    expected = oracle_casts(v.source)
    assert expected >= 1, v.source
    fa = analyze_source(REL, v.source.encode(), RULES)
    assert not fa.errors, fa.errors
    sites = [s for s in fa.sites if s.qualname == "FlashInferMLAAttnBackend.forward_decode"]
    assert len(sites) == expected, (v.shape, [(s.line, s.status, s.reason) for s in sites], v.source)
    bad = [s for s in sites if s.status != "hot" or not s.fixable or s.rule not in ("KVP101", "KVP107")]
    assert not bad, (v.shape, [(s.line, s.status, s.reason) for s in bad], v.source)
    rw = plan_rewrite(fa, RULES)
    assert rw is not None and len(rw.sites) == expected, v.shape
    compile(rw.new_text, REL, "exec")
    again = analyze_source(REL, rw.new_bytes, RULES)
    assert not again.errors and plan_rewrite(again, RULES) is None, "a second apply must be a no-op"
    patched = [s for s in again.sites if s.qualname == "FlashInferMLAAttnBackend.forward_decode"]
    assert len(patched) == expected and {s.status for s in patched} == {"patched"}, (v.shape, patched)
    assert oracle_casts(rw.new_text) == 0, "a pool-wide cast survived the rewrite"
    if not v.guarded:
        why = consumer_reads_runtime(rw.new_text)
        assert why is None, (v.shape, why, rw.new_text)


def test_flashinfer_mla_site_variants(capsys):
    seen: List[tuple] = []

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(variants())
    def check(v: Variant) -> None:
        seen.append(v.shape)
        check_variant(v)

    check()
    distinct = len(set(seen))
    with capsys.disabled():
        print(f"\n[test_properties] {len(seen)} FlashInfer MLA variants checked ({distinct} distinct shapes)")
    assert len(seen) >= MAX_EXAMPLES and distinct >= MAX_EXAMPLES // 2


def test_oracle_counts_what_it_should():
    """The oracle itself, on hand-written cases (so a broken oracle cannot pass vacuously)."""
    src = HEADER.format(init_extra="") + (
        "        a = self.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
        "        b = a\n"
        "        c = b.to(q.dtype)\n"
        "        d = a[forward_batch.kv_indices].to(q.dtype)\n"  # gathered: not rooted at the pool name
        "        e = q.to(self.data_type)\n"
        "        f = self.token_to_kv_pool.get_value_buffer(0).to(q.dtype)\n"
        "        return decode_wrapper.run(q, q_rope, c, f)\n")
    assert oracle_casts(src) == 2
    assert consumer_reads_runtime(src) == "run() lacks **_kvpatch_rt.run_kwargs(...)"
    routed = src.replace("c = b.to(q.dtype)", "c = _kvpatch_rt.kv_for_mla_run(b, q.dtype)").replace(
        "return decode_wrapper.run(q, q_rope, c, f)", "return _kvpatch_rt.mla_run(decode_wrapper.run, q, q_rope, c, f)")
    assert consumer_reads_runtime(routed) == "`f` is not last bound to kv_for_mla_run()"


def test_generated_shapes_cover_every_choice():
    """Every option of every dimension is reachable (guards against a dead branch in the generator)."""
    shapes = set()

    @settings(max_examples=400, deadline=None, database=None)
    @given(variants())
    def collect(v: Variant) -> None:
        compile(v.source, REL, "exec")
        shapes.add(v.shape)

    collect()
    for i, options in enumerate([RECEIVERS, GETTERS, LAYERS, DTYPES, LAYOUTS, FORMS, NESTING]):
        assert {s[i] for s in shapes} == set(options), i
