"""GPU tests of the 64-row warpgroup-MMA split kernel (runtime part _fused_wgmma), on an SM90 GPU:

    python3 -m pytest tests/gpu/test_fused_wgmma_gpu.py

The kernel serves calls of at least 64 query rows a request (128 heads, or 16 heads x 4 or
more draft tokens) where a config asks for it ("wgmma": True) or FUSED_WGMMA_DEFAULT is on.
Every check is the fp32 reference over the same rows (tests/gpu/test_fused_gpu.py's), and
each sabotage (a wrong page, a stale length, a wrong scale, no causal mask) must fail it.
"""

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need torch and a CUDA device")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the fused attention's GPU tests need an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton not importable: the fused kernel cannot run")

from test_fused_gpu import (  # noqa: E402
    DEV,
    RT,
    _split_kernel_name,
    fp8_pool,
    indptr_batch,
    ok,
    queries,
    rel_err,
    rows_indptr,
    rows_table,
    run,
    table_batch,
)

from kvpatch.verify.fused_reference import fused_reference  # noqa: E402

pytestmark = pytest.mark.gpu

if not RT._fused_wgmma_build():
    pytest.skip("this Triton has no Gluon (or not the version the kernel has run on): the Triton "
                "kernel serves these calls (tests/gpu/test_fused_gpu.py)", allow_module_level=True)
if torch.cuda.get_device_capability() not in RT.FUSED_GLUON_CAPABILITY:
    pytest.skip("the warpgroup-MMA kernel is built for SM 9.0 only", allow_module_level=True)


# Each test runs on the loader-partition kernel (runtime part _fused_wgmma_ws, the default),
# on it with the softmax's exchange ("wg_xchg", session 20: off, not yet run on a device),
# and on the plain 64-row kernel ("wg_ws": False, where the loader kernel does not build):
# the same checks, the same rows.
KERNELS = {"wgmma": "_fused_wgmma_split_kernel", "wgmma_loader": "_fused_wgmma_ws_split_kernel",
           "wgmma_loader_xchg": "_fused_wgmma_ws_split_kernel"}


@pytest.fixture(params=sorted(KERNELS))
def kernel(request):
    return request.param


def cfg(wgmma=True, lean=False, kernel="wgmma"):
    # lean: the variant with two barriers a step (not the default yet)
    return dict(RT.FUSED_TUNING["large"], gluon=False, wgmma=wgmma, wg_lean=lean, wg_ws=kernel != "wgmma",
                wg_xchg=kernel == "wgmma_loader_xchg")


@pytest.mark.parametrize("heads,tq,ps,scales,lean", [(128, 1, 1, False, False), (128, 1, 64, True, False),
                                                     (16, 4, 16, False, False), (16, 8, 1, True, False),
                                                     (64, 1, 1, False, False), (16, 6, 64, False, False),
                                                     (128, 1, 64, True, True), (16, 4, 16, False, True)])
