"""kvpatch verify for aiter's MHA extend (KVP103 through mha_batch_prefill_func), CPU path.

No ROCm GPU is lent: both sides run kvpatch.verify.aiter_reference, a torch stand-in with
the kernel's row contract. The cases run on tests/data/aiter (a hand-written backend shaped
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
from kvpatch.verify.aiter_reference import mha_batch_prefill_func  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "data" / "aiter"
RUNTIME = TEMPLATE  # the joined runtime source, as apply injects it (before its version stamp)
REL = "python/sglang/srt/layers/attention/aiter_backend.py"
SITE = "AiterAttnBackend.forward_extend"


def _wrap(body: str) -> str:
    return RUNTIME.read_text() + "\n\n" + body


FIRST_REQUEST_ONLY = _wrap('''
_kvverify_ragged = ragged_pages


def ragged_pages(kv_indptr, kv_indices, page_size):
    # Sabotage: only the first request's rows are listed.
    return _kvverify_ragged(kv_indptr[:2], kv_indices, page_size)
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
               .replace("            self.forward_metadata.kv_indices,\n", "            page_table,\n"))
    assert out.count("page_table") == 5
    return out


def checkout(tmp_path: Path, runtime_text: str = None, swa: bool = False) -> Path:
    root = tmp_path / "aiter"
    shutil.copytree(FIXTURE, root)
    if swa:
        (root / REL).write_text(_swa((root / REL).read_text()))
    r = CliRunner().invoke(main, ["apply", str(root)])
    assert r.exit_code in (0, 1), r.output
    assert (root / REL).read_text().count("kv_pages_for_kernel(") == 2, r.output
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
    assert not r.ok and {c.qualname for c in r.failures} == {SITE}, r.format()


def test_catches_k_and_v_sharing_one_shadow(tmp_path):
    """Runtime 2 kept one shadow per shape: an MHA layer's k and v casts overwrote each other."""
    r = run_verify(checkout(tmp_path, ONE_SHADOW), device="cpu", quick=True)
    assert not r.ok and {c.qualname for c in r.failures} == {SITE}, r.format()
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
