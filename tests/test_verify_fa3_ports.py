"""kvpatch verify drives the FA3 family's ports, CPU path, each as its own class:
MUSA's MusaFlashAttentionBackend (a subclass of FA3's FlashAttentionBackend with its
own forwards and its own flash_attn_interface wrapper) and XPU's XPUAttentionBackend
(its own class: extend's flash_attn_with_kvcache routed by KVP106, decode's sgl-kernel
flash_mla_decode routed by KVP108 through its positional signature, `paged_mla`; both kernels
served by the same torch reference, fa3_reference). Verify runs the routed calls gathered
(bit-identical) and reports the fused path as not run on the CPU. Hand-written fixtures under
tests/data/musa and tests/data/xpu, and the mirror's HEAD where it is checked out."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from kvpatch.cli.commands import main  # noqa: E402
from kvpatch.verify import run_verify  # noqa: E402
from test_verify_fa3 import (  # noqa: E402
    CHECKOUTS_ENV, LOCAL_HEAD, ROUTED_ONE_TABLE, ROUTED_SHORT, _wrap_pages, failures_text)
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "data" / "musa"
MUSA_REL = "sglang/srt/hardware_backend/musa/attention/flashattention_backend.py"
MUSA_SITES = {"MusaFlashAttentionBackend.forward_decode", "MusaFlashAttentionBackend.forward_extend"}
XPU_FIXTURE = REPO / "tests" / "data" / "xpu"
XPU_REL = "sglang/srt/layers/attention/xpu_backend.py"
XPU_EXTEND = "XPUAttentionBackend.forward_extend"
XPU_DECODE = "XPUAttentionBackend.forward_decode"


def _checkout(src_root: Path, tmp_path: Path, runtime_text: str = None, rel: str = MUSA_REL,
              sites: int = 2) -> Path:
    root = tmp_path / "port"
    (root / "python" / rel).parent.mkdir(parents=True)
    shutil.copyfile(src_root / "python" / rel, root / "python" / rel)
    r = CliRunner().invoke(main, ["apply", str(root)])
    assert r.exit_code in (0, 1), r.output
    text = (root / "python" / rel).read_text()  # routed (KVP106) or page-gathered (KVP103) casts
    assert text.count("kv_for_routed_kernel(") + text.count("kv_pages_for_kernel(") >= sites, r.output
    if runtime_text is not None:
        (root / "python" / rel).with_name("_kvpatch_runtime.py").write_text(runtime_text)
    return root


def _musa_cases(report):
    return [c for c in report.cases if c.qualname in MUSA_SITES]


def test_musa_fixture_verifies_as_its_own_class(tmp_path):
    r = run_verify(_checkout(FIXTURE, tmp_path), device="cpu", quick=True)
    assert r.ok, r.format()
    cases = _musa_cases(r)
    assert {c.qualname for c in cases if c.passed} == MUSA_SITES
    assert {c.route for c in cases if c.passed} >= {"decode", "decode:cascade", "prefill", "target_verify:cascade"}
    assert not [c for c in r.cases if c.status == "skipped" and c.qualname in MUSA_SITES]


@pytest.mark.parametrize("runtime_text", [ROUTED_SHORT, ROUTED_ONE_TABLE], ids=["page_short", "cascade_omitted"])
def test_musa_sabotage_fails_naming_the_site(tmp_path, runtime_text):
    r = run_verify(_checkout(FIXTURE, tmp_path, runtime_text), device="cpu", quick=True)
    assert not r.ok
    assert r.failures and {c.qualname for c in r.failures} <= MUSA_SITES
    assert MUSA_REL in failures_text(r)


def test_real_sglang_musa_verifies(tmp_path):
    base = Path(os.environ.get(CHECKOUTS_ENV, "").split(os.pathsep)[0] or LOCAL_HEAD)
    if not (base / "python" / MUSA_REL).is_file():
        pytest.skip(f"no SGLang checkout with {MUSA_REL}: set {CHECKOUTS_ENV}=/path/to/sglang")
    r = run_verify(_checkout(base, tmp_path), device="cpu", quick=True)
    assert r.ok, r.format()
    assert {c.qualname for c in _musa_cases(r) if c.passed} == MUSA_SITES
    assert {c.route for c in _musa_cases(r) if c.passed} >= {"decode", "decode:cascade", "prefill"}


def _xpu_root(tmp_path, runtime_text=None):
    return _checkout(XPU_FIXTURE, tmp_path, runtime_text, rel=XPU_REL, sites=2)


def test_xpu_extend_and_decode_verify(tmp_path):
    root = _xpu_root(tmp_path)
    text = (root / "python" / XPU_REL).read_text()
    assert "_kvpatch_rt.paged_attention(\n            flash_attn_with_kvcache," in text  # extend: KVP106
    assert "_kvpatch_rt.paged_mla(\n            flash_mla_decode," in text  # decode: KVP108
    assert "kv_pages_for_kernel(" not in text
    r = run_verify(root, modes=("gather", "fused"), device="cpu", quick=True)
    assert r.ok, r.format()
    extend = [c for c in r.cases if c.qualname == XPU_EXTEND]
    assert extend and all(c.passed for c in extend)
    assert {c.route for c in extend} >= {"prefill", "target_verify:cascade"}
    decode = [c for c in r.cases if c.qualname == XPU_DECODE]
    assert decode and all(c.passed for c in decode), r.format()  # flash_mla_decode, routed by its signature
    assert {c.exec for c in decode} == {"eager", "replay"} and all(c.kv_path == "gather" for c in decode)
    for ps in (1, 64):
        assert any(f"page_size={ps} " in c.batch for c in decode)
    # The fused path needs CUDA: on the CPU it is reported as not run, never as passed.
    assert "fused path not run" in r.reason and not [c for c in r.cases if c.mode == "fused"]


# Sabotage of the routed decode call alone: page_cast misbehaves only when paged_mla calls it.
PAGED_MLA_SHORT = _wrap_pages('''
import sys as _kvverify_sys


def page_cast(src, dst, page_table, seqlens, page_size, **kw):
    # Sabotage: a routed paged MLA decode call's pages are cast for seq_lens - 1 tokens.
    if _kvverify_sys._getframe(1).f_code.co_name == "paged_mla" and seqlens is not None:
        seqlens = (seqlens - 1).clamp(min=0)
    return _kvverify_page_cast(src, dst, page_table, seqlens, page_size, **kw)
''')
PAGED_MLA_TABLE = _wrap_pages('''
import sys as _kvverify_sys


def page_cast(src, dst, page_table, seqlens, page_size, **kw):
    # Sabotage: a routed paged MLA decode call's pages are cast from another request's row.
    if _kvverify_sys._getframe(1).f_code.co_name == "paged_mla":
        page_table = page_table.roll(1, 0)
    return _kvverify_page_cast(src, dst, page_table, seqlens, page_size, **kw)
''')


@pytest.mark.parametrize("runtime_text", [PAGED_MLA_SHORT, PAGED_MLA_TABLE], ids=["seq_lens_minus_1", "wrong_table"])
def test_xpu_routed_decode_sabotage_fails_naming_the_decode_site(tmp_path, runtime_text):
    r = run_verify(_xpu_root(tmp_path, runtime_text), device="cpu", quick=True)
    assert not r.ok
    assert r.failures and {c.qualname for c in r.failures} == {XPU_DECODE}, failures_text(r)
    assert all(c.passed for c in r.cases if c.qualname == XPU_EXTEND)
    assert "NaN: a page the kernel reads was not cast" in failures_text(r)
    if runtime_text is PAGED_MLA_SHORT:  # at page size 1 every request's last token is missed
        assert any("page_size=1 " in c.batch for c in r.failures)


def test_xpu_page_short_fails_naming_both_sites(tmp_path):
    r = run_verify(_xpu_root(tmp_path, ROUTED_SHORT), device="cpu", quick=True)  # both forms cast pages
    assert not r.ok
    assert {c.qualname for c in r.failures} == {XPU_EXTEND, XPU_DECODE}
    assert XPU_REL in failures_text(r)


def test_real_sglang_xpu_extend_verifies(tmp_path):
    base = Path(os.environ.get(CHECKOUTS_ENV, "").split(os.pathsep)[0] or LOCAL_HEAD)
    if not (base / "python" / XPU_REL).is_file():
        pytest.skip(f"no SGLang checkout with {XPU_REL}: set {CHECKOUTS_ENV}=/path/to/sglang")
    root = _checkout(base, tmp_path, rel=XPU_REL, sites=1)
    r = run_verify(root, device="cpu", quick=True)
    assert r.ok, r.format()
    assert [c for c in r.cases if c.qualname == XPU_EXTEND and c.passed]
    if "_kvpatch_rt.paged_mla(" in (root / "python" / XPU_REL).read_text():  # decode routed by KVP108
        assert [c for c in r.cases if c.qualname == XPU_DECODE and c.passed], r.format()