def test_page_table_rows_match_fp32_reference(heads, tq, ps, scales, lean, kernel):
    """Ragged lengths through a page table; 16 x 6 = 96 rows leaves the second group part
    empty (masked rows). Against the Triton kernel and the reference, bit-identical twice,
    and a wrong page fails."""
    if lean and kernel != "wgmma":
        pytest.skip("lean is a tuning of the plain 64-row kernel only")
    lens = [tq, 33, 4096, 513, 2000]
    slots = 65_536
    pool = fp8_pool(slots, page_size=ps if ps > 1 else None)
    pt, sl = table_batch(lens, slots // ps, ps, width=4096 // ps + 3)
    qn, qp = queries(len(lens) * tq, heads)
    kw = dict(page_table=pt, cache_seqlens=sl, page_size=ps, q_per_request=tq, causal=tq > 1,
              config=cfg(lean=lean, kernel=kernel))
    if scales:
        kw.update(ckv_scale=0.5, kpe_scale=torch.full((1,), 2.0, device=DEV))
    out = run(qn, qp, pool, **kw)
    assert _split_kernel_name().startswith(KERNELS[kernel])
    tri = run(qn, qp, pool, **dict(kw, config=cfg(False)))
    assert _split_kernel_name().startswith("_fused_split_kernel")
    ref = fused_reference(qn, qp, pool, 0.1, rows_table(pt, sl, ps), tq, tq > 1,
                          ckv_scale=0.5 if scales else 1.0, kpe_scale=2.0 if scales else 1.0)
    assert ok(out, ref), rel_err(out, ref)
    assert ok(tri, ref), rel_err(tri, ref)
    assert torch.equal(out, run(qn, qp, pool, **kw))
    bad = pt.clone()
    bad[0, 0] = bad[1, 0]  # request 0 reads request 1's first page instead of its own
    assert not ok(run(qn, qp, pool, **dict(kw, page_table=bad)), ref)


@pytest.mark.parametrize("n_splits", [None, 1, 7])
def test_indptr_rows_one_split_and_many(n_splits, kernel):
    """kv_indptr rows at 128 heads: one split writes the output itself (DIRECT), several
    go through the combine; the same rows either way."""
    lens = [1, 77, 4096, 513, 2000]
    pool = fp8_pool(40_000)
    perm, indptr = indptr_batch(lens, 40_000)
    qn, qp = queries(len(lens), 128)
    out = run(qn, qp, pool, kv_indptr=indptr, kv_indices=perm, n_splits=n_splits, config=cfg(kernel=kernel))
    assert _split_kernel_name().startswith(KERNELS[kernel])
    ref = fused_reference(qn, qp, pool, 0.1, rows_indptr(perm, indptr))
    assert ok(out, ref), rel_err(out, ref)


def test_graph_replays_with_more_and_fewer_rows_than_at_capture(kernel):
    slots, heads, tq = 200_000, 16, 4
    pool = fp8_pool(slots)
    cap = 8192
    qn, qp = queries(4 * tq, heads)
    out = torch.empty((4 * tq, heads, 512), dtype=torch.bfloat16, device=DEV)
    pt = torch.zeros((4, cap), dtype=torch.int32, device=DEV)
    sl = torch.zeros(4, dtype=torch.int32, device=DEV)

    def write(lens, seed):
        t, s = table_batch(lens, slots, 1, seed, width=cap)
        pt.copy_(t)
        sl.copy_(s)

    kw = dict(page_table=pt, cache_seqlens=sl, q_per_request=tq, causal=True, config=cfg(kernel=kernel))
    write([1000, 1000, 1000, 1000], 0)
    RT.fused_mla(qn, qp, pool, out, 0.1, **kw)
    assert _split_kernel_name().startswith(KERNELS[kernel])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        RT.fused_mla(qn, qp, pool, out, 0.1, **kw)
    for i, lens in enumerate(([8000, 20, 5000, 8192], [4, 5, 7, 4], [4096, 4, 7000, 9])):
        write(lens, 10 + i)
        out.fill_(float("nan"))
        g.replay()
        ref = fused_reference(qn, qp, pool, 0.1, rows_table(pt, sl, 1), tq, True)
        assert ok(out, ref), (lens, rel_err(out, ref))


def test_sabotages_fail_the_check(kernel):
    """A stale length, a wrong scale and a missing causal mask each fail the reference."""
    lens = [200, 256, 37, 128]
    pool = fp8_pool(60_000)
    perm, indptr = indptr_batch(lens, 60_000)
    qn, qp = queries(len(lens) * 4, 16)
    kw = dict(kv_indices=perm, q_per_request=4, config=cfg(kernel=kernel))
    ref = fused_reference(qn, qp, pool, 0.1, rows_indptr(perm, indptr), 4, True)
    assert ok(run(qn, qp, pool, kv_indptr=indptr, causal=True, **kw), ref)
    assert _split_kernel_name().startswith(KERNELS[kernel])
    stale = torch.tensor([0, 64, 192, 229, 357], dtype=torch.int32, device=DEV)
    assert not ok(run(qn, qp, pool, kv_indptr=stale, causal=True, **kw), ref)
    assert not ok(run(qn, qp, pool, kv_indptr=indptr, causal=False, **kw), ref)
    ref_s = fused_reference(qn, qp, pool, 0.1, rows_indptr(perm, indptr), 4, True, ckv_scale=0.5)
    assert not ok(run(qn, qp, pool, kv_indptr=indptr, causal=True, **kw), ref_s)
    assert ok(run(qn, qp, pool, kv_indptr=indptr, causal=True, ckv_scale=0.5, **kw), ref_s)
