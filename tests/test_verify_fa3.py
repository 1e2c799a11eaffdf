"""kvpatch verify for the page-table family (FA3 absorbed MLA), CPU path: the calls KVP106
routes through the runtime (the default) and the page-gathered casts of KVP103 (the FA3
sites with the routing rule left out, `--rules KVP103`).

The CI cases run on tests/data/fa3 (a hand-written FA3-shaped backend); the real-SGLang
cases run on the mirror's HEAD checkout and releases 0.5.16 and 0.5.23 where they are
unpacked (KVPATCH_SGLANG_RELEASES / KVPATCH_SGLANG_CHECKOUTS, else /work/cache), and
skip with the reason elsewhere.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from kvpatch.cli.commands import main  # noqa: E402
from kvpatch.runtime import TEMPLATE  # noqa: E402
from kvpatch.verify import run_verify  # noqa: E402
from kvpatch.verify.fa3_reference import flash_attn_with_kvcache, merge_state_v2  # noqa: E402
from test_releases import RELEASES_ENV, _release_root  # noqa: E402
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "data" / "fa3"
RUNTIME = TEMPLATE  # the joined runtime source, as apply injects it (before its version stamp)
FA3_REL = "sglang/srt/layers/attention/flashattention_backend.py"
CHECKOUTS_ENV = "KVPATCH_SGLANG_CHECKOUTS"
LOCAL_RELEASES = Path("/work/cache/releases")
LOCAL_HEAD = Path("/work/cache/wt/4ad990ba7")  # the mirror's HEAD (2026-08-06)
FA3_SITES = {"FlashAttentionBackend.forward_decode", "FlashAttentionBackend.forward_extend"}


def _wrap(body: str) -> str:
    """The runtime with kv_pages_for_kernel wrapped (contract level: any implementation)."""
    return RUNTIME.read_text() + "\n\n_kvverify_real = kv_pages_for_kernel\n\n" + body


SHORT = _wrap('''
def kv_pages_for_kernel(kv_buffer, q_dtype, page_size, *tables):
    # Sabotage: every table is cast one page short.
    def short(t):
        pt, sl = _resolve(t)
        return (pt, None if sl is None else (sl - page_size).clamp(min=0))
    return _kvverify_real(kv_buffer, q_dtype, page_size, *[short(t) for t in tables])
''')
PAGE_SIZE_IGNORED = _wrap('''
def kv_pages_for_kernel(kv_buffer, q_dtype, page_size, *tables):
    # Sabotage: the table's entries are taken as token slots (page size 1).
    return _kvverify_real(kv_buffer, q_dtype, 1, *tables)
''')
CASCADE_OMITTED = _wrap('''
def kv_pages_for_kernel(kv_buffer, q_dtype, page_size, *tables):
    # Sabotage: only the first call's table is cast (the cascade call's is left out).
    return _kvverify_real(kv_buffer, q_dtype, page_size, *tables[:1])
''')
STALE = _wrap('''
_kvverify_seen = {}


def kv_pages_for_kernel(kv_buffer, q_dtype, page_size, *tables):
    # Sabotage: the lengths are read from a copy taken the first time a buffer is seen,
    # as when they come from a buffer the graph replay does not rewrite.
    def stale(t):
        pt, sl = _resolve(t)
        if sl is None:
            return (pt, sl)
        key = sl.data_ptr()
        if key not in _kvverify_seen:
            _kvverify_seen[key] = (sl, sl.clone())  # holding sl keeps its address unique
        return (pt, _kvverify_seen[key][1])
    return _kvverify_real(kv_buffer, q_dtype, page_size, *[stale(t) for t in tables])
''')


ROUTED, GATHERED = "paged_attention(", "kv_pages_for_kernel("  # what each form calls


def _apply(root: Path, form: str = ROUTED) -> Path:
    rules = [] if form == ROUTED else ["--rules", "KVP103"]
    r = CliRunner().invoke(main, ["apply", *rules, str(root)])
    assert r.exit_code in (0, 1), r.output
    assert (root / "python" / FA3_REL).read_text().count(form) >= 2, r.output
    return root


def _wrap_pages(body: str) -> str:
    """The runtime with page_cast wrapped: the routed calls' gather goes through it."""
    return RUNTIME.read_text() + "\n\n_kvverify_page_cast = page_cast\n\n" + body


