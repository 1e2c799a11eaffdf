"""GPU tests of routed sgl-kernel paged MLA decode (KVP108): paged_mla serving
flash_mla_decode's call with the fused FP8 attention, against kvpatch's torch stand-in for
the kernel on a whole bf16 cast (sgl-kernel's XPU kernel cannot run on an NVIDIA GPU;
kvpatch/verify/fa3_reference.py has its semantics), and kvpatch verify driving the XPU
fixture's routed decode fused and gathered.

    python3 -m pytest tests/gpu/test_paged_mla_gpu.py

Tolerance per output vector (512 values): |out - ref| / |ref| < REL_TOL, as in
tests/gpu/test_route_gpu.py; the gathered path must be bit-identical to the stand-in.
"""

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need torch and a CUDA device")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the routed calls' GPU tests need an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton not importable: the fused kernel cannot run")

from kvpatch.runtime import load_template  # noqa: E402
from kvpatch.verify.fa3_reference import flash_mla_decode as reference  # noqa: E402

pytestmark = pytest.mark.gpu
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
DEV = torch.device("cuda")
REL_TOL = 1.5e-2
SCALE = 0.1


@pytest.fixture
def rt(monkeypatch):
    def load(mode):
        monkeypatch.setenv("KVPATCH_MODE", mode)
        mod = load_template(f"_kvpatch_paged_mla_gpu_{mode}")
        mod.reset()
        return mod
    return load


def case(ps, heads=16, lens=(77, 4096, 513, 2000), slots=65536, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    pool = (torch.randn((slots, 1, 576), device=DEV, generator=g) * 0.5).to(FP8)
    width = max(-(-n // ps) for n in lens)
    pt = torch.randperm(slots // ps, device=DEV, generator=g)[: len(lens) * width].view(len(lens), width)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn((len(lens), heads, 576), device=DEV, generator=g).to(BF16)
    return pool, pt.to(torch.int32), sl, q[..., :512], q[..., 512:]


WS = torch.empty(1 << 20, dtype=torch.uint8, device=DEV)


def decode(fn, kv, ps, pt, sl, q_nope, q_pe):
    """flash_mla_decode as SGLang 0.5.23's XPU backend calls it."""
    return fn(q_nope, q_pe, kv.view(-1, ps, 576), sl, pt, WS, SCALE, num_kv_splits=1)


def routed(r, kernel=reference):
    return lambda *a, **k: r.paged_mla(kernel, *a, **k)


def rel_err(out, ref):
    o, r = out.float().reshape(-1, 512), ref.float().reshape(-1, 512)
    return float(((o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-6)).max())


@pytest.mark.parametrize("ps,heads", [(1, 16), (16, 16), (64, 16), (64, 128)])
def test_fused_mode_serves_the_call_from_fp8_within_tolerance(rt, ps, heads):
    r = rt("fused")
    pool, pt, sl, q_nope, q_pe = case(ps, heads)
    want = decode(reference, pool.to(BF16), ps, pt, sl, q_nope, q_pe)
    got = decode(routed(r), r.kv_for_routed_kernel(pool, BF16), ps, pt, sl, q_nope, q_pe)
    assert not r._shadows, "the fused path made a bf16 copy"
    assert got.shape == want.shape and got.dtype == BF16
    assert torch.isfinite(got).all() and rel_err(got, want) < REL_TOL, rel_err(got, want)


@pytest.mark.parametrize("ps", [1, 64])
def test_gather_mode_is_bit_identical_to_the_kernel_on_a_whole_cast(rt, ps):
    r = rt("gather")
    pool, pt, sl, q_nope, q_pe = case(ps)
    want = decode(reference, pool.to(BF16), ps, pt, sl, q_nope, q_pe)
    decode(routed(r), pool, ps, pt, sl, q_nope, q_pe)
    r.poison_shadows()
    assert torch.equal(decode(routed(r), pool, ps, pt, sl, q_nope, q_pe), want)


def test_auto_picks_fused_where_measured_faster_and_gathers_elsewhere(rt):
    r = rt("auto")
    cap = torch.cuda.get_device_capability()
    for heads in (16, 128):
        r.reset()
        pool, pt, sl, q_nope, q_pe = case(64, heads)
        want = decode(reference, pool.to(BF16), 64, pt, sl, q_nope, q_pe)
        got = decode(routed(r), pool, 64, pt, sl, q_nope, q_pe)
        fused = r._fused_auto(tuple(cap), heads, 1)
        assert bool(r._shadows) != fused, (heads, cap)
        if fused:
            assert rel_err(got, want) < REL_TOL
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["fused", "gather"])
def test_the_routed_call_replays_in_a_cuda_graph_with_other_lengths(rt, mode):
    r = rt(mode)
    pool, pt, sl, q_nope, q_pe = case(64)
    decode(routed(r), pool, 64, pt, sl, q_nope, q_pe)  # first call: compile, scratch, shadow
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = decode(routed(r), pool, 64, pt, sl, q_nope, q_pe)
    for lens in ((4096, 64, 1, 3000), (10, 4000, 4096, 2)):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        if mode == "gather":
            r.poison_shadows()
        g.replay()
        want = decode(reference, pool.to(BF16), 64, pt, sl, q_nope, q_pe)
        if mode == "fused":
            assert rel_err(out, want) < REL_TOL, lens
        else:
            assert torch.equal(out, want), lens


def test_sabotage_the_fused_path_given_another_requests_table_fails_the_check(rt, monkeypatch):
    r = rt("fused")
    pool, pt, sl, q_nope, q_pe = case(16)
    want = decode(reference, pool.to(BF16), 16, pt, sl, q_nope, q_pe)
    real = r.fused_mla
    monkeypatch.setitem(r.paged_mla.__globals__, "fused_mla",
                        lambda *a, **k: real(*a, **dict(k, page_table=k["page_table"].roll(1, 0).contiguous())))
    assert rel_err(decode(routed(r), pool, 16, pt, sl, q_nope, q_pe), want) > REL_TOL


def test_verify_drives_the_xpu_fixtures_routed_decode_fused_and_gathered(tmp_path):
    """kvpatch verify on the patched XPU fixture, on CUDA: the decode call KVP108 routes is
    served by the fused path in fused mode (eager and through a captured graph) within
    tolerance, and gathered bit for bit in gather mode."""
    pytest.importorskip("libcst", reason="apply needs libcst")
    from click.testing import CliRunner

    from kvpatch.cli.commands import main
    from kvpatch.verify import run_verify

    root = tmp_path / "xpu"
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "xpu", root)
    assert CliRunner().invoke(main, ["apply", str(root)]).exit_code == 0
    assert "_kvpatch_rt.paged_mla(" in (root / "python/sglang/srt/layers/attention/xpu_backend.py").read_text()
    r = run_verify(root, modes=("gather", "fused"), device="cuda", quick=True)
    print(r.format())
    assert r.ok, r.format()
    decode = [c for c in r.cases if c.qualname == "XPUAttentionBackend.forward_decode"]
    fused = [c for c in decode if c.mode == "fused" and c.kv_path == "fused" and c.passed]
    assert {c.exec for c in fused} == {"eager", "graph"}, r.format()
    gathered = [c for c in decode if c.mode == "gather"]
    assert gathered and all(c.passed and c.tolerance.startswith("bit-identical") for c in gathered)
