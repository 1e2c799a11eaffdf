"""kvpatch.analysis.pagedcall binds a page-table kernel call to its caches, table and lengths:
by keyword (flash_attn_with_kvcache) or through a known signature (sgl-kernel's
flash_mla_decode / flash_mla_prefill), and refuses a call that does not bind."""

from __future__ import annotations

import libcst as cst
import pytest

from kvpatch.analysis.pagedcall import bind_paged, is_cache_arg


def _call(code: str) -> cst.Call:
    return cst.parse_expression(code)


def _code(node) -> str:
    return cst.Module([]).code_for_node(node)


@pytest.mark.parametrize("code, table, lens", [
    ("flash_mla_decode(qn, qp, kv.view(-1, ps, 576), md.lens, md.table, ws, scale)", "md.table", "md.lens"),
    ("flash_mla_decode(qn, qp, kv.view(-1, ps, 576), md.lens, page_table=t, workspace=ws, sm_scale=s)", "t", "md.lens"),
    ("sgl_kernel.flash_mla_prefill(q_nope=qn, q_pe=qp, kv_c_and_k_pe_cache=kv, cu_seqlens_q=cu, seq_lens_k=sl, "
     "max_seqlen_q=m, page_table=pt, workspace=ws, sm_scale=s)", "pt", "sl"),
    ("flash_mla_prefill(qn, qp, kv, cu, sl, m, pt, ws, s, True, -1)", "pt", "sl"),
    ("flash_attn_with_kvcache(q=q, k_cache=k, v_cache=v, page_table=md.pt, cache_seqlens=md.sl)", "md.pt", "md.sl"),
])
def test_binds_table_and_lengths(code, table, lens):
    got = bind_paged(_call(code))
    assert got is not None and _code(got.table) == table and _code(got.seqlens) == lens


@pytest.mark.parametrize("code", [
    "flash_mla_decode(qn, qp, kv, *rest)",  # starred: positions unknown
    "flash_mla_decode(qn, qp, kv, sl, pt, ws, s, 1, extra)",  # more positions than parameters
    "flash_mla_decode(qn, qp, kv, sl, pt, ws, s, seq_lens=sl)",  # a parameter given twice
    "flash_mla_decode(qn, qp, kv, sl, pt, ws, s, block_size=64)",  # a keyword it does not take
    "flash_mla_decode(qn, qp, kv)",  # no table, no lengths
    "flash_attn_with_kvcache(q=q, k_cache=k, v_cache=v, page_table=pt)",  # no lengths
])
def test_a_call_that_does_not_bind_is_not_paged(code):
    assert bind_paged(_call(code)) is None


def test_only_the_cache_argument_is_a_cache():
    call = _call("flash_mla_decode(qn, qp, kv, sl, pt, ws, s)")
    assert is_cache_arg(call, None, 2)
    assert not is_cache_arg(call, None, 0) and not is_cache_arg(call, None, 4)
    kw = _call("flash_attn_with_kvcache(q=q, k_cache=k, v_cache=v, page_table=pt, cache_seqlens=sl)")
    assert is_cache_arg(kw, "k_cache", None) and is_cache_arg(kw, "v_cache", None) and not is_cache_arg(kw, "q", None)