ROUTED_SHORT = _wrap_pages('''
def page_cast(src, dst, page_table, seqlens, page_size, **kw):
    # Sabotage: each routed call's pages are cast one page short.
    short = None if seqlens is None else (seqlens - page_size).clamp(min=0)
    return _kvverify_page_cast(src, dst, page_table, short, page_size, **kw)
''')
ROUTED_STALE = _wrap_pages('''
_kvverify_seen = {}


def page_cast(src, dst, page_table, seqlens, page_size, **kw):
    # Sabotage: the lengths are a copy taken the first time a buffer is seen (a replay
    # that reads more rows than at capture is then cast short).
    if seqlens is not None:
        key = seqlens.data_ptr()
        if key not in _kvverify_seen:
            _kvverify_seen[key] = (seqlens, seqlens.clone())
        seqlens = _kvverify_seen[key][1]
    return _kvverify_page_cast(src, dst, page_table, seqlens, page_size, **kw)
''')
ROUTED_ONE_TABLE = _wrap_pages('''
_kvverify_first = []


def page_cast(src, dst, page_table, seqlens, page_size, **kw):
    # Sabotage: only the pages of the first table ever routed are cast; a call with
    # another table (the spec-decode cascade call's) reads what the shadow holds.
    if not _kvverify_first:
        _kvverify_first.append(page_table)
    if page_table is _kvverify_first[0]:
        return _kvverify_page_cast(src, dst, page_table, seqlens, page_size, **kw)
''')


def fixture_checkout(tmp_path: Path, runtime_text: str = None, form: str = GATHERED) -> Path:
    root = tmp_path / "fa3"
    shutil.copytree(FIXTURE, root)
    _apply(root, form)
    if runtime_text is not None:
        (root / "python" / FA3_REL).with_name("_kvpatch_runtime.py").write_text(runtime_text)
    return root


def fa3_cases(report):
    return [c for c in report.cases if c.qualname in FA3_SITES]


def failures_text(report):
    return "\n".join(f"{c.site} [{c.label()}]: {c.message}" for c in report.failures)


@pytest.mark.parametrize("form", [ROUTED, GATHERED])
def test_fixture_patch_passes(tmp_path, form):
    r = run_verify(fixture_checkout(tmp_path, form=form), device="cpu")
    cases = fa3_cases(r)
    assert r.ok, r.format()
    assert {c.qualname for c in cases if c.passed} == FA3_SITES
    assert {c.route for c in cases if c.passed} >= {"decode", "decode:cascade", "prefill", "target_verify:cascade"}
    assert {c.exec for c in cases if c.passed} == {"eager", "replay"}
    for ps in (1, 16, 64):
        assert any(f"page_size={ps} " in c.batch for c in cases if c.passed)
    assert all(c.kernel == "reference-fa3" and c.tolerance.startswith("bit-identical") for c in cases)


