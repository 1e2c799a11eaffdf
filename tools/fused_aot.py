#!/usr/bin/env python3
"""Compile the fused FP8 MLA kernel for sm_90a here, with no GPU: registers, spills, shared memory.

    python tools/fused_aot.py [--heads 16] [--tq 1] [--configs "BM,BN,WARPS,STAGES,MAXNREG;..."]
    python tools/fused_aot.py --gluon    # the Gluon split kernel (runtime part _fused_gluon)
    python tools/fused_aot.py --combine  # the combine kernel over fp32 and f16 partials

Triton compiles ahead of time for a target it is told (GPUTarget("cuda", 90, 32)), and the
ptxas that its wheel carries reports what the kernel uses; the occupancy follows (registers
and shared memory per SM of an H100/H200). A configuration that spills, or fits fewer
CTAs than planned, is found here before any device minute is spent. --dump DIR keeps the
TTGIR and PTX of each configuration (is a load pipelined: async_copy_global_to_local).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SM_REGS, SM_SMEM = 65536, 232448  # per SM on sm_90 (H100 / H200)
TYPES = {"q_nope": "*bf16", "q_pe": "*bf16", "kv": "*fp8e4nv", "table": "*i32", "lens": "*i32",
         "part_o": "*fp32", "part_lse": "*fp32", "ckv_scale": "*fp32", "kpe_scale": "*fp32", "sm_scale": "fp32"}
# --f16/--pv-asm/--v-early/--qk-acc/--direct/--part16 (DIRECT: one split, the output written in
# place; PART16: f16 partials, FUSED_F16_PARTIALS; --gluon and --wgmma compile it both ways)
FLAGS = {"F16": True, "PV_ASM": False, "V_EARLY": False, "QK_ACC": 1, "DIRECT": False, "PART16": False}
DEFAULT = "16,64,4,2,0;16,32,4,2,168;16,32,8,2,0"


def _fused():
    sys.path.insert(0, str(ROOT))
    from kvpatch.runtime import load_template

    return load_template("_kvpatch_fused_aot")


def _types(const):
    """The argument types: part_o is the bf16 output at one split (DIRECT), else the partials."""
    if const.get("DIRECT"):
        return dict(TYPES, part_o="*bf16")
    return dict(TYPES, part_o="*fp16") if const.get("PART16") else TYPES


def _signature(kernel, const, types):
    """(signature, attributes) of a compile: the constexprs, each argument's type (an int
    where types has none), and what the launcher specialises on at run time: 16-byte aligned
    pointers and strides."""
    names = list(kernel.arg_names)
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in const and (sig[n].startswith("*") or n.startswith("stride"))}
    return sig, attrs


def compile_one(kernel, heads, tq, bm, bn, warps, stages, maxnreg, dump=None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = dict(H=heads, TQ=tq, D=512, DPE=64, PS=1, BY_INDPTR=True, CAUSAL=tq > 1, HAS_CKV_SCALE=False,
                 HAS_KPE_SCALE=False, BLOCK_M=bm, BLOCK_N=bn, DOT_F32=False, **FLAGS)
    sig, attrs = _signature(kernel, const, _types(const))
    opts = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    k = triton.compile(ASTSource(kernel, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    regs, spill = _ptxas(k.asm["ptx"], maxnreg)
    _dump(dump, f"h{heads}_tq{tq}_bm{bm}_bn{bn}_w{warps}_s{stages}_r{maxnreg or 0}", k)
    smem = int(k.metadata.shared)
    ctas = min(SM_REGS // (regs * 32 * warps), SM_SMEM // max(smem, 1))
    pipelined = k.asm["ttgir"].count("async_copy_global_to_local")
    return dict(regs=regs, spill=spill, smem=smem, ctas_per_sm=ctas, async_copies=pipelined)


def compile_gluon(ps, by_indptr, scales, dump=None, part16=False, copy_rows=None, bcast=None, maxnreg=None):
    """The runtime's Gluon split kernel (runtime part _fused_gluon) for sm_90a: registers,
    spills, shared memory. Its operand layout conversions are assert_trivial: a layout that
    would move data between threads fails here, not on a device. copy_rows, bcast: the
    tuning's copy_rows (4 or 8) and bcast_scores, its own by default; maxnreg: a register cap."""
    rt = _fused()
    kernel = rt._fused_gluon_build()
    tune = rt.FUSED_GLUON_TUNING
    rows = copy_rows or tune["copy_rows"]
    bcast = tune["bcast_scores"] if bcast is None else bcast
    const = dict(H=16, D=512, DPE=64, PS=ps, BY_INDPTR=by_indptr, HAS_CKV_SCALE=scales, HAS_KPE_SCALE=scales,
                 BLOCK_N=tune["block_n"], STAGES=tune["num_stages"], PART16=part16, COPY8=rows == 8,
                 BCAST=bool(bcast))
    tag = (f"gluon_ps{ps}_{'indptr' if by_indptr else 'table'}_s{int(scales)}{'_p16' if part16 else ''}"
           f"{'_copy8' if rows == 8 else ''}{'_bcast' if bcast else ''}")
    return _compile_gluon_kernel(kernel, const, tune["num_warps"], tag, dump, maxnreg)


