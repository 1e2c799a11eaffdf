"""kvpatch verify for aiter's MHA extend and decode (KVP103 through mha_batch_prefill_func and
paged_attention_ragged), CPU path.

No ROCm GPU is lent: both sides run kvpatch.verify.aiter_reference, torch stand-ins with
the kernels' row contracts. The cases run on tests/data/aiter (a hand-written backend shaped
like SGLang's aiter backend of 2025-09 to 2026-02). Each sabotage (a broken rewrite or a
broken runtime) must make verify fail.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from kvpatch.cli.commands import main  # noqa: E402
from kvpatch.runtime import TEMPLATE  # noqa: E402
from kvpatch.verify import run_verify  # noqa: E402
from kvpatch.analysis.pagedcall import RAGGED_KERNELS  # noqa: E402
from kvpatch.verify import stubs  # noqa: E402
from kvpatch.verify.aiter import DECODE_KERNEL, DECODE_LENS, DECODE_VARIANTS, REPLAY_LENS  # noqa: E402
from kvpatch.verify.aiter_reference import DECODE_KERNEL_NAME  # noqa: E402
from kvpatch.verify.aiter_reference import mha_batch_prefill_func, paged_attention_ragged  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "data" / "aiter"
RUNTIME = TEMPLATE  # the joined runtime source, as apply injects it (before its version stamp)
REL = "python/sglang/srt/layers/attention/aiter_backend.py"
SITE = "AiterAttnBackend.forward_extend"
DECODE_SITE = "AiterAttnBackend.forward_decode"
DECODE_LIST = "ragged_pages(self.forward_metadata.kv_indptr, self.forward_metadata.kv_indices, 1)"


def _wrap(body: str) -> str:
    return RUNTIME.read_text() + "\n\n" + body


FIRST_REQUEST_ONLY = _wrap('''
_kvverify_ragged = ragged_pages


def ragged_pages(kv_indptr, kv_indices, page_size):
    # Sabotage: only the first request's rows are listed.
    return _kvverify_ragged(kv_indptr[:2], kv_indices, page_size)
''')
CAST_ONCE = _wrap('''
_kvverify_pages = kv_pages_for_kernel
_kvverify_cast = {}


def kv_pages_for_kernel(kv_buffer, q_dtype, page_size, *tables):
    # Sabotage: a source's pages are cast on its first call only; later calls hand back the
    # shadow as it was left (stale rows).
    key = (kv_buffer.data_ptr(), q_dtype)
    if key not in _kvverify_cast:
        _kvverify_cast[key] = _kvverify_pages(kv_buffer, q_dtype, page_size, *tables)
    return _kvverify_cast[key]
''')
FROZEN_LIST = _wrap('''
_kvverify_ragged = ragged_pages
_kvverify_lists = {}


def ragged_pages(kv_indptr, kv_indices, page_size):
    # Sabotage: a buffer's page list read once, as if fixed at capture: what a replay
    # rewrote in place since is missed. The buffers are kept, so no address is reused.
    key = (kv_indptr.data_ptr(), kv_indices.data_ptr())
    if key not in _kvverify_lists:
        pair = _kvverify_ragged(kv_indptr, kv_indices, page_size)
        _kvverify_lists[key] = (kv_indptr, kv_indices, tuple(t.clone() for t in pair))
    return _kvverify_lists[key][2]
''')
ONE_SHADOW = _wrap('''
def _shadow(kv_buffer, dtype):
    # Sabotage: runtime 2's shadow, one per (device, shape, dtype): k and v share it.
    key = (kv_buffer.device, tuple(kv_buffer.shape), dtype)
    if key not in _shadows:
        _shadows[key] = torch.empty(kv_buffer.shape, dtype=dtype, device=kv_buffer.device)
    return _shadows[key]
''')


def _swa(text: str) -> str:
    """The fixture as SGLang 2026-01 has it: the page list a name bound after the cast."""
    out = (text.replace("            window_size = (layer.sliding_window_size, -1)\n",
                        "            window_size = (layer.sliding_window_size, -1)\n"
                        "            if self.forward_metadata.swa_page_table is not None:\n"
                        "                page_table = self.forward_metadata.swa_page_table\n")
               .replace("        window_size = (-1, -1)\n",
                        "        window_size = (-1, -1)\n        page_table = self.forward_metadata.kv_indices\n")
               # forward_extend's argument only (it comes first): the decode reads no SWA list
               .replace("            self.forward_metadata.kv_indices,\n", "            page_table,\n", 1))
    assert out.count("page_table") == 5
    return out


def checkout(tmp_path: Path, runtime_text: str = None, swa: bool = False) -> Path:
    root = tmp_path / "aiter"
    shutil.copytree(FIXTURE, root)
    if swa:
        (root / REL).write_text(_swa((root / REL).read_text()))
    r = CliRunner().invoke(main, ["apply", str(root)])
    assert r.exit_code in (0, 1), r.output
    assert (root / REL).read_text().count("kv_pages_for_kernel(") == 4, r.output  # extend's two, decode's two
    if runtime_text is not None:
        (root / REL).with_name("_kvpatch_runtime.py").write_text(runtime_text)
    return root


def failures(report) -> str:
    return "\n".join(f"{c.site} [{c.label()}]: {c.message}" for c in report.failures)


def test_fixture_patch_passes_on_the_reference(tmp_path):
    r = run_verify(checkout(tmp_path), device="cpu")
    cases = [c for c in r.cases if c.qualname == SITE]
    assert r.ok, r.format()
    assert cases and all(c.passed for c in cases), r.format()
    assert {c.route for c in cases} == {"prefill", "prefill:window=16", "prefill:sinks", "prefill:swa-table"}
    assert all(c.kernel == "reference-aiter-mha-batch-prefill" and c.tolerance.startswith("bit-identical")
               for c in cases)
    assert any("no ROCm GPU is lent" in n for n in r.notes), r.notes
    assert not r.unverified, r.unverified  # the decode's rewrite is driven, not left NOT VERIFIED
    dec = [c for c in r.cases if c.qualname == DECODE_SITE]
    assert dec and all(c.passed and c.kernel == DECODE_KERNEL_NAME and c.tolerance.startswith("bit-identical")
                       for c in dec), r.format()
    assert {c.route for c in dec} == {"decode", "decode:softcap"}
    assert len([c for c in dec if c.exec == "eager"]) == len(DECODE_LENS) * len(DECODE_VARIANTS)
    assert len([c for c in dec if c.exec == "replay"]) == len(REPLAY_LENS[1])
    assert any(DECODE_KERNEL_NAME in n for n in r.notes), r.notes


def test_swa_page_list_bound_after_the_cast_passes_and_leaving_it_out_fails(tmp_path):
    root = checkout(tmp_path, swa=True)
    r = run_verify(root, device="cpu", quick=True)
    assert r.ok, r.format()
    f = root / REL
    text = f.read_text()
    swa = [ln for ln in text.splitlines(True) if "ragged_pages(" in ln and "swa_page_table" in ln]
    assert len(swa) == 2  # one per cast: the SWA list is cast too (a superset)
    f.write_text("".join(ln for ln in text.splitlines(True) if ln not in swa))
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok and {c.route for c in r.failures} == {"prefill:swa-table"}, r.format()


def test_unpatched_cast_is_caught(tmp_path):
    root = checkout(tmp_path)
    f = root / REL
    text = f.read_text()
    start = text.index("            v_cache = _kvpatch_rt.kv_pages_for_kernel(")
    end = text.index("            )\n", start) + len("            )\n")
    f.write_text(text[:start] + "            v_cache = v_cache.to(dtype)\n" + text[end:])
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok and {c.qualname for c in r.failures} == {SITE}
    assert "full-pool cast not removed" in failures(r)


def test_catches_a_rewrite_that_lists_too_few_rows(tmp_path):
    """The rewrite's page list cut to the first request: the others read poisoned shadow rows."""
    root = checkout(tmp_path)
    f = root / REL
    text = f.read_text()
    assert text.count("kv_indptr[:bs0], self.forward_metadata.kv_indices, 1)") == 2
    f.write_text(text.replace("kv_indptr[:bs0], self.forward_metadata.kv_indices, 1)",
                              "kv_indptr[:2], self.forward_metadata.kv_indices, 1)"))
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok, r.format()
    assert "NaN: a page the kernel reads was not cast" in failures(r)
    assert all("kv_lens=[37]" not in c.batch for c in r.failures)  # one request: nothing left out


