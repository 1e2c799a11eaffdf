"""The fused FP8 MLA attention on the CPU: its argument checks, its fp32 reference, and the
kernel itself under Triton's interpreter where Triton is importable (it is not in CI's CPU
install: those tests skip, saying so; tests/gpu/test_fused_gpu.py runs it on a GPU)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the fused attention's checks need torch")

from kvpatch.verify.fused_reference import fused_reference  # noqa: E402

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
ROOT = Path(__file__).resolve().parents[1]


def load_fused():
    """The injected runtime as apply writes it (its fused parts included)."""
    from kvpatch.runtime import load_template

    return load_template("_kvpatch_fused_cpu")


def case(slots=300, heads=4, lens=(37, 70), tq=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn((slots, 1, 576), generator=g) * 0.5).to(FP8)
    perm = torch.randperm(slots, generator=g)[: sum(lens)].to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
    q = torch.randn((len(lens) * tq, heads, 576), generator=g).to(BF16)
    return pool, perm, indptr, q[..., :512], q[..., 512:]


def test_reference_is_softmax_attention_with_bottom_right_causal_mask_and_scales():
    pool, perm, indptr, qn, qp = case()
    ref = fused_reference(qn, qp, pool, 0.1, lambda b: perm[indptr[b]:indptr[b + 1]], 2, True, 0.5, 2.0)
    kv = pool.view(-1, 576).float()
    for b in range(2):
        rows = kv[perm[indptr[b]:indptr[b + 1]].long()]
        n = rows.shape[0]
        for t in range(2):
            seen = rows[: n - 2 + t + 1]  # query t of 2 sees positions <= n - 2 + t
            for h in range(4):
                qv = torch.cat([qn[b * 2 + t, h].float() * 0.5, qp[b * 2 + t, h].float() * 2.0])
                w = torch.softmax((seen @ qv) * 0.1, 0)
                want = w @ (seen[:, :512] * 0.5)
                assert torch.allclose(ref[b * 2 + t, h], want, rtol=1e-4, atol=1e-5)


def test_argument_checks_refuse_before_any_kernel():
    fz = load_fused()
    pool, perm, indptr, qn, qp = case(tq=2)
    out = torch.empty((4, 4, 512), dtype=BF16)
    with pytest.raises(ValueError, match="multiple of q_per_request"):
        fz.fused_mla(qn, qp, pool, out, 0.1, kv_indptr=indptr, kv_indices=perm, q_per_request=3)
    with pytest.raises(ValueError, match=r"256 \+ 64 wide \(got torch.float8_e4m3fn, 576\)"):
        fz.fused_mla(qn[..., :256], qp, pool, out, 0.1, kv_indptr=indptr, kv_indices=perm, q_per_request=2)


INTERPRET_SCRIPT = r"""
import importlib.util, sys
import torch
sys.path.insert(0, sys.argv[1])
from kvpatch.verify.fused_reference import fused_reference
from tests.test_fused_cpu import case, load_fused

fz = load_fused()
f16p = bool(int(sys.argv[2]))  # f16 partials (FUSED_F16_PARTIALS), the latent's scale in the combine
cfg = dict(block_m=16, block_n=16, num_warps=4, num_stages=1, ctas_per_sm=1, min_split=16, f16_partials=f16p)