def _compile_gluon_kernel(kernel, const, num_warps, tag, dump, maxnreg=None):
    """A Gluon kernel compiled for sm_90a with the launcher's specialisation (16-byte aligned
    pointers and strides): its registers, spills and shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig, attrs = _signature(kernel, const, _types(const))
    k = triton.compile(GluonASTSource(kernel, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})})
    _dump(dump, tag, k)
    regs, spill = _ptxas(k.asm["ptx"], maxnreg)
    return dict(regs=regs, spill=spill, smem=int(k.metadata.shared))


def _dump(dump, tag, k):
    """Keep a compiled kernel's TTGIR and PTX under dump/ (to compare two versions' code)."""
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        (Path(dump) / f"{tag}.ttgir").write_text(k.asm["ttgir"])
        (Path(dump) / f"{tag}.ptx").write_text(k.asm["ptx"])


def compile_wgmma(ps, by_indptr, scales, heads=128, tq=1, block_n=None, stages=None, dump=None, lean=None,
                  part16=False, ws=False, xchg=None):
    """The 64-row warpgroup-MMA split kernel (runtime part _fused_wgmma) for sm_90a; ws: its
    variant with a loader partition (runtime part _fused_wgmma_ws), the default since
    runtime 13. The constants mirror _fused_wgmma_choice's launch (no GPU here to ask it
    for them)."""
    rt = _fused()
    kernel = rt._fused_wgmma_ws_build() if ws else rt._fused_wgmma_build()
    tune = rt.FUSED_WGMMA_TUNING
    const = dict(H=heads, TQ=tq, D=512, DPE=64, PS=ps, BY_INDPTR=by_indptr, CAUSAL=tq > 1, HAS_CKV_SCALE=scales,
                 HAS_KPE_SCALE=scales, BLOCK_N=block_n or tune["block_n"], STAGES=stages or tune["num_stages"],
                 DIRECT=FLAGS["DIRECT"], LEAN=tune["lean"] if lean is None else lean, PART16=part16)
    if ws:
        del const["STAGES"], const["LEAN"]
        const.update(LOADER_REGS=rt.FUSED_WS_LOADER_REGS,
                     XCHG=bool(tune["xchg"] if xchg is None else xchg))
    tag = (f"wgmma_h{heads}_tq{tq}_ps{ps}_bn{const['BLOCK_N']}_s{const.get('STAGES', 2)}"
           f"{'_lean' if const.get('LEAN') else ''}{'_ws' if ws else ''}{'_xchg' if const.get('XCHG') else ''}"
           f"{'_direct' if const['DIRECT'] else ''}{'_p16' if part16 else ''}")
    return _compile_gluon_kernel(kernel, const, tune["num_warps"], tag, dump)


def compile_combine(n_splits, part16, dump=None):
    """The combine kernel (runtime part _fused_kernels) at the tile fused_mla's plan picks for
    n_splits, over fp32 or f16 partials (FUSED_F16_PARTIALS): its registers, spills and
    shared memory (shared memory: a sum over splits that crosses warps)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rt = _fused()
    kernel = rt._fused_build()[1]
    sb, db = rt._fused_combine_tile(n_splits, 512)
    const = dict(H=16, TQ=1, D=512, PS=1, BY_INDPTR=True, BLOCK_N=64, SB=sb, DB=db, APPLY_CKV=part16)
    types = dict(part_o="*fp16" if part16 else "*fp32", part_lse="*fp32", lens="*i32", out="*bf16",
                 ckv_scale="*fp32")
    sig, attrs = _signature(kernel, const, types)
    k = triton.compile(ASTSource(kernel, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4})
    _dump(dump, f"combine_s{n_splits}{'_p16' if part16 else ''}", k)
    regs, spill = _ptxas(k.asm["ptx"])
    return dict(regs=regs, spill=spill, smem=int(k.metadata.shared), sb=sb, db=db)