def test_catches_a_runtime_that_lists_too_few_rows(tmp_path):
    r = run_verify(checkout(tmp_path, FIRST_REQUEST_ONLY), device="cpu", quick=True)
    assert not r.ok and {c.qualname for c in r.failures} == {SITE, DECODE_SITE}, r.format()
    dec = [c for c in r.cases if c.qualname == DECODE_SITE]
    assert {c.batch for c in dec if c.passed} == {"kv_lens=[37] q_lens=[1]"}, r.format()  # one request: all listed


def test_unpatched_decode_cast_is_caught(tmp_path):
    root = checkout(tmp_path)
    f = root / REL
    text = f.read_text()
    start = text.rindex("                v_cache = _kvpatch_rt.kv_pages_for_kernel(")  # the decode's
    end = text.index("                )\n", start) + len("                )\n")
    f.write_text(text[:start] + "                v_cache = v_cache.to(dtype)\n" + text[end:])
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok and {c.qualname for c in r.failures} == {DECODE_SITE}, r.format()
    assert all("full-pool cast not removed" in c.message for c in r.failures if c.exec == "eager")


@pytest.mark.parametrize("wrong, why", [
    ("self.forward_metadata.kv_indptr[:-1], self.forward_metadata.kv_indices", "the batch's last request left out"),
    ("self.forward_metadata.kv_indptr, self.forward_metadata.kv_indices[1:]", "the list shifted by one row"),
])
def test_catches_a_decode_rewrite_that_casts_the_wrong_rows(tmp_path, wrong, why):
    root = checkout(tmp_path)
    f = root / REL
    text = f.read_text()
    assert text.count(DECODE_LIST) == 2  # k's and v's casts
    f.write_text(text.replace(DECODE_LIST, f"ragged_pages({wrong}, 1)"))
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok and {c.qualname for c in r.failures} == {DECODE_SITE}, (why, r.format())
    assert "NaN: a page the kernel reads was not cast" in failures(r), why
    assert any("kv_lens=[37]" in c.batch for c in r.failures), why  # even one request reads a row left out


