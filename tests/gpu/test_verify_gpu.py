"""kvpatch verify on a CUDA GPU: real FlashInfer (when importable), captured CUDA graphs,
native FP8. Skipped, with the reason, where there is no CUDA device."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU verify tests need one (the CPU path is "
                "tests/test_verify_cpu.py)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_verify_cpu import (GOLDEN, RUNTIME, SHIFTED, SHORT, STALE, _sub_first,  # noqa: E402
                             golden_with_site_unpatched, failures_text, make_checkout)

from kvpatch.verify import run_verify  # noqa: E402

pytestmark = pytest.mark.gpu

try:
    import flashinfer
    HAVE_FI = hasattr(flashinfer, "BatchMLAPagedAttentionWrapper")
except Exception:  # not installed, or broken
    HAVE_FI = False
SM90 = torch.cuda.get_device_capability()[0] == 9
needs_fi = pytest.mark.skipif(not HAVE_FI, reason="FlashInfer is not importable")


def verify(root, **kw):
    kw.setdefault("device", "cuda")
    kw.setdefault("quick", True)
    return run_verify(root, log=print, **kw)


@needs_fi
@pytest.mark.parametrize("causal,fp8", [(False, False), (True, False), (False, True), (True, True)])
def test_reference_matches_flashinfer(causal, fp8):
    """The CPU path's reference kernel computes what FlashInfer computes (same causal
    convention), so a pass on CPU means something."""
    if fp8 and not SM90:
        pytest.skip("FP8 MLA needs SM90")
    from kvpatch.verify.reference import BatchMLAPagedAttentionWrapper as Ref
    g = torch.Generator(device="cuda").manual_seed(0)
    slots, heads = 8192, 16
    kv = torch.randn((slots, 1, 576), generator=g, device="cuda").to(torch.float8_e4m3fn)
    kv_lens = [300, 1, 1024] if causal else [777, 1, 2048]
    q_lens = [77, 1, 256] if causal else [1, 1, 1]
    idx = torch.randperm(slots, generator=g, device="cuda")[: sum(kv_lens)].to(torch.int32)
    kv_indptr = torch.tensor([0] + [sum(kv_lens[:i + 1]) for i in range(3)], dtype=torch.int32,
                             device="cuda")
    qo = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(3)], dtype=torch.int32,
                      device="cuda")
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    qn = torch.randn((sum(q_lens), heads, 512), generator=g, device="cuda").to(torch.bfloat16)
    qp = torch.randn((sum(q_lens), heads, 64), generator=g, device="cuda").to(torch.bfloat16)
    cache = kv if fp8 else kv.to(torch.bfloat16)
    kvd = torch.float8_e4m3fn if fp8 else torch.bfloat16
    kw = {"ckv_scale": 1.0, "kpe_scale": 1.0} if fp8 else {}
    outs = []
    for W in (flashinfer.BatchMLAPagedAttentionWrapper, Ref):
        w = W(torch.empty(384 << 20, dtype=torch.uint8, device="cuda"), backend="auto")
        w.plan(qo, kv_indptr, idx, lens, heads, 512, 64, 1, causal, 1 / math.sqrt(192),
               torch.bfloat16, kvd)
        outs.append(w.run(qn, qp, cache[:, :, :512], cache[:, :, 512:], **kw).float())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)


def test_golden_patch_passes_on_gpu(tmp_path):
    r = verify(make_checkout(tmp_path), quick=False)
    print(r.format())
    assert r.ok, r.format()
    assert r.gpu_ran and r.device.startswith("cuda")
    # The golden fixture has no target-verify or draft-extend path of its own: verify
    # reports those cases skipped with that reason, and the skip reason is checked here.
    assert "has no target-verify path" in r.format()
    gather = [c for c in r.cases if c.mode == "gather" and c.status != "skipped"]
    assert {c.path for c in gather} == {"decode", "prefill"}
    assert all(c.passed and c.identical_share == 1.0 for c in gather)
    if not HAVE_FI:
        assert r.kernel == "reference" and "FlashInfer not importable" in r.reason
        return
    assert r.kernel == "flashinfer"
    assert {c.exec for c in gather if c.path == "decode"} == {"eager", "graph"}
    native = [c for c in r.cases if c.mode == "native"]
    if SM90:
        native = [c for c in native if c.status != "skipped"]
        assert native and all(c.passed for c in native), r.format()
        # Decode plans go native; causal (prefill) plans always keep the gathered cast.
        assert {c.kv_path for c in native if c.path == "decode"} == {"native"}
        assert {c.kv_path for c in native if c.path == "prefill"} == {"gather"}
        assert all(c.identical_share == 1.0 for c in native if c.path == "prefill")
        assert all(c.max_abs_err is not None and c.max_abs_err < 0.1 for c in native)
    else:
        assert all(c.status == "skipped" for c in native)


@pytest.mark.parametrize("runtime_text", [SHIFTED, SHORT], ids=["shifted", "short"])
def test_catches_wrong_rows_on_gpu(tmp_path, runtime_text):
    # On CUDA the runtime's Triton kernel does the gather (the torch path on CPU).
    r = verify(make_checkout(tmp_path, runtime_text=runtime_text), modes=("gather",))
    assert not r.ok
    assert {c.qualname for c in r.failures} == {
        "FlashInferMLAAttnBackend.forward_decode", "FlashInferMLAAttnBackend.forward_extend"}
    assert "output differs from the original" in failures_text(r)


def test_catches_stale_indptr_under_graph(tmp_path):
    r = verify(make_checkout(tmp_path, runtime_text=STALE), modes=("gather",))
    eager = [c for c in r.cases if c.exec == "eager" and c.status != "skipped"]
    assert eager and all(c.passed for c in eager)
    assert r.failures and all("replay longer" in c.batch for c in r.failures)
    if HAVE_FI:
        assert {c.exec for c in r.failures} == {"graph"}  # a real captured graph


def test_catches_prefill_site_left_unpatched_on_gpu(tmp_path):
    text = golden_with_site_unpatched("forward_extend")
    r = verify(make_checkout(tmp_path, patched_text=text), modes=("gather",))
    assert {c.qualname for c in r.failures} == {"FlashInferMLAAttnBackend.forward_extend"}
    assert all("full-pool cast not removed" in c.message for c in r.failures)


@needs_fi
def test_catches_plan_dtype_mismatch_on_gpu(tmp_path):
    if not SM90:
        pytest.skip("FlashInfer accepts an FP8 MLA plan only on SM90")
    text = _sub_first(r"_kvpatch_rt\.plan_kv_dtype\([^)]*\)", "torch.float8_e4m3fn",
                      GOLDEN.read_text(), within="class FlashInferMLAIndicesUpdaterDecode")
    r = verify(make_checkout(tmp_path, patched_text=text), modes=("gather",))
    assert {c.qualname for c in r.failures} == {"FlashInferMLAAttnBackend.forward_decode"}
    assert "does not match the planned kv_data_type=torch.float8_e4m3fn" in failures_text(r)


@needs_fi
def test_catches_missing_run_kwargs_in_native(tmp_path):
    if not SM90:
        pytest.skip("native FP8 MLA needs SM90")
    # The routed run() of a wrapper planned FP8 must pass the scales (mla_run adds them).
    src = RUNTIME.read_text()
    assert src.count("return run(*args, **kw, **run_kwargs(wrapper))") == 1
    text = src.replace("return run(*args, **kw, **run_kwargs(wrapper))", "return run(*args, **kw)")
    r = verify(make_checkout(tmp_path, runtime_text=text), modes=("native",))
    assert {c.qualname for c in r.failures} == {"FlashInferMLAAttnBackend.forward_decode"}
    assert re.search(r"ckv_scale|kpe_scale", failures_text(r))


# -- the fused path of a routed FlashInfer run() (KVP107, mla_run) ---------------------------
needs_fused = pytest.mark.skipif(not SM90, reason="the fused path's auto table and tests are SM90")

FUSED_SHIFTED = RUNTIME.read_text() + """