def _ptxas(ptx, maxnreg=None):
    """(registers, spilled bytes) that the ptxas Triton's wheel carries reports for sm_90a."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        cmd = [str(ptxas), "-v", "--gpu-name", "sm_90a", str(Path(tmp) / "k.ptx"), "-o", str(Path(tmp) / "k.o")]
        report = subprocess.run(cmd + (["--maxrregcount", str(maxnreg)] if maxnreg else []),
                                capture_output=True, text=True).stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    return regs, int(re.search(r"(\d+) bytes spill stores", report).group(1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tq", type=int, default=1)
    ap.add_argument("--configs", default=DEFAULT, help="BM,BN,WARPS,STAGES,MAXNREG (0: no cap); ';' between")
    ap.add_argument("--dump", default=None)
    for flag in FLAGS:
        ap.add_argument("--" + flag.lower().replace("_", "-"), type=int, default=int(FLAGS[flag]))
    ap.add_argument("--gluon", action="store_true", help="the runtime's Gluon split kernel instead, every variant")
    ap.add_argument("--wgmma", action="store_true", help="the 64-row warpgroup-MMA kernel, every variant")
    ap.add_argument("--ws", action="store_true", help="with --wgmma: its variant with a loader partition")
    ap.add_argument("--combine", action="store_true", help="the combine kernel at several split counts")
    args = ap.parse_args(argv)
    for flag in FLAGS:
        FLAGS[flag] = getattr(args, flag.lower()) if flag in ("V_EARLY", "QK_ACC") else bool(getattr(args, flag.lower()))
    if args.wgmma:
        # After the first four: the LEAN variant (two barriers a step, not four), f16 partials
        # (PART16) and, with --ws, the softmax's exchange (xchg, _fws_xchg); none the default
        for ps, by_indptr, scales, heads, tq, lean, p16, xchg in (
                (1, True, False, 128, 1, None, False, False), (64, False, True, 128, 1, None, False, False),
                (1, True, False, 16, 4, None, False, False), (16, False, False, 16, 8, None, False, False),
                (1, True, False, 128, 1, True, False, False), (64, False, True, 128, 1, None, True, False),
                (1, True, False, 128, 1, None, False, True), (16, False, True, 16, 8, None, True, True)):
            if args.ws and lean or xchg and not args.ws:
                continue
            r = compile_wgmma(ps, by_indptr, scales, heads, tq, dump=args.dump, lean=lean, part16=p16, ws=args.ws,
                              xchg=xchg)
            print(f"wgmma{' ws' if args.ws else ''} heads {heads} tq {tq} page size {ps} "
                  f"{'kv_indptr' if by_indptr else 'page table'} "
                  f"scales {scales}{' lean' if lean else ''}{' part16' if p16 else ''}{' xchg' if xchg else ''}: "
                  f"{r['regs']} regs, {r['spill']} B spilled, {r['smem']} B shared", flush=True)
        return 0
    if args.combine:
        # Split counts of the table's shapes: 128h 32 x 4k, 128h 8 x 4k, 16h 32 x 4k, 8 x 4k, 1 x 4k
        for n_splits in (2, 8, 12, 49, 64):
            for p16 in (False, True):
                r = compile_combine(n_splits, p16, args.dump)
                print(f"combine splits {n_splits} tile {r['sb']}x{r['db']} {'f16' if p16 else 'fp32'} partials: "
                      f"{r['regs']} regs, {r['spill']} B spilled, {r['smem']} B shared", flush=True)
        return 0
    if args.gluon:
        # After the first five: f16 partials (PART16), copies of 8 rows a warp (copy_rows 8),
        # and with them the scores summed in every warp (bcast_scores, at the 168-register cap
        # three CTAs an SM need: 184 uncapped; with copies of 4 rows it spills 4 B there);
        # none the default
        for ps, by_indptr, scales, p16, rows, bcast in (
                (1, True, False, False, 4, False), (16, True, False, False, 4, False),
                (1, False, True, False, 4, False), (16, False, False, False, 4, False),
                (64, False, True, False, 4, False), (64, False, True, True, 4, False),
                (1, True, False, False, 8, False), (64, False, True, False, 8, False),
                (1, True, False, False, 8, True), (64, False, True, False, 8, True),
                (64, False, True, True, 8, True)):
            cap = _fused().FUSED_GLUON_BCAST_MAXNREG if bcast else None
            r = compile_gluon(ps, by_indptr, scales, args.dump, p16, rows, bcast, cap)
            print(f"gluon page size {ps} {'kv_indptr' if by_indptr else 'page table'} scales {scales}"
                  f"{' part16' if p16 else ''}{' copy8' if rows == 8 else ''}"
                  f"{f' bcast maxnreg {cap}' if bcast else ''}: "
                  f"{r['regs']} regs, {r['spill']} B spilled, {r['smem']} B shared", flush=True)
        return 0
    try:
        kernel = _fused()._fused_build()[0]
    except TypeError:
        print("fused_aot: Triton is not installed", file=sys.stderr)
        return 2
    for text in args.configs.split(";"):
        bm, bn, warps, stages, reg = (int(x) for x in text.split(","))
        r = compile_one(kernel, args.heads, args.tq, bm, bn, warps, stages, reg or None, args.dump)
        print(f"heads {args.heads} tq {args.tq} block_m {bm} block_n {bn} warps {warps} stages {stages} "
              f"maxnreg {reg or '-'} {FLAGS}: {r['regs']} regs, {r['spill']} B spilled, {r['smem']} B shared, "
              f"{r['ctas_per_sm']} CTAs/SM, {r['async_copies']} pipelined loads", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