def test_pool_read_from_the_forward_batch_verifies(tmp_path):
    """Before 2025-09 (3cc3d9b95, eae59b337) FA3 read the pool as
    `forward_batch.token_to_kv_pool`: the harness's batch carries the pool, so those
    commits are compared, not skipped with 'the original raised'."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    f = src / "python" / FA3_REL
    f.write_text(f.read_text().replace("self.token_to_kv_pool.get_key_buffer", "forward_batch.token_to_kv_pool.get_key_buffer"))
    assert "forward_batch.token_to_kv_pool.get_key_buffer" in f.read_text()
    r = run_verify(_apply(src), device="cpu", quick=True)
    assert r.ok, r.format()
    assert {c.qualname for c in fa3_cases(r) if c.passed} == FA3_SITES, r.format()


def test_unpatched_cast_is_caught(tmp_path):
    root = fixture_checkout(tmp_path)
    f = root / "python" / FA3_REL
    text = f.read_text()
    start = text.index("        kv_cache = _kvpatch_rt.kv_pages_for_kernel(")
    end = text.index("        )\n", start) + len("        )\n")
    f.write_text(text[:start] + "        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n"
                 + text[end:])
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok
    assert {c.qualname for c in r.failures} == {"FlashAttentionBackend.forward_extend"}
    assert "full-pool cast not removed" in failures_text(r)


def test_routed_call_left_unrouted_is_caught(tmp_path):
    """The cast hands the pool on uncast (kv_for_routed_kernel): a call of it that is not
    routed gets FP8 caches, which FA3 (and its reference) refuse with a bf16 query."""
    root = fixture_checkout(tmp_path, form=ROUTED)
    f = root / "python" / FA3_REL
    text = f.read_text()
    routed = "_kvpatch_rt.paged_attention(\n            flash_attn_with_kvcache,\n"
    assert routed in text
    f.write_text(text.replace(routed, "flash_attn_with_kvcache(\n", 1))
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok
    assert "caches are torch.float8_e4m3fn" in failures_text(r), failures_text(r)


@pytest.mark.parametrize("sabotage, expect", [
    (ROUTED_SHORT, "NaN: a page the kernel reads was not cast"),
    (ROUTED_ONE_TABLE, ""),
])
def test_routed_gather_sabotage_fails(tmp_path, sabotage, expect):
    r = run_verify(fixture_checkout(tmp_path, sabotage, form=ROUTED), device="cpu", quick=True)
    assert not r.ok
    assert expect in failures_text(r)
    if sabotage is ROUTED_ONE_TABLE:  # the first case's main call passes; a cascade call fails
        assert any(c.passed for c in fa3_cases(r)) and any(c.route.endswith(":cascade") for c in r.failures)


def test_routed_stale_lengths_under_replay_fail(tmp_path):
    r = run_verify(fixture_checkout(tmp_path, ROUTED_STALE, form=ROUTED), device="cpu", quick=True)
    assert not r.ok
    assert all(c.passed for c in fa3_cases(r) if c.exec == "eager")
    assert r.failures and all(c.exec == "replay" for c in r.failures), failures_text(r)


def test_catches_a_page_short(tmp_path):
    r = run_verify(fixture_checkout(tmp_path, SHORT), device="cpu", quick=True)
    assert not r.ok
    assert {c.qualname for c in r.failures} == FA3_SITES
    assert {c.exec for c in r.failures} == {"eager", "replay"}
    assert all(any(f"page_size={ps} " in c.batch for c in r.failures) for ps in (1, 64))
    assert "NaN: a page the kernel reads was not cast" in failures_text(r)
    assert FA3_REL in failures_text(r)


def test_catches_page_size_ignored(tmp_path):
    r = run_verify(fixture_checkout(tmp_path, PAGE_SIZE_IGNORED), device="cpu", quick=True)
    assert not r.ok
    assert {c.qualname for c in r.failures} == FA3_SITES
    assert all("page_size=1 " not in c.batch for c in r.failures)  # right by luck at page size 1
    assert any("page_size=1 " in c.batch for c in fa3_cases(r) if c.passed)


def test_catches_cascade_table_left_out(tmp_path):
    r = run_verify(fixture_checkout(tmp_path, CASCADE_OMITTED), device="cpu", quick=True)
    assert not r.ok
    assert r.failures and all(c.route == "decode:cascade" for c in r.failures)
    assert "output differs from the original" in failures_text(r)


def test_catches_stale_lengths_under_replay(tmp_path):
    r = run_verify(fixture_checkout(tmp_path, STALE), device="cpu", quick=True)
    assert not r.ok
    assert all(c.passed for c in fa3_cases(r) if c.exec == "eager")
    # the longer replay reads pages the capture-time lengths never named
    assert r.failures and all(c.exec == "replay" and "kv_lens=[150, 70, 190]" in c.batch for c in r.failures)


# --- the reference kernel -------------------------------------------------------------


def _naive(q, qv, kc, vc, pt, sl, cu, scale, causal):
    ps, outs, lses = kc.shape[1], [], []
    for b in range(len(sl)):
        n = int(cu[b + 1] - cu[b])
        keys = [int(pt[b, j // ps]) * ps + j % ps for j in range(int(sl[b]))]
        K, V = kc.reshape(-1, kc.shape[-1])[keys], vc.reshape(-1, vc.shape[-1])[keys]
        for i in range(n):
            t = int(cu[b]) + i
            lim = int(sl[b]) - n + i + 1 if causal else len(keys)
            s = (q[t] @ K[:lim].T + qv[t] @ V[:lim].T) * scale
            outs.append(torch.softmax(s, -1) @ V[:lim])
            lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses, 1)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_kernel_math(causal):
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(20, 4, 1, 8, generator=g), torch.randn(20, 4, 1, 6, generator=g)
    pt = torch.tensor([[3, 7, 1], [5, 2, 9]], dtype=torch.int32)
    sl = torch.tensor([10, 5], dtype=torch.int32)
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    q, qv = torch.randn(3, 4, 8, generator=g), torch.randn(3, 4, 6, generator=g)
    o, lse = flash_attn_with_kvcache(q, kc, vc, qv=qv, page_table=pt, cache_seqlens=sl, cu_seqlens_q=cu,
                                     softmax_scale=0.3, causal=causal, return_softmax_lse=True)
    ro, rl = _naive(q, qv, kc, vc, pt, sl, cu, 0.3, causal)
    assert torch.allclose(o, ro, atol=1e-5) and torch.allclose(lse, rl, atol=1e-5)
    # Rows past a request's length never reach the output; a row inside does.
    kc[9], vc[1, 2:] = float("nan"), float("nan")
    assert torch.isfinite(flash_attn_with_kvcache(q, kc, vc, qv=qv, page_table=pt, cache_seqlens=sl,
                                                  cu_seqlens_q=cu, causal=causal)).all()
    vc[2, 0] = float("nan")
    assert torch.isnan(flash_attn_with_kvcache(q, kc, vc, qv=qv, page_table=pt, cache_seqlens=sl,
                                               cu_seqlens_q=cu, causal=causal)[2]).all()
    # Merging the two halves of a split key set gives the whole.
    o1, l1 = flash_attn_with_kvcache(q, kc.nan_to_num(), vc.nan_to_num(), qv=qv, page_table=pt[:, :1],
                                     cache_seqlens=torch.tensor([4, 4], dtype=torch.int32), cu_seqlens_q=cu,
                                     return_softmax_lse=True)
    o2, l2 = flash_attn_with_kvcache(q, kc.nan_to_num(), vc.nan_to_num(), qv=qv, page_table=pt[:, 1:2],
                                     cache_seqlens=torch.tensor([4, 1], dtype=torch.int32), cu_seqlens_q=cu,
                                     return_softmax_lse=True)
    ow, lw = flash_attn_with_kvcache(q, kc.nan_to_num(), vc.nan_to_num(), qv=qv, page_table=pt[:, :2],
                                     cache_seqlens=torch.tensor([8, 5], dtype=torch.int32), cu_seqlens_q=cu,
                                     return_softmax_lse=True)
    om, lm = merge_state_v2(o1, l1.T.contiguous(), o2, l2.T.contiguous())
    assert torch.allclose(om, ow, atol=1e-5) and torch.allclose(lm, lw.T, atol=1e-5)


# --- real SGLang --------------------------------------------------------------------------


def _real_tree(which, tmp_path, monkeypatch, form=ROUTED) -> Path:
    """The FA3 backend of a real SGLang tree, alone in a fresh tree (apply and verify need no more)."""
    if which == "HEAD":
        base = Path(os.environ.get(CHECKOUTS_ENV, "").split(os.pathsep)[0] or LOCAL_HEAD)
        src = base / "python" / FA3_REL
        if not src.is_file():
            pytest.skip(f"no SGLang checkout with {FA3_REL}: set {CHECKOUTS_ENV}=/path/to/sglang")
    else:
        if not os.environ.get(RELEASES_ENV) and LOCAL_RELEASES.is_dir():
            monkeypatch.setenv(RELEASES_ENV, str(LOCAL_RELEASES))
        src = _release_root(which, tmp_path / "whl") / FA3_REL
    root = tmp_path / "tree"
    (root / "python" / FA3_REL).parent.mkdir(parents=True)
    shutil.copyfile(src, root / "python" / FA3_REL)
    return _apply(root, form)


@pytest.mark.parametrize("form", [ROUTED, GATHERED])
@pytest.mark.parametrize("which", ["HEAD", "0.5.16", "0.5.23"])
def test_real_sglang_fa3_verifies(which, tmp_path, monkeypatch, form):
    r = run_verify(_real_tree(which, tmp_path, monkeypatch, form), device="cpu", quick=True)
    assert r.ok, r.format()
    assert {c.qualname for c in fa3_cases(r) if c.passed} == FA3_SITES
    assert {c.route for c in fa3_cases(r) if c.passed} >= {"decode", "decode:cascade", "prefill",
                                                            "target_verify:cascade"}
    # FA4 (fa_impl_ver=4) shares the site: its decode runs and matches on every release.
    assert "decode:fa4" in {c.route for c in fa3_cases(r) if c.passed}


@pytest.mark.parametrize("form, sabotage", [(ROUTED, ROUTED_SHORT), (GATHERED, SHORT)])
def test_real_sglang_fa3_catches_a_page_short(tmp_path, monkeypatch, form, sabotage):
    root = _real_tree("HEAD", tmp_path, monkeypatch, form)
    (root / "python" / FA3_REL).with_name("_kvpatch_runtime.py").write_text(sabotage)
    r = run_verify(root, device="cpu", quick=True)
    assert not r.ok and {c.qualname for c in r.failures} == FA3_SITES


ROUTED_WHOLE = RUNTIME.read_text() + '''

def _gathered(kw, pool):
    # Sabotage: every routed call casts its two cache views whole (what a lost pool does).
    return _cast_fp8_args(kw, kw["q"])
'''


def test_routed_calls_that_cast_their_views_whole_are_caught(tmp_path):
    """Each view is a part of every slot (64 or 512 of 576 bytes): the guard flags a
    same-shaped copy of a pool view, not only a copy as large as the pool."""
    r = run_verify(fixture_checkout(tmp_path, ROUTED_WHOLE, form=ROUTED), device="cpu", quick=True)
    assert not r.ok
    assert "full-pool cast not removed" in failures_text(r) and "[4096, 1, 1, 64]" in failures_text(r)