_kvverify_mla_fused = _mla_fused


def _mla_fused(named, kw, pool, indptr, indices, sm_scale):
    # Sabotage: the fused attention reads the neighbouring slots.
    return _kvverify_mla_fused(named, kw, pool, indptr, indices + 1, sm_scale)
"""

FUSED_STALE = RUNTIME.read_text() + """

_kvverify_note_indptr = _note_indptr


def _note_indptr(wrapper, kv_indptr, device):
    # Sabotage: a graph wrapper's indptr copy is made at its first plan and never refreshed.
    if getattr(wrapper, "_use_cuda_graph", False) and wrapper.__dict__.get(_INDPTR_ATTR):
        return
    return _kvverify_note_indptr(wrapper, kv_indptr, device)
"""


@needs_fi
@needs_fused
def test_fused_route_passes_and_says_it_served(tmp_path):
    r = verify(make_checkout(tmp_path), modes=("fused",))
    assert r.ok, r.format()
    fused = [c for c in r.cases if c.kv_path == "fused"]
    assert {(c.path, c.exec) for c in fused} == {("decode", "eager"), ("decode", "graph")}
    assert all(c.passed and "fused path served" in c.message for c in fused)
    assert {c.kv_path for c in r.cases if c.path == "prefill" and c.status != "skipped"} == {"gather"}


@needs_fi
@needs_fused
def test_catches_fused_wrong_rows(tmp_path):
    r = verify(make_checkout(tmp_path, runtime_text=FUSED_SHIFTED), modes=("fused",))
    assert not r.ok
    assert {c.qualname for c in r.failures} == {"FlashInferMLAAttnBackend.forward_decode"}
    assert {c.exec for c in r.failures} == {"eager", "graph"}
    assert "fused output off the original" in failures_text(r)


@needs_fi
@needs_fused
def test_catches_fused_stale_indptr_under_graph(tmp_path):
    r = verify(make_checkout(tmp_path, runtime_text=FUSED_STALE), modes=("fused",))
    eager = [c for c in r.cases if c.exec == "eager" and c.status != "skipped"]
    assert eager and all(c.passed for c in eager)
    # The capture's rows, read again: wrong for any replay of other lengths.
    assert r.failures and all(c.exec == "graph" for c in r.failures)
    assert any("replay longer" in c.batch for c in r.failures)
    assert "fused output off the original" in failures_text(r)