def test_catches_a_runtime_that_leaves_stale_shadow_rows(tmp_path):
    """Cast once, reused after: the shadow's rows are poisoned between runs, so they show."""
    r = run_verify(checkout(tmp_path, CAST_ONCE), device="cpu", quick=True)
    dec = [c for c in r.cases if c.qualname == DECODE_SITE]
    assert not r.ok and dec and all(c.failed for c in dec), r.format()
    assert all("NaN: a page the kernel reads was not cast" in c.message for c in dec), r.format()


def test_catches_a_page_list_frozen_at_capture_only_on_replay(tmp_path):
    """Eager cases hand new buffers each time, so only the replay (buffers rewritten in
    place) sees a runtime that keeps the first list it read of a buffer."""
    r = run_verify(checkout(tmp_path, FROZEN_LIST), device="cpu", quick=True)
    assert not r.ok and {(c.qualname, c.exec) for c in r.failures} == {(DECODE_SITE, "replay")}, r.format()
    assert len(r.failures) == len(REPLAY_LENS[1])
    assert "NaN: a page the kernel reads was not cast" in failures(r)


def test_a_decode_no_case_ran_stays_not_verified(tmp_path, monkeypatch):
    """Where the original's decode cannot run here, its cases are skipped and the rewrite is
    named NOT VERIFIED: the verdict is never OK on the extend alone."""
    def unavailable(*args, **kwargs):
        raise RuntimeError("no paged_attention_ragged here")

    monkeypatch.setitem(stubs.REAL, DECODE_KERNEL, unavailable)
    r = run_verify(checkout(tmp_path), device="cpu", quick=True)
    dec = [c for c in r.cases if c.qualname == DECODE_SITE]
    assert dec and all(c.status == "skipped" for c in dec), r.format()
    assert r.ok and [u for u in r.unverified if DECODE_SITE in u and "none of its" in u], r.format()
    assert r.format().splitlines()[0].endswith("PARTLY VERIFIED (device=cpu, kernel=reference, gpu_ran=False)")


def test_catches_k_and_v_sharing_one_shadow(tmp_path):
    """Runtime 2 kept one shadow per shape: an MHA layer's k and v casts overwrote each other."""
    r = run_verify(checkout(tmp_path, ONE_SHADOW), device="cpu", quick=True)
    assert not r.ok and {c.qualname for c in r.failures} == {SITE, DECODE_SITE}, r.format()
    assert "output differs from the original" in failures(r)


