"""GPU tests of routed kernel calls: paged_attention serving FA3's absorbed-MLA call with the
fused FP8 attention, against kvpatch's torch stand-in for FA3 on a whole bf16 cast
(sgl-kernel's FA3 cannot load here; kvpatch/verify/fa3_reference.py has its semantics).

    python3 -m pytest tests/gpu/test_route_gpu.py

Tolerance per output vector (512 values): |out - ref| / |ref| < REL_TOL, as in
tests/gpu/test_fused_gpu.py; the gathered path must be bit-identical to the stand-in.
"""

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need torch and a CUDA device")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the routed calls' GPU tests need an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton not importable: the fused kernel cannot run")

from kvpatch.runtime import load_template  # noqa: E402
from kvpatch.verify.fa3_reference import flash_attn_with_kvcache as fa3  # noqa: E402

pytestmark = pytest.mark.gpu
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
DEV = torch.device("cuda")
REL_TOL = 1.5e-2


@pytest.fixture
def rt(monkeypatch):
    def load(mode):
        monkeypatch.setenv("KVPATCH_MODE", mode)
        mod = load_template(f"_kvpatch_route_gpu_{mode}")
        mod.reset()
        return mod
    return load


def case(ps, tq, heads=16, lens=(77, 4096, 513, 2000), slots=65536, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    pool = (torch.randn((slots, 1, 576), device=DEV, generator=g) * 0.5).to(FP8)
    width = max(-(-n // ps) for n in lens)
    pt = torch.randperm(slots // ps, device=DEV, generator=g)[: len(lens) * width].view(len(lens), width)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn((len(lens) * tq, heads, 576), device=DEV, generator=g).to(BF16)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEV) * tq
    return pool, pt.to(torch.int32), sl, q, cu


def kwargs(kv, ps, pt, sl, q, cu, tq):
    return dict(q=q[..., 512:], k_cache=kv[:, :, 512:].view(-1, ps, 1, 64), v_cache=kv[:, :, :512].view(-1, ps, 1, 512),
                qv=q[..., :512], page_table=pt, cache_seqlens=sl, cu_seqlens_q=cu, max_seqlen_q=tq,
                softmax_scale=0.1, causal=tq > 1)


def rel_err(out, ref):
    o, r = out.float().reshape(-1, 512), ref.float().reshape(-1, 512)
    return float(((o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-6)).max())


@pytest.mark.parametrize("ps,tq", [(1, 1), (64, 1), (16, 4), (1, 8)])
def test_fused_mode_serves_the_call_from_fp8_within_tolerance(rt, ps, tq):
    r = rt("fused")
    pool, pt, sl, q, cu = case(ps, tq)
    want = fa3(**kwargs(pool.to(BF16), ps, pt, sl, q, cu, tq))
    got = r.paged_attention(fa3, **kwargs(r.kv_for_routed_kernel(pool, BF16), ps, pt, sl, q, cu, tq))
    assert not r._shadows, "the fused path made a bf16 copy"
    assert torch.isfinite(got).all() and rel_err(got, want) < REL_TOL, rel_err(got, want)


def test_auto_picks_fused_where_measured_faster_and_gathers_elsewhere(rt):
    r = rt("auto")
    cap = torch.cuda.get_device_capability()
    for heads, tq in ((16, 1), (128, 1), (16, 4)):
        r.reset()
        pool, pt, sl, q, cu = case(64, tq, heads=heads)
        want = fa3(**kwargs(pool.to(BF16), 64, pt, sl, q, cu, tq))
        got = r.paged_attention(fa3, **kwargs(pool, 64, pt, sl, q, cu, tq))
        fused = r._fused_auto(tuple(cap), heads, tq)
        assert bool(r._shadows) != fused, (heads, tq, cap)
        if fused:
            assert rel_err(got, want) < REL_TOL
        else:
            assert torch.equal(got, want)  # the gathered pages and the same kernel: bit for bit


def test_fused_route_replays_in_a_cuda_graph_with_other_lengths(rt):
    r = rt("fused")
    pool, pt, sl, q, cu = case(64, 1)
    kw = kwargs(pool, 64, pt, sl, q, cu, 1)
    kw["out"] = torch.empty((q.shape[0], 16, 512), dtype=BF16, device=DEV)
    r.paged_attention(fa3, **kw)  # first call: compile and scratch, outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        r.paged_attention(fa3, **kw)
    for lens in ((4096, 64, 1, 3000), (10, 4000, 4096, 2)):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        g.replay()
        want = fa3(**kwargs(pool.to(BF16), 64, pt, sl, q, cu, 1))
        assert rel_err(kw["out"], want) < REL_TOL, lens


def test_sabotage_the_route_losing_the_causal_flag_fails_the_check(rt, monkeypatch):
    r = rt("fused")
    pool, pt, sl, q, cu = case(16, 4, lens=(40, 90, 33, 200))
    want = fa3(**kwargs(pool.to(BF16), 16, pt, sl, q, cu, 4))
    kw = kwargs(pool, 16, pt, sl, q, cu, 4)
    real = r.fused_mla
    monkeypatch.setitem(r.paged_attention.__globals__, "fused_mla",
                        lambda *a, **k: real(*a, **dict(k, causal=False)))
    got = r.paged_attention(fa3, **kw)
    assert rel_err(got, want) > REL_TOL