def err(out, ref):
    return float(((out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


pool, perm, indptr, qn, qp = case()
rows = lambda b: perm[indptr[b]:indptr[b + 1]]
for causal in (True, False):
    out = torch.full((4, 4, 512), float("nan"), dtype=torch.bfloat16)
    fz.fused_mla(qn, qp, pool, out, 0.1, kv_indptr=indptr, kv_indices=perm, q_per_request=2,
                 causal=causal, config=cfg, n_splits=3)
    print("indptr", causal, err(out, fused_reference(qn, qp, pool, 0.1, rows, 2, causal)))
# many splits: the combine reads them in column blocks (40 splits: one 64-split tile of 128
# columns), and beyond 64 live splits in two tiles merged in turn (70 splits, 69 live)
pool2, perm2, indptr2, qn2, qp2 = case(slots=1500, heads=4, lens=(1100, 37), tq=1, seed=3)
rows2 = lambda b: perm2[indptr2[b]:indptr2[b + 1]]
for ns in (40, 70):
    out2 = torch.full((2, 4, 512), float("nan"), dtype=torch.bfloat16)
    fz.fused_mla(qn2, qp2, pool2, out2, 0.1, kv_indptr=indptr2, kv_indices=perm2, config=cfg, n_splits=ns)
    print("splits", ns, err(out2, fused_reference(qn2, qp2, pool2, 0.1, rows2, 1, False)))
# sabotage: no causal mask against the causal reference
out = torch.empty((4, 4, 512), dtype=torch.bfloat16)
fz.fused_mla(qn, qp, pool, out, 0.1, kv_indptr=indptr, kv_indices=perm, q_per_request=2, causal=False,
             config=cfg, n_splits=3)
print("nomask", err(out, fused_reference(qn, qp, pool, 0.1, rows, 2, True)))
ps = 4
pt = torch.randperm(300 // ps, generator=torch.Generator().manual_seed(5))[:40].view(2, 20).to(torch.int32)
sl = torch.tensor([37, 70], dtype=torch.int32)
fz.fused_mla(qn, qp, pool, out, 0.1, page_table=pt, cache_seqlens=sl, page_size=ps, q_per_request=2,
             causal=True, ckv_scale=0.5, kpe_scale=torch.tensor([2.0]), config=cfg, n_splits=2)
table_rows = lambda b: pt[b, torch.arange(int(sl[b])) // ps].long() * ps + torch.arange(int(sl[b])) % ps
print("table", err(out, fused_reference(qn, qp, pool, 0.1, table_rows, 2, True, 0.5, 2.0)))
# q beyond f16's range (65504): the f16 dots (not the default yet) take q scaled by a power of two
big = 3.0e5
fz.fused_mla(qn * big, qp * big, pool, out, 0.1 / big, kv_indptr=indptr, kv_indices=perm, q_per_request=2,
             causal=True, config=dict(cfg, f16=True), n_splits=3)
print("bigq", err(out, fused_reference(qn * big, qp * big, pool, 0.1 / big, rows, 2, True)))
# One split: the split kernel writes the output itself, no combine launch; the same bits as
# split + combine, and a request with no rows gets zeros (out starts as NaN).
pool3, perm3, indptr3, qn3, qp3 = case(lens=(37, 0, 70), tq=2, seed=7)
rows3 = lambda b: perm3[indptr3[b]:indptr3[b + 1]]
launches, real_launch = [], fz._launch
fz._launch = lambda k, *a, **kw: launches.append(k) or real_launch(k, *a, **kw)
outs = {}
for direct in (True, False):
    o = torch.full((6, 4, 512), float("nan"), dtype=torch.bfloat16)
    del launches[:]
    fz.fused_mla(qn3, qp3, pool3, o, 0.1, kv_indptr=indptr3, kv_indices=perm3, q_per_request=2, causal=True,
                 config=dict(cfg, direct=direct), n_splits=1)
    outs[direct] = (o, len(launches))
fz._launch = real_launch
ref3 = fused_reference(qn3, qp3, pool3, 0.1, rows3, 2, True)
print("direct_err", err(outs[True][0][[0, 1, 4, 5]], ref3[[0, 1, 4, 5]]))
print("direct_launches", outs[True][1], outs[False][1])
print("direct_equal", int(torch.equal(outs[True][0], outs[False][0])))
print("direct_empty_zero", int(bool((outs[True][0][2:4] == 0).all())))
print("direct_partials", *sorted(str(b[0].dtype) for b in fz._fused_scratch.values()))
"""


@pytest.mark.parametrize("f16_partials", [False, True])
def test_kernel_under_the_interpreter_matches_the_reference_and_sees_a_missing_mask(f16_partials):
    pytest.importorskip("triton", reason="Triton is not importable: the kernel's interpreter run needs it")
    np = pytest.importorskip("numpy", reason="the Triton interpreter needs numpy")
    if tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 3):
        pytest.skip("Triton 3.6's interpreter fails on numpy >= 2.3 scalars; needs numpy < 2.3")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-W", "ignore", "-c", INTERPRET_SCRIPT, str(ROOT), str(int(f16_partials))]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [w for w in map(str.split, res.stdout.splitlines()) if w]
    direct = {w[0]: w[1:] if w[0] == "direct_partials" else [float(x) for x in w[1:]]
              for w in lines if w[0].startswith("direct_")}
    errs = {(w[0], w[1] if len(w) == 3 else ""): float(w[-1]) for w in lines if not w[0].startswith("direct_")}
    assert errs[("indptr", "True")] < 1.5e-2 and errs[("indptr", "False")] < 1.5e-2, errs
    assert errs[("table", "")] < 1.5e-2, errs
    assert errs[("splits", "40")] < 1.5e-2 and errs[("splits", "70")] < 1.5e-2, errs
    assert errs[("bigq", "")] < 1.5e-2, errs  # nan (f16 overflow) without the power-of-two scaling
    assert errs[("nomask", "")] > 1.5e-2, errs  # the check fails on a missing causal mask
    assert direct["direct_err"][0] < 1.5e-2, direct
    assert direct["direct_launches"] == [1.0, 2.0], direct  # one split: no combine launch
    assert direct["direct_equal"] == [1.0] and direct["direct_empty_zero"] == [1.0], direct
    # the partials the combine read: f16 when asked (the table case's scale then applied by the combine)
    assert direct["direct_partials"] == ["torch.float16" if f16_partials else "torch.float32"], direct


def test_split_count_fills_one_wave_rounded_down_or_covers_it_rounded_up():
    fz = load_fused()
    count = fz._fused_split_count
    # 264 slots (132 SMs x 2), 128 requests: down keeps one wave (256), up spills to 384
    assert count(264, 128, True) == 2 and count(264, 128, False) == 3
    assert count(264, 8, True) == count(264, 8, False) == 33  # a divisor: both the same
    assert count(264, 1000, True) == 1 and count(264, 1000, False) == 1  # never below one
    assert count(264, 1, True) == 64 and count(264, 0, False) == 64  # never above 64
    assert fz.FUSED_TUNING["small"]["splits_down"] and not fz.FUSED_TUNING["large"].get("splits_down")


def test_gluon_split_kernel_compiles_for_sm90_with_its_operands_in_place():
    """The runtime's Gluon split kernel, at each page size and scale setting (and with f16
    partials, FUSED_F16_PARTIALS), compiled for
    sm_90a with no GPU (tools/fused_aot.py --gluon): its staged FP8 tiles convert to the MMA operand layouts
    with assert_trivial (a permutation that moved data between threads fails the build), and
    the budget the plan assumes holds: no spills, three CTAs an SM by registers and shared
    memory. (The numerics are GPU tests: tests/gpu/test_fused_gpu.py.)"""
    rows = _aot_compiled("--gluon")
    assert len(rows) == 11 and sum(" part16" in line for line, *_ in rows) == 2, rows
    assert sum(" copy8" in line for line, *_ in rows) == 5 and sum(" bcast" in line for line, *_ in rows) == 3
    for line, regs, spill, smem in rows:
        assert spill == 0 and regs * 128 * 3 <= 65536 and smem * 3 <= 232448, line


def test_gluon_copies_of_eight_rows_a_warp_drop_the_slot_exchange(tmp_path):
    """FUSED_GLUON_TUNING's copy_rows 8 (not yet the default): the latent's copies cover 8
    rows a warp, the rope's layout, so a row's slot is in the same threads for both and its
    conversion is assert_trivial (the build fails otherwise). Compiled for sm_90a, that is
    three barriers and the shared round trips of the slots and their masks fewer, the rest of
    the kernel alike: the same MMAs, conversions and copies."""
    _aot_compiled("--gluon", dump=tmp_path)
    for base in ("gluon_ps1_indptr_s0", "gluon_ps64_table_s1"):
        four, eight = ((tmp_path / f"{base}{tag}.ptx").read_text() for tag in ("", "_copy8"))
        assert eight.count("bar.sync") == four.count("bar.sync") - 3, base
        assert eight.count("st.shared") < four.count("st.shared"), base
        for op in ("mma.sync", "cvt.rn.f16x2.e4m3x2", "cp.async.cg", "ldmatrix"):
            assert eight.count(op) == four.count(op) > 0, (base, op)


def test_gluon_scores_summed_in_every_warp_keep_the_softmax_in_the_warp(tmp_path):
    """FUSED_GLUON_TUNING's bcast_scores (not yet the default): the four warps' partial
    scores go through shared memory once and every warp adds all four, in the rows and keys
    of the PV's A operand, so P, the running max's rescale and the output's row factor reach
    their operands with no data moved (assert_trivial: the build fails otherwise) and the
    softmax's reductions stay in the warp. Compiled for sm_90a at the 168-register cap that
    keeps three CTAs an SM: at least 8 barriers fewer than the copy8 kernel it builds on, the
    same MMAs, conversions and copies, and the exp2s of the whole tile in each warp."""
    _aot_compiled("--gluon", dump=tmp_path)
    for base in ("gluon_ps1_indptr_s0", "gluon_ps64_table_s1"):
        split, bcast = ((tmp_path / f"{base}{tag}.ptx").read_text() for tag in ("_copy8", "_copy8_bcast"))
        assert bcast.count("bar.sync") <= split.count("bar.sync") - 8, base
        assert bcast.count("shfl.sync") < split.count("shfl.sync"), base
        assert bcast.count("ex2.approx") > split.count("ex2.approx"), base  # 16 a lane, not 4
        for op in ("mma.sync", "cvt.rn.f16x2.e4m3x2", "cp.async.cg"):
            assert bcast.count(op) == split.count(op) > 0, (base, op)


def test_combine_keeps_its_sum_over_splits_within_warps_for_f16_partials_too():
    """The combine kernel compiled for sm_90a (tools/fused_aot.py --combine) at the tiles
    fused_mla's plan picks: over f16 partials (FUSED_F16_PARTIALS) it lays its warps out as
    over fp32 ones. A tile of 512 columns (up to 16 splits) sums its splits within each
    thread, no shared memory; f16 loads of 8 values a thread had put two warps on each
    column block, and the sum crossed them through 4 KB of shared memory (GPU run 50's f16
    combine took 1.4-2.5x the fp32 one's time)."""
    rows = _aot_compiled("--combine")
    assert len(rows) == 10, rows
    by_tile = {}
    for line, regs, spill, smem in rows:
        assert spill == 0, line
        by_tile.setdefault(line.split(" partials")[0].rsplit(" ", 1)[0], []).append((smem, line))
    for tile, ((fp32, _), (f16, line)) in by_tile.items():
        assert f16 <= fp32, line
        if "x512" in tile:
            assert fp32 == 0 and f16 == 0, line


def _aot_compiled(flag, dump=None, more=()):
    """tools/fused_aot.py FLAG's report (MORE: further options), a (line, registers, spilled
    bytes, shared bytes) a compiled variant (the lines that start with FLAG's kernel name)."""
    pytest.importorskip("triton", reason="Triton is not importable: the ahead-of-time compile needs it")
    pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon (3.5 and later)")
    cmd = [sys.executable, str(ROOT / "tools" / "fused_aot.py"), flag, *more] + (["--dump", str(dump)] if dump else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    return [(line, *(int(x) for x in re.findall(r"(\d+) (?:regs|B spilled|B shared)", line)))
            for line in res.stdout.splitlines() if line.startswith(flag[2:] + " ")]


def test_gluon_kernel_launches_with_a_register_cap_only_when_its_tuning_sets_one(monkeypatch):
    """FUSED_GLUON_TUNING's maxnreg (None: the compiler's count) becomes the launch's
    maxnreg option, which four CTAs an SM need; unset, no option is passed."""
    fz = load_fused()
    geometry = (16, 1, 512, 64, True, False, torch.device("cuda", 0), {"gluon": True}, None, 32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(fz, "_fused_gluon_build", lambda: "gluon")
    monkeypatch.setattr(fz, "_fused_sm_count", lambda d: 132)
    launches = {}
    for cap in (None, 128):
        monkeypatch.setitem(fz.FUSED_GLUON_TUNING, "maxnreg", cap)
        kernel, _, n_splits, launch, rows = fz._fused_gluon_choice(geometry, (1, True, False, False))
        assert kernel == "gluon" and rows == 16 and n_splits > 1
        launches[cap] = dict(launch)
    assert "maxnreg" not in launches[None] and launches[128]["maxnreg"] == 128
    assert {k: v for k, v in launches[128].items() if k != "maxnreg"} == launches[None]
    # copy_rows: 4 by default (the layout the GPU runs timed), 8 on request
    assert launches[None]["COPY8"] is False
    monkeypatch.setitem(fz.FUSED_GLUON_TUNING, "maxnreg", None)
    monkeypatch.setitem(fz.FUSED_GLUON_TUNING, "copy_rows", 8)
    eight = dict(fz._fused_gluon_choice(geometry, (1, True, False, False))[3])
    assert eight == dict(launches[None], COPY8=True)
    # bcast_scores: off by default, BCAST on request
    assert launches[None]["BCAST"] is False
    monkeypatch.setitem(fz.FUSED_GLUON_TUNING, "bcast_scores", True)
    both = dict(fz._fused_gluon_choice(geometry, (1, True, False, False))[3])
    assert both == dict(launches[None], COPY8=True, BCAST=True)


def test_gluon_kernel_only_on_the_triton_and_gpu_it_has_run_on(monkeypatch):
    """Gluon's API moves between Triton releases and its tiles are tuned per GPU: another
    Triton version or GPU gets the Triton kernel (slower, never wrong), decided before any
    build or launch."""
    triton = pytest.importorskip("triton", reason="Triton is not importable: the Gluon build needs it")
    fz = load_fused()
    geometry = (16, 1, 512, 64, True, False, torch.device("cuda", 0), {"gluon": True}, 8, 32)
    consts = (1, True, False, False)
    built = []
    monkeypatch.setattr(fz, "_fused_gluon_build", lambda: built.append(1) or False)
    for cap, expect_build in (((8, 0), False), ((9, 0), True), ((10, 0), False)):
        built.clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert fz._fused_gluon_choice(geometry, consts) is None
        assert bool(built) == expect_build, cap
    monkeypatch.undo()
    fz._fused_gluon = None
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    assert fz._fused_gluon_build() is False


def test_wgmma_split_kernel_compiles_for_sm90_in_its_shared_memory_budget(tmp_path):
    """The 64-row warpgroup-MMA kernel (runtime part _fused_wgmma), compiled for sm_90a with no
    GPU (tools/fused_aot.py --wgmma): warpgroup MMAs in the PTX (QK and PV), no spills, and
    one CTA of 8 warps fits an SM by registers and shared memory. (Numerics: GPU tests,
    tests/gpu/test_fused_wgmma_gpu.py.)"""
    rows = _aot_compiled("--wgmma", tmp_path)
    assert len(rows) == 6 and sum(" lean:" in line for line, *_ in rows) == 1, rows
    assert sum(" part16:" in line for line, *_ in rows) == 1, rows
    for line, regs, spill, smem in rows:
        assert spill == 0 and regs * 256 <= 65536 and smem <= 232448, line
    ptx = sorted(tmp_path.glob("wgmma_*.ptx"))
    assert len(ptx) == 6
    for f in ptx:  # QK (m64n32k16: the warpgroups split the tile's 64 rows) and PV (m64n256k16)
        text = f.read_text()
        assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16" in text, f.name
        assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in text, f.name


def test_wgmma_loader_variant_compiles_for_sm90_in_the_budget_of_its_two_partitions(tmp_path):
    """The 64-row kernel with a loader warp partition (runtime part _fused_wgmma_ws),
    compiled for sm_90a with no GPU: the 8 MMA warps and the 4 loader warps share the SM's
    65,536 registers (setmaxnreg: 224 and FUSED_WS_LOADER_REGS), nothing spills, q and the
    ring of two f16 tiles fit the 232,448 bytes of shared memory, the slots are handed over
    by mbarriers, and each tile's copy is waited for whole before its conversion. (Numerics:
    GPU tests, tests/gpu/test_fused_wgmma_gpu.py.)"""
    fz = load_fused()
    dump = tmp_path / "ws"
    rows = _aot_compiled("--wgmma", dump, ["--ws"])
    assert len(rows) == 7 and all(line.startswith("wgmma ws") for line, *_ in rows), rows
    assert sum(" xchg:" in line for line, *_ in rows) == 2, rows
    for line, regs, spill, smem in rows:
        assert spill == 0 and regs * 384 <= 65536 and smem <= 232448, line
    ptx = sorted(dump.glob("wgmma_*_ws*.ptx"))
    assert len(ptx) == 7
    for f in ptx:
        text = f.read_text()
        loader = fz.FUSED_WS_LOADER_REGS
        assert f"setmaxnreg.inc.sync.aligned.u32 \t{loader};" in text, f.name
        mma = re.findall(r"setmaxnreg.dec.sync.aligned.u32 \t(\d+);", text)
        assert any(int(r) * 256 + loader * 128 <= 65536 and int(r) >= 224 for r in mma), (f.name, mma)
        assert "mbarrier.try_wait.parity" in text and "mbarrier.arrive" in text, f.name
        assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in text, f.name
        assert "cp.async.wait_group \t0;" in text and "wgmma.wait_group.sync.aligned 2;" not in text, f.name


def test_wgmma_loader_exchange_keeps_its_mma_warps_to_four_barriers_a_step(tmp_path):
    """FUSED_WGMMA_TUNING's xchg (not yet the default): the loader kernel's two MMA
    warpgroups exchange their halves' row maxima and sums through shared memory and write P
    there for the PV's wgmma (_fws_xchg), where the layout conversions of the reductions and
    of P cost 11 barriers of the MMA partition a step. Compiled for sm_90a: its partition's
    barrier (bar.sync 0, 256) at least 6 fewer times in the kernel, the same warpgroup MMAs,
    P's stores in the PTX (stmatrix) and its reads by the wgmma, within the shared memory
    (the exchange's 9 KB fit beside q and the ring). The default kernel is unchanged."""
    _aot_compiled("--wgmma", tmp_path, ["--ws"])
    plain = (tmp_path / "wgmma_h128_tq1_ps1_bn64_s2_ws.ptx").read_text()
    xchg = (tmp_path / "wgmma_h128_tq1_ps1_bn64_s2_ws_xchg.ptx").read_text()
    mma_barrier = re.compile(r"bar\.sync \t0, 256;")
    assert len(mma_barrier.findall(xchg)) <= len(mma_barrier.findall(plain)) - 6
    assert xchg.count("wgmma.mma_async") == plain.count("wgmma.mma_async") > 0
    assert "stmatrix" in xchg and "stmatrix" not in plain
    loader = re.compile(r"bar\.sync \t2, 128;")  # the loader's own, untouched
    assert len(loader.findall(xchg)) == len(loader.findall(plain)) > 0


def test_wgmma_loader_variant_by_default_and_the_plain_kernel_where_asked_or_it_fails(monkeypatch):
    """The loader-partition kernel serves by default, with its own constants (no FP8 stages
    or lean barriers: a ring of two tiles); "wg_ws": False, or a loader kernel that does not
    build, gets the plain 64-row kernel."""
    pytest.importorskip("triton", reason="Triton is not importable: the Gluon build needs it")
    fz = load_fused()
    dev = torch.device("cuda", 0)
    consts = (1, True, False, False, False, 128, 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(fz, "_fused_wgmma_build", lambda: "committed")
    monkeypatch.setattr(fz, "_fused_wgmma_ws_build", lambda: "loader")
    monkeypatch.setattr(fz, "_fused_sm_count", lambda d: 132)
    for cfg, want in (({"wgmma": True}, "loader"), ({"wgmma": True, "wg_ws": False}, "committed"),
                      ({"wgmma": True, "loader_fails": True}, "committed"), ({"wgmma": True, "wg_xchg": True}, "loader")):
        monkeypatch.setattr(fz, "_fused_wgmma_ws_build", lambda c=cfg: not c.get("loader_fails") and "loader")
        kernel, _, _, launch, rows = fz._fused_wgmma_choice((128, 512, 64, True, False, dev, cfg, None, 8), consts)
        launch = dict(launch)
        assert kernel == want and rows == 64, cfg
        if want == "loader":
            assert "STAGES" not in launch and "LEAN" not in launch
            assert launch["LOADER_REGS"] == fz.FUSED_WS_LOADER_REGS
            assert launch["XCHG"] is bool(cfg.get("wg_xchg"))  # the exchange only when asked
        else:
            assert "LOADER_REGS" not in launch and "XCHG" not in launch and launch["STAGES"] >= 1


def test_wgmma_split_count_fills_the_last_wave():
    """"fill": the fewest splits whose grid fills its last wave of CTAs 90%, not the
    rounded-up count that ran 1.45 waves at 128 heads x 32 x 4k (GPU run 50)."""
    fz = load_fused()
    for programs, fill, up in ((64, 2, 3), (16, 8, 9), (8, 15, 17), (32, 4, 5), (70, 7, 2), (132, 1, 1),
                               (2, 60, 64), (1, 64, 64), (0, 64, 64)):
        assert fz._fused_wgmma_splits(132, programs, "fill") == fill, programs
        assert fz._fused_wgmma_splits(132, programs, "up") == up, programs
        ctas = max(1, programs) * fill
        assert ctas / (132 * -(-ctas // 132)) >= fz.FUSED_WGMMA_FILL or fill == 64


def test_wgmma_kernel_only_when_asked_at_64_rows_on_the_triton_and_gpu_it_has_run_on(monkeypatch):
    """The 64-row kernel serves a call only with at least 64 query rows a request, on SM 9.0,
    the Triton version its Gluon code was built against, and while off by default only
    where a config asks for it; anything else keeps the Triton kernel, decided before any
    build or launch."""
    triton = pytest.importorskip("triton", reason="Triton is not importable: the Gluon build needs it")
    fz = load_fused()
    dev = torch.device("cuda", 0)
    consts = (1, True, False, False, False, 128, 1)
    built = []
    monkeypatch.setattr(fz, "_fused_wgmma_build", lambda: built.append(1) or False)
    monkeypatch.setattr(fz, "_fused_wgmma_ws_build", lambda: built.append(1) or False)
    for rows, cfg, cap, expect_build in ((128, {"wgmma": True}, (9, 0), True), (32, {"wgmma": True}, (9, 0), False),
                                         (128, {"wgmma": True}, (8, 0), False), (128, {"wgmma": True}, (10, 0), False),
                                         (128, {}, (9, 0), fz.FUSED_WGMMA_DEFAULT)):
        built.clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert fz._fused_wgmma_choice((rows, 512, 64, True, False, dev, cfg, None, 8), consts) is None
        assert bool(built) == expect_build, (rows, cfg, cap)
    monkeypatch.undo()
    fz._fused_wgmma = None
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    assert fz._fused_wgmma_build() is False
    fz._fused_wgmma = None


def test_auto_takes_the_64_row_kernel_only_for_the_shapes_measured_faster(monkeypatch):
    """auto: the fused path for at most 16 query rows a request, and for the shapes the
    loader-partition 64-row kernel was measured faster than the gather at every batch, while
    it is on and builds; shapes never timed (32 heads x 2, 16 x 6) and unmeasured GPUs
    gather."""
    fz = load_fused()
    monkeypatch.setattr(fz, "_fused_wgmma_ws_build", lambda: True)
    monkeypatch.setattr(fz, "FUSED_WGMMA_DEFAULT", True)
    h100 = (9, 0)
    for heads, tq, want in ((16, 1, True), (8, 2, True), (16, 4, True), (16, 8, True), (128, 1, True),
                            (64, 1, True), (32, 2, False), (16, 6, False)):
        assert fz._fused_auto(h100, heads, tq) is want, (heads, tq)
    assert not fz._fused_auto((10, 0), 16, 4) and not fz._fused_auto((10, 0), 16, 1)
    monkeypatch.setattr(fz, "_fused_wgmma_ws_build", lambda: False)  # another Triton: no loader kernel
    assert not fz._fused_auto(h100, 128, 1) and fz._fused_auto(h100, 16, 1)
    monkeypatch.setattr(fz, "_fused_wgmma_ws_build", lambda: True)
    monkeypatch.setitem(fz.FUSED_WGMMA_TUNING, "ws", False)  # the plain kernel: slower than the gather
    assert not fz._fused_auto(h100, 128, 1)
    monkeypatch.setitem(fz.FUSED_WGMMA_TUNING, "ws", True)
    monkeypatch.setattr(fz, "FUSED_WGMMA_DEFAULT", False)
    assert not fz._fused_auto(h100, 16, 4)