def _naive(q, k, v, cu, indptr, indices, causal):
    out = []
    for b in range(len(indptr) - 1):
        rows = indices[indptr[b]:indptr[b + 1]].long()
        qb = q[cu[b]:cu[b + 1]].float()
        kb = k[rows].float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        vb = v[rows].float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = torch.einsum("thd,jhd->htj", qb, kb) * q.shape[-1] ** -0.5
        n, length = qb.shape[0], rows.shape[0]
        if causal:
            mask = torch.arange(length)[None, :] > (torch.arange(n) + length - n)[:, None]
            s = s.masked_fill(mask[None], float("-inf"))
        out.append(torch.einsum("htj,jhd->thd", s.softmax(-1), vb))
    return torch.cat(out)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_kernel_math_and_rows_read(causal):
    """The reference matches dense attention over each request's listed rows, and a NaN in a
    row listed nowhere (or listed only past the batch) never reaches the output."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn((64, 2, 16), generator=g)
    v = torch.randn((64, 2, 16), generator=g)
    indices = torch.randperm(63, generator=g)[:30] + 1
    indptr = torch.tensor([0, 5, 12, 20, 30])  # the last request is past the batch
    cu = torch.tensor([0, 5, 8])
    q = torch.randn((8, 4, 16), generator=g)
    listed = set(indices[:12].tolist())
    for r in range(64):
        if r not in listed:
            k[r] = float("nan")
            v[r] = float("nan")
    got = mha_batch_prefill_func(q, k, v, cu, indptr[:3], indices, 5, 7, causal=causal)
    assert torch.isfinite(got).all()
    ref = _naive(q, k, v, cu, indptr[:3].tolist(), indices, causal)
    assert torch.allclose(got.float(), ref, atol=1e-5)


def _naive_decode(q, k, v, indptr, indices, last, ps, cap=0.0, k_scale=1.0, v_scale=1.0):
    """Dense attention of each request's one query over its listed pages' slots."""
    out = []
    for b in range(q.shape[0]):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        slots = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)[: (len(pages) - 1) * ps + last[b]]
        rep_ = q.shape[1] // k.shape[2]
        kb = k.reshape(-1, *k.shape[2:])[slots].float().repeat_interleave(rep_, dim=1) * k_scale
        vb = v.reshape(-1, *v.shape[2:])[slots].float().repeat_interleave(rep_, dim=1) * v_scale
        s = torch.einsum("hd,jhd->hj", q[b].float(), kb) * 0.25
        if cap:
            s = cap * torch.tanh(s / cap)
        out.append(torch.einsum("hj,jhd->hd", s.softmax(-1), vb))
    return torch.stack(out)


@pytest.mark.parametrize("ps, cap", [(1, 0.0), (4, 0.0), (4, 20.0)])
def test_paged_attention_ragged_reference_math_and_rows_read(ps, cap):
    """Dense GQA attention over each request's listed pages (the last one kv_last_page_lens
    deep), and a NaN anywhere else (a page listed nowhere, or past the batch, or a slot past a
    last page's length) never reaches the output."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn((32, ps, 2, 16), generator=g)
    v = torch.randn((32, ps, 2, 16), generator=g)
    indices = torch.randperm(31, generator=g)[:20] + 1
    indptr = torch.tensor([0, 4, 5, 11, 20])  # the fourth request is past the batch (3 queries)
    last = [ps, 1, max(ps - 1, 1), ps]
    q = torch.randn((3, 4, 16), generator=g)
    read = {(int(p), o) for b in range(3) for i, p in enumerate(indices[indptr[b]:indptr[b + 1]].tolist())
            for o in range(last[b] if i == indptr[b + 1] - indptr[b] - 1 else ps)}
    for page in range(32):
        for o in range(ps):
            if (page, o) not in read:
                k[page, o] = float("nan")
                v[page, o] = float("nan")
    out = torch.empty((3, 4, 16))
    got = paged_attention_ragged(out, None, q, k, v, 0.25, indptr, indices, torch.tensor(last), ps, 1, None,
                                 "auto", "NHD", cap, torch.ones(1), torch.ones(1), None, 256)
    assert got is out and torch.isfinite(got).all()
    assert torch.allclose(got, _naive_decode(q, k, v, indptr, indices, last, ps, cap), atol=1e-5)
    hnd = paged_attention_ragged(torch.empty_like(out), None, q, k.transpose(1, 2), v.transpose(1, 2), 0.25, indptr,
                                 indices, torch.tensor(last), ps, 1, None, "auto", "HND", cap, None, None)
    assert torch.equal(hnd, got)


def test_paged_attention_ragged_reference_dtypes_scales_and_signature():
    """"auto" takes the query's dtype only (an FP8 cache there would be read as other bytes);
    an FP8 kv_cache_dtype multiplies by k_scale/v_scale; the parameters are the ones KVP103
    binds the kernel's calls by (pagedcall.RAGGED_KERNELS)."""
    import inspect

    g = torch.Generator().manual_seed(1)
    k = torch.randn((8, 1, 1, 16), generator=g)
    v = torch.randn((8, 1, 1, 16), generator=g)
    q = torch.randn((1, 2, 16), generator=g).to(torch.bfloat16)
    indptr, indices, last = torch.tensor([0, 5]), torch.tensor([3, 1, 7, 2, 6]), torch.ones(1, dtype=torch.int32)
    args = (0.25, indptr, indices, last, 1, 1, None)
    with pytest.raises(TypeError, match="auto"):
        paged_attention_ragged(torch.empty(1, 2, 16), None, q, k.to(torch.float8_e4m3fn),
                               v.to(torch.float8_e4m3fn), *args, "auto", "NHD", 0.0, None, None)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    got = paged_attention_ragged(torch.empty(1, 2, 16), None, q, k8, v8, *args, "fp8", "NHD", 0.0,
                                 torch.tensor([0.5]), torch.tensor([2.0]))
    ref = _naive_decode(q, k8.float(), v8.float(), indptr, indices, [1], 1, k_scale=0.5, v_scale=2.0)
    assert torch.allclose(got, ref, atol=1e-5)
    assert tuple(inspect.signature(paged_attention_ragged).parameters) == RAGGED_KERNELS[DECODE_KERNEL]


def _decode_only(tmp_path: Path) -> Path:
    """The fixture without its forward_extend: a backend from before aiter's
    mha_batch_prefill_func (2025-09), whose only aiter call is the MHA decode."""
    root = tmp_path / "aiter-decode-only"
    shutil.copytree(FIXTURE, root)
    f = root / REL
    text = f.read_text()
    start = text.index("    def forward_extend(")
    end = text.index("    def forward_decode(")
    f.write_text(text[:start] + text[end:])
    r = CliRunner().invoke(main, ["apply", str(root)])
    assert r.exit_code in (0, 1), r.output
    assert f.read_text().count("kv_pages_for_kernel(") == 2, r.output  # the decode's two casts
    return root


def test_a_backend_with_only_the_decode_is_driven_and_verified(tmp_path):
    from kvpatch.verify import aiter_reference
    from kvpatch.verify.targets import AITER, AITER_DECODE_KERNEL, backend_family

    # the name verify recognises the class by is the reference's own (and SGLang's import)
    assert aiter_reference.paged_attention_ragged.__name__ == AITER_DECODE_KERNEL
    assert AITER_DECODE_KERNEL in aiter_reference.REAL
    root = _decode_only(tmp_path)
    assert backend_family((root / REL).read_text()) == (AITER, "AiterAttnBackend")
    r = run_verify(root, device="cpu", quick=True)
    assert r.ok and not r.unverified, r.format()
    assert r.format().splitlines()[0].endswith("OK (device=cpu, kernel=reference, gpu_ran=False)"), r.format()
    assert {c.qualname for c in r.cases} == {DECODE_SITE}, r.format()  # no extend to run
    assert r.cases and all(c.passed for c in r.cases), r.format()


def test_a_decode_only_backend_still_catches_a_wrong_row_rewrite(tmp_path):
    root = _decode_only(tmp_path)
    f = root / REL
    text = f.read_text()
    assert text.count(DECODE_LIST) == 2
    f.write_text(text.replace(DECODE_LIST, "ragged_pages(self.forward_metadata.kv_indptr[:-1], "
                                           "self.forward_metadata.kv_indices, 1)"))
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok and {c.qualname for c in r.failures} == {DECODE_SITE}, r.format()
    assert "NaN: a page the kernel reads was not cast" in failures(r)
