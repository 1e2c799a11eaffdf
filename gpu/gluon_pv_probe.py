"""The PV product read straight from FP8 shared memory, no 16-bit restaging: a Gluon probe.

ncu (GPU run 34, notes/gpu-runs.md) puts the fused kernel at half the shared-memory pipe, and
V's path is the largest part of its traffic: the mma operand must be paired along KV
positions, Hopper's ldmatrix cannot transpose 8-bit values, so Triton converts each FP8 tile
to f16, stores it back to shared memory and reads it again with ldmatrix.trans (~20 of the
~47 shared wavefronts a row). Gluon (Triton's explicit-layout dialect, triton.experimental.gluon)
lets a kernel choose its register layouts. Here each thread reads 4 consecutive bytes of a V
row with one 32-bit shared load, converts them in registers, and hands them to mma.sync as the
B operand without any data movement: the layout it loads in (`PHYS`) is the MMA's own operand
layout with the output columns permuted (the two low bits of a thread's 4 bytes are the MMA
layout's two register bits of N). The permutation is undone where the output is stored.

Two kernels, the same work (O[16, 512] += P[16, BN] V[BN, 512] over each program's rows of a
gathered FP8 pool, the PV stage of MLA decode at 16 heads): the Gluon kernel, and the same loop
in Triton (the committed kernel's PV path: inline cvt, tl.dot). Checked against an fp32
reference on the same rows (and a sabotaged permutation must fail it); timed in the same run.

    python gpu/gluon_pv_probe.py            # on a GPU: check, sabotage, time
    python gpu/gluon_pv_probe.py --ptx      # no GPU needed: compile for sm_90a, count instructions
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# pool row bytes, latent width, one chunk, heads (module constexprs: kernels read them)
ROW, D, C, H = tl.constexpr(576), tl.constexpr(512), tl.constexpr(128), tl.constexpr(16)


@gluon.jit
def _chunk_pv(v_s, p, acc, PHYS: gl.constexpr, B_L: gl.constexpr, BN: gl.constexpr, SABOTAGE: gl.constexpr):
    v = v_s.load(PHYS).to(gl.float16)
    if SABOTAGE:  # the columns taken in the wrong order: the check must fail
        v = v.reshape([BN, 4, 8, 4]).permute([0, 3, 2, 1]).reshape([BN, C])
        v = gl.convert_layout(v, B_L)
    else:
        # Physical column 32 w + 4 i + r (w: warp, i: lane group, r: the thread's byte)
        # is the MMA's logical column 32 r + 8 w + i: a register-only reinterpretation.
        v = v.reshape([BN, 4, 8, 4]).permute([0, 3, 1, 2]).reshape([BN, C])
        v = gl.convert_layout(v, B_L, assert_trivial=True)
    return mma_v2(p, v, acc)


@gluon.jit
def gluon_pv(p_ptr, pool, idx, out, rows_per_prog, BN: gl.constexpr, SABOTAGE: gl.constexpr,
             STAGES: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    b_l: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    cp_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # 16-byte cp.async
    sw: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [1, 0])  # 0 bank conflicts for PHYS
    PHYS: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0], [16, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]],
        warp_bases=[[0, 32], [0, 64]], block_bases=[], shape=[BN, C])
    pid = gl.program_id(0)
    lo = pid * rows_per_prog
    v_s = gl.allocate_shared_memory(gl.float8e4nv, [4 * STAGES, BN, C], sw)  # STAGES x 4 chunks
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, cp_l))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, cp_l))
    pr = gl.arange(0, H, layout=gl.SliceLayout(1, a_l))
    pc = gl.arange(0, BN, layout=gl.SliceLayout(0, a_l))
    p = gl.load(p_ptr + pr[:, None] * BN + pc[None, :])
    acc0 = gl.zeros([H, C], gl.float32, mma)
    acc1 = gl.zeros([H, C], gl.float32, mma)
    acc2 = gl.zeros([H, C], gl.float32, mma)
    acc3 = gl.zeros([H, C], gl.float32, mma)
    n_steps = rows_per_prog // BN
    # Prologue: STAGES - 1 steps' rows in flight before the first MMA.
    for t in gl.static_range(STAGES - 1):
        rr = t * BN + r
        slot = gl.load(idx + lo + rr, mask=rr < rows_per_prog, other=0).to(gl.int64)
        row = pool + slot[:, None] * ROW + c[None, :]
        for j in gl.static_range(4):
            async_copy.async_copy_global_to_shared(v_s.index(t * 4 + j), row + j * C,
                                                   mask=(rr < rows_per_prog)[:, None])
        async_copy.commit_group()
    # The indices one step further ahead than the rows: a step's copies are issued without
    # waiting on a global load.
    ahead = (STAGES - 1) * BN + r
    nidx = gl.load(idx + lo + ahead, mask=ahead < rows_per_prog, other=0)
    for s in range(n_steps):
        cur = (s % STAGES) * 4
        nxt = ((s + STAGES - 1) % STAGES) * 4  # the buffer step s - 1 read (all warps past it)
        rr = (s + STAGES - 1) * BN + r
        row = pool + nidx.to(gl.int64)[:, None] * ROW + c[None, :]
        for j in gl.static_range(4):
            async_copy.async_copy_global_to_shared(v_s.index(nxt + j), row + j * C,
                                                   mask=(rr < rows_per_prog)[:, None])
        async_copy.commit_group()
        ahead = (s + STAGES) * BN + r
        nidx = gl.load(idx + lo + ahead, mask=ahead < rows_per_prog, other=0)
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        acc0 = _chunk_pv(v_s.index(cur), p, acc0, PHYS, b_l, BN, SABOTAGE)
        acc1 = _chunk_pv(v_s.index(cur + 1), p, acc1, PHYS, b_l, BN, SABOTAGE)
        acc2 = _chunk_pv(v_s.index(cur + 2), p, acc2, PHYS, b_l, BN, SABOTAGE)
        acc3 = _chunk_pv(v_s.index(cur + 3), p, acc3, PHYS, b_l, BN, SABOTAGE)
        gl.thread_barrier()  # every warp done with `cur` before a later step refills it
    async_copy.wait_group(0)
    # The accumulators back in the physical column order (a reinterpretation), then one
    # shared-memory round trip to a coalesced layout: stored as contiguous rows.
    st_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    orow = gl.arange(0, H, layout=gl.SliceLayout(1, st_l))
    oc = gl.arange(0, C, layout=gl.SliceLayout(0, st_l))
    dst = out + (pid * H + orow)[:, None] * D + oc[None, :]
    gl.store(dst, _physical(acc0, st_l))
    gl.store(dst + C, _physical(acc1, st_l))
    gl.store(dst + 2 * C, _physical(acc2, st_l))
    gl.store(dst + 3 * C, _physical(acc3, st_l))


@gluon.jit
def _physical(acc, layout: gl.constexpr):
    # logical n = 32 r + 8 w + i  ->  physical 32 w + 4 i + r
    acc = acc.reshape([H, 4, 4, 8]).permute([0, 2, 3, 1]).reshape([H, C])
    return gl.convert_layout(acc, layout)


@triton.jit
def triton_pv(p_ptr, pool, idx, out, rows_per_prog, BN: tl.constexpr):
    pid = tl.program_id(0)
    lo = pid * rows_per_prog
    r = tl.arange(0, BN)
    c = tl.arange(0, C)
    hh = tl.arange(0, H)
    p = tl.load(p_ptr + hh[:, None] * BN + r[None, :])
    acc0 = tl.zeros([H, C], tl.float32)
    acc1 = tl.zeros([H, C], tl.float32)
    acc2 = tl.zeros([H, C], tl.float32)
    acc3 = tl.zeros([H, C], tl.float32)
    for s in range(lo, lo + rows_per_prog, BN):
        row = pool + tl.load(idx + s + r).to(tl.int64)[:, None] * ROW + c[None, :]
        acc0 = tl.dot(p, _cvt(tl.load(row)), acc0)
        acc1 = tl.dot(p, _cvt(tl.load(row + C)), acc1)
        acc2 = tl.dot(p, _cvt(tl.load(row + 2 * C)), acc2)
        acc3 = tl.dot(p, _cvt(tl.load(row + 3 * C)), acc3)
    dst = out + (pid * H + hh)[:, None] * D + c[None, :]
    tl.store(dst, acc0)
    tl.store(dst + C, acc1)
    tl.store(dst + 2 * C, acc2)
    tl.store(dst + 3 * C, acc3)


@triton.jit
def gather_read(pool32, idx, out, rows_per_prog, BN: tl.constexpr, WORDS: tl.constexpr, WP: tl.constexpr):
    """Reads each program's rows (WORDS int32 a row, through idx) and keeps a XOR of them: the
    rate at which this GPU reads randomly gathered rows, the floor that counts for a kernel
    that must read them (a streaming copy's rate is higher)."""
    pid = tl.program_id(0)
    lo = pid * rows_per_prog
    r = tl.arange(0, BN)
    w = tl.arange(0, WP)  # WORDS padded to a power of two
    x = tl.zeros([BN, WP], tl.int32)
    for s in range(lo, lo + rows_per_prog, BN):
        slot = tl.load(idx + s + r).to(tl.int64)
        x ^= tl.load(pool32 + slot[:, None] * WORDS + w[None, :], mask=w[None, :] < WORDS, other=0)
    tl.store(out + pid * WP + w, tl.xor_sum(x, 0))


@triton.jit
def _cvt(x):  # the committed kernel's PV conversion (runtime part _fused_ops, pv_asm)
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


def ptx_counts():
    """Compile the Gluon kernel for sm_90a here (no GPU) and count its instructions."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"p_ptr": "*fp16", "pool": "*fp8e4nv", "idx": "*i32", "out": "*fp32", "rows_per_prog": "i32",
           "BN": "constexpr", "SABOTAGE": "constexpr", "STAGES": "constexpr"}
    src = GluonASTSource(gluon_pv, sig, constexprs={"BN": 32, "SABOTAGE": False, "STAGES": 3},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(5)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
    pat = r"^\s*((?:ld|st)\.shared[.\w]*|ldmatrix[.\w]*|mma[.\w]*|cvt\.rn\.f16x2\.e4m3x2|cp\.async[.\w]*|bar\.sync)"
    return collections.Counter(m.group(1) for m in re.finditer(pat, k.asm["ptx"], re.M)), k.metadata.shared


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ptx", action="store_true", help="compile for sm_90a and count instructions (no GPU)")
    args = ap.parse_args(argv)
    if args.ptx:
        counts, smem = ptx_counts()
        print(f"gluon_pv, one CTA's loop (BN 32, 3 stages): shared {smem} B; " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
        return 0
    import torch
    from triton.testing import do_bench

    if not torch.cuda.is_available():
        print("gluon_pv_probe: no CUDA device (--ptx compiles without one)", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    slots, bn = 495552, 32
    row_b, d, h = ROW.value, D.value, H.value
    pool = (torch.randn((slots, row_b), device="cuda", generator=gen) * 2).to(torch.float8_e4m3fn)
    p = torch.rand((h, bn), device="cuda", generator=gen).to(torch.float16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ok_all = True
    for rows, progs in ((4096, 1), (131072, 2 * sms), (131072, 4 * sms), (131072, 8 * sms), (262144, 4 * sms)):
        per = -(-rows // progs // bn) * bn
        idx = torch.randperm(slots, device="cuda", generator=gen)[:per * progs].to(torch.int32)
        v = pool[idx.long(), :d].float().view(progs, per // bn, bn, d)
        ref = torch.einsum("hk,sjkd->shd", p.float(), v)  # [progs, 16, 512]
        outs = {}
        for name, launch in (
            ("gluon", lambda o: gluon_pv[(progs,)](p, pool, idx, o, per, BN=bn, SABOTAGE=False, STAGES=2, num_warps=4)),
            ("gluon3", lambda o: gluon_pv[(progs,)](p, pool, idx, o, per, BN=bn, SABOTAGE=False, STAGES=3, num_warps=4)),
            ("gluon4", lambda o: gluon_pv[(progs,)](p, pool, idx, o, per, BN=bn, SABOTAGE=False, STAGES=4, num_warps=4)),
            ("triton", lambda o: triton_pv[(progs,)](p, pool, idx, o, per, BN=bn, num_warps=4, num_stages=2)),
        ):
            o = torch.empty((progs, h, d), device="cuda")
            ck = launch(o)
            err = ((o - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
            us = do_bench(lambda: launch(o), warmup=5, rep=40) * 1e3
            outs[name] = (us, err, getattr(ck, "n_regs", "?"))
        o = torch.empty((progs, h, d), device="cuda")
        gluon_pv[(progs,)](p, pool, idx, o, per, BN=bn, SABOTAGE=True, STAGES=2, num_warps=4)
        sab = ((o - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        ok = all(x[1] < 1e-3 for x in outs.values()) and sab > 1e-1
        ok_all &= ok
        floor = rows * d / 3.0e12 * 1e6
        print(f"{rows:7d} rows, {progs:4d} programs: gluon 2/3/4 stages {outs['gluon'][0]:6.1f} / "
              f"{outs['gluon3'][0]:6.1f} / {outs['gluon4'][0]:6.1f} us (err {max(outs[k][1] for k in outs):.1e}) "
              f"| triton {outs['triton'][0]:6.1f} us | regs {outs['gluon3'][2]} / {outs['triton'][2]} | best gluon / "
              f"triton {min(outs[k][0] for k in ('gluon', 'gluon3', 'gluon4')) / outs['triton'][0]:.2f}x | sabotaged permutation err {sab:.2f} | "
              f"floor ~{floor:.1f} us at 3 TB/s | {'OK' if ok else 'FAILED'}", flush=True)
    # The gather floor: the same random rows read and nothing else (576 B a row, and the 512
    # B a row the PV stage reads), against the streaming-copy rate the floors above assume.
    pool32 = pool.view(torch.int32)
    for rows, progs in ((131072, 2 * sms), (131072, 4 * sms), (262144, 4 * sms)):
        per = -(-rows // progs // bn) * bn
        idx = torch.randperm(slots, device="cuda", generator=gen)[:per * progs].to(torch.int32)
        o = torch.empty((progs, 256), dtype=torch.int32, device="cuda")
        res = []
        for words in (row_b // 4, d // 4):
            src = pool32 if words == row_b // 4 else pool32[:, : d // 4]
            if words != row_b // 4:
                src = src.contiguous()  # a 512-B row pool, the PV stage's bytes only
            us = do_bench(lambda: gather_read[(progs,)](src, idx, o, per, BN=bn, WORDS=words,
                                                             WP=triton.next_power_of_2(words), num_warps=4),
                          warmup=5, rep=40) * 1e3
            res.append((us, rows * words * 4 / us / 1e6))
        print(f"gather floor, {rows} rows, {progs} programs: 576 B rows {res[0][0]:6.1f} us ({res[0][1]:.2f} TB/s); "
              f"512 B rows {res[1][0]:6.1f} us ({res[1][1]:.2f} TB/s)", flush=True)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
