"""GPU tests of routed FlashInfer MLA run() calls (KVP107's form): mla_run serving a decode
plan with the fused FP8 attention, against kvpatch's torch stand-in for FlashInfer's MLA
wrapper (kvpatch/verify/reference.py) run on a whole bf16 cast. `kvpatch verify` runs the
same routed files against real FlashInfer (gpu/verify_real.py).

    python3 -m pytest tests/gpu/test_mla_route_gpu.py

Tolerance per output vector (512 values): |out - ref| / |ref| < REL_TOL, as in
tests/gpu/test_fused_gpu.py. The plans go through plan_rows, as KVP102 routes them.
"""

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need torch and a CUDA device")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the routed run() GPU tests need an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton not importable: the fused kernel cannot run")

from kvpatch.runtime import load_template  # noqa: E402
from kvpatch.verify.reference import BatchMLAPagedAttentionWrapper  # noqa: E402

pytestmark = pytest.mark.gpu
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
DEV = torch.device("cuda")
REL_TOL = 1.5e-2
SLOTS = 65536


@pytest.fixture
def rt(monkeypatch):
    def load(mode):
        monkeypatch.setenv("KVPATCH_MODE", mode)
        mod = load_template(f"_kvpatch_mla_route_gpu_{mode}")
        mod.reset()
        return mod
    return load


def pool_and_q(bs, heads, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    pool = (torch.randn((SLOTS, 1, 576), device=DEV, generator=g) * 0.5).to(FP8)
    q = torch.randn((bs, heads, 576), device=DEV, generator=g).to(BF16)
    return pool, q[..., :512].contiguous(), q[..., 512:].contiguous()


def plan(rt, w, lens, heads, seed=1, host=True):
    """A decode plan through plan_rows: a host indptr (the fast replay plan's) or a device one."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    indices = torch.randperm(SLOTS, generator=g)[:n].to(torch.int32).to(DEV)
    kv_indptr = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    qo = torch.arange(len(lens) + 1, dtype=torch.int32)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    if not host:
        kv_indptr, qo, kv_lens = kv_indptr.to(DEV), qo.to(DEV), kv_lens.to(DEV)
    w.plan(qo, rt.plan_rows(w, kv_indptr), indices, kv_lens, heads, 512, 64, 1, False, 0.1, BF16, BF16)
    return indices


def reference(w, pool, q_nope, q_pe):
    kv = pool.to(BF16)
    return w.run(q_nope, q_pe, kv[:, :, :512], kv[:, :, 512:])


def rel_err(out, ref):
    o, r = out.float().reshape(-1, 512), ref.float().reshape(-1, 512)
    return float(((o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-6)).max())


def counted(r, monkeypatch):
    calls = []
    real = r.fused_mla
    monkeypatch.setitem(r.mla_run.__globals__, "fused_mla", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("host", [True, False], ids=["host-indptr", "device-indptr"])
def test_fused_mode_serves_a_decode_plan_from_fp8_within_tolerance(rt, monkeypatch, host):
    r = rt("fused")
    lens = (77, 4096, 513, 2000)
    pool, q_nope, q_pe = pool_and_q(len(lens), 16)
    w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8, device=DEV))
    indices = plan(r, w, lens, 16, host=host)
    # Poison every slot the plan does not read: a row read outside the plan shows.
    unread = torch.ones(SLOTS, dtype=torch.bool, device=DEV)
    unread[indices.long()] = False
    want = reference(w, pool, q_nope, q_pe)
    pool.view(torch.uint8)[unread] = 0x7F  # FP8 e4m3fn NaN
    calls = counted(r, monkeypatch)
    kv = r.kv_for_mla_run(pool, BF16)
    out = torch.empty_like(q_nope)
    got = r.mla_run(w.run, q_nope, q_pe, kv[:, :, :512], kv[:, :, 512:], out=out)
    again = r.mla_run(w.run, q_nope, q_pe, kv[:, :, :512], kv[:, :, 512:], out=torch.empty_like(q_nope))
    assert calls == [1, 1] and got is out
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < REL_TOL
    assert torch.equal(got, again)  # deterministic


def test_auto_takes_fused_at_16_heads_and_gathers_at_128(rt, monkeypatch):
    r = rt("auto")
    cap = torch.cuda.get_device_capability()
    for heads in (16, 128):
        lens = (300, 1000)
        pool, q_nope, q_pe = pool_and_q(len(lens), heads)
        w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8, device=DEV))
        plan(r, w, lens, heads)
        calls = counted(r, monkeypatch)
        got = r.mla_run(w.run, q_nope, q_pe, pool[:, :, :512], pool[:, :, 512:])
        want = reference(w, pool, q_nope, q_pe)
        fused = r._fused_auto(tuple(cap), heads, 1)
        assert calls == ([1] if fused else []), heads
        assert torch.equal(got, want) if not fused else rel_err(got, want) < REL_TOL


def graph_wrapper(bs):
    """A wrapper made for graphs (SGLang's use_cuda_graph=True capture wrapper)."""
    return BatchMLAPagedAttentionWrapper(
        torch.empty(16, dtype=torch.uint8, device=DEV), use_cuda_graph=True,
        qo_indptr=torch.zeros(bs + 1, dtype=torch.int32, device=DEV),
        kv_indptr=torch.zeros(bs + 1, dtype=torch.int32, device=DEV),
        kv_indices=torch.zeros(bs * 4096, dtype=torch.int32, device=DEV),
        kv_len_arr=torch.zeros(bs, dtype=torch.int32, device=DEV))


def captured(r, w, pool, q_nope, q_pe):
    out = torch.empty_like(q_nope)

    def fwd():
        return r.mla_run(w.run, q_nope, q_pe, pool[:, :, :512], pool[:, :, 512:], out=out)
    fwd()  # compile and scratch, outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fwd()
    return g, out


REPLAYS = ((4096, 64, 1, 3000), (10, 4000, 4096, 2))


def test_fused_route_replays_in_a_cuda_graph_with_other_lengths(rt, monkeypatch):
    """Planned at capture with a device indptr, re-planned before each replay with a host
    one (SGLang's fast_mla_decode_plan): the graph reads what each plan wrote."""
    r = rt("fused")
    pool, q_nope, q_pe = pool_and_q(4, 16)
    w = graph_wrapper(4)
    plan(r, w, (50, 60, 70, 80), 16, host=False)
    calls = counted(r, monkeypatch)
    g, out = captured(r, w, pool, q_nope, q_pe)
    assert calls == [1, 1]  # the fused path was captured
    for i, lens in enumerate(REPLAYS):
        plan(r, w, lens, 16, seed=10 + i)
        g.replay()
        assert rel_err(out, reference(w, pool, q_nope, q_pe)) < REL_TOL, lens


def test_sabotage_a_stale_graph_indptr_fails_the_check(rt, monkeypatch):
    """The replay check can fail: when the indptr copy is not refreshed by a later plan
    (as if read from the wrapper's own buffer, which the fast replay plan leaves stale),
    the graph reads the capture's rows."""
    r = rt("fused")
    pool, q_nope, q_pe = pool_and_q(4, 16)
    w = graph_wrapper(4)
    plan(r, w, (50, 60, 70, 80), 16, host=False)
    g, out = captured(r, w, pool, q_nope, q_pe)
    monkeypatch.setitem(r.plan_rows.__globals__, "_note_indptr", lambda *a, **k: None)
    plan(r, w, REPLAYS[0], 16, seed=10)
    g.replay()
    assert rel_err(out, reference(w, pool, q_nope, q_pe)) > REL_TOL
