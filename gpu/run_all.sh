#!/usr/bin/env bash
# One device call: install the carried wheels, then runtime GPU tests, the
# gather-kernel benchmark, verify on the patched real checkouts, the verify GPU
# tests (sabotage included) and the attention benchmark. Logs go to $OUT.
# Usage (device machine, repo root): bash gpu/run_all.sh [steps...]
#
# The device tool brings back at most 8 files from $OUT (GPU run 44 lost its verify
# files that way): the steps write to a folder of their own, packed on exit (a timeout's
# SIGTERM too) into one $OUT/run_all-<steps>.tgz, and copied beside it as well while
# $OUT then holds at most 8 files.
set -uo pipefail
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
OUT=$(mktemp -d /tmp/run_all.XXXXXX); export OUT
pack() {
  local name; name=run_all-$(echo "${steps:-none}" | tr -cs 'A-Za-z0-9_' '-' | sed 's/-$//').tgz
  tar -czf "$FINAL/$name" -C "$OUT" . 2>/dev/null
  if [ $(( $(find "$FINAL" -type f | wc -l) + $(find "$OUT" -type f | wc -l) )) -le 8 ]; then
    cp -r "$OUT"/. "$FINAL"/
  fi
  echo "=== logs: $FINAL/$name"
}
trap pack EXIT
trap 'exit 143' TERM INT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || { echo "wheel install failed"; exit 1; }
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1 FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
export FLASHINFER_WORKSPACE_BASE=$PWD/.fi_cache PYTHONUNBUFFERED=1
# GitPython by find_spec: importing it also wants a git binary, which a step may not need.
python3 -c "import importlib.util as u, libcst, click, flashinfer; assert u.find_spec('git')" 2>/dev/null \
  || { echo "the carried .whl lacks a wheel (libcst, click, GitPython, flashinfer): run gpu/fetch_wheels.sh here first"; exit 1; }
steps=${*:-"info rt_tests gather verify vtests attention"}
rc=0
for s in $steps; do
  echo "=== $s $(date +%T)"
  WS_HUNG=$([ -e /tmp/kvpatch_ws_hung ] && echo 1)
  XCHG_HUNG=$([ -e /tmp/kvpatch_xchg_hung ] && echo 1)
  # the GPU tests a hung probe leaves out (pytest takes one -k expression)
  HUNG_K=$(echo "${WS_HUNG:+not wgmma_loader}${WS_HUNG:+${XCHG_HUNG:+ and }}${XCHG_HUNG:+not xchg}")
  case $s in
    info) nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv;
          python3 -c "import torch, triton, flashinfer; print(torch.__version__, triton.__version__, flashinfer.__version__, torch.cuda.get_device_name())" ;;
    rt_tests) python3 -m pytest -q -ra tests/gpu/test_runtime_gpu.py 2>&1 | tee "$OUT/rt_tests.log" ;;
    gather) python3 benchmarks/bench_gather.py --out "$OUT/bench_gather.json" 2>&1 | tee "$OUT/bench_gather.log" ;;
    gather_quick) python3 benchmarks/bench_gather.py --no-sweep --out "$OUT/bench_gather.json" 2>&1 | tee "$OUT/bench_gather.log" ;;
    pages) python3 benchmarks/bench_pages.py --out "$OUT/bench_pages.json" 2>&1 | tee "$OUT/bench_pages.log" ;;
    sweep) python3 benchmarks/sweep_pages.py --out "$OUT/sweep_pages.json" 2>&1 | tee "$OUT/sweep_pages.log" ;;
    verify) python3 gpu/verify_real.py ${PAYLOAD:-.gpu_payload}/* 2>&1 | tee "$OUT/verify_real.log" ;;
    unified) python3 gpu/verify_real.py --unified --out "$OUT/unified" .gpu_payload/rel-0.5.2* 2>&1 | tee "$OUT/verify_unified.log" ;;
    dcp) python3 gpu/verify_real.py --dcp 2 --dcp-rank 1 --out "$OUT/dcp" .gpu_payload/rel-0.5.17 .gpu_payload/rel-0.5.2* 2>&1 | tee "$OUT/verify_dcp.log" ;;
    vtests) python3 -m pytest -q -ra tests/gpu/test_verify_gpu.py 2>&1 | tee "$OUT/verify_tests.log" ;;
    fa3) python3 -m pytest -q -ra -s tests/gpu/test_verify_fa3_gpu.py 2>&1 | tee "$OUT/verify_fa3_tests.log" ;;
    fused_tests) timeout -k 10 420 python3 -m pytest -q -ra ${HUNG_K:+-k "$HUNG_K"} tests/gpu/test_fused_gpu.py tests/gpu/test_fused_wgmma_gpu.py tests/gpu/test_fused_partials_gpu.py tests/gpu/test_route_gpu.py tests/gpu/test_mla_route_gpu.py tests/gpu/test_sparse_gpu.py tests/gpu/test_paged_mla_gpu.py 2>&1 | tee "$OUT/fused_tests.log" ;;
    fused_sweep) python3 benchmarks/bench_fused.py --only-sweep --json "$OUT/sweep_fused.json" 2>&1 | tee "$OUT/sweep_fused.log" ;;
    fused) python3 benchmarks/bench_fused.py --sweep --json "$OUT/bench_fused.json" 2>&1 | tee "$OUT/bench_fused.log" ;;
    fused_table) python3 benchmarks/bench_fused.py ${BENCH_ARGS:-} --json "$OUT/bench_fused.json" 2>&1 | tee "$OUT/bench_fused.log" ;;
    probe) python3 gpu/overhead_probe.py --json "$OUT/overhead_probe.json" 2>&1 | tee "$OUT/overhead_probe.log" ;;
    wgmma) python3 gpu/wgmma_probe.py 2>&1 | tee "$OUT/wgmma_probe.log" ;;
    stages) python3 -m pytest -q -ra tests/gpu/test_fused_gpu.py -k "double_buffered or transposed_read" 2>&1 | tee "$OUT/stages_tests.log";
            python3 gpu/stages_probe.py 2>&1 | tee "$OUT/stages_probe.log" ;;
    gluon_mla) python3 gpu/gluon_mla_probe.py 2>&1 | tee "$OUT/gluon_mla_probe.log" ;;
    gluon_sweep) python3 gpu/gluon_mla_probe.py --sweep 2>&1 | tee "$OUT/gluon_sweep.log" ;;
    breakdown) python3 gpu/breakdown_probe.py ${BREAKDOWN_ARGS:-} 2>&1 | tee "$OUT/breakdown_probe.log" ;;
    wgmma_tests) python3 -m pytest -q -ra tests/gpu/test_fused_wgmma_gpu.py 2>&1 | tee "$OUT/wgmma_tests.log" ;;
    wgmma_probe) python3 gpu/gluon_wgmma_probe.py --sweep 2>&1 | tee "$OUT/gluon_wgmma_probe.log" ;;
    # the loader-partition kernel: a wrong mbarrier phase hangs rather than fails
    # (then the steps after it leave its tests out: a hang would take the rest of the call)
    ws_probe) timeout -k 10 300 python3 gpu/gluon_wgmma_probe.py --ws > "$OUT/ws_probe.log" 2>&1; r=$?
              [ $r -eq 0 ] && touch /tmp/kvpatch_ws_ok
              [ $r -ge 124 ] && touch /tmp/kvpatch_ws_hung && echo "ws_probe: TIMED OUT (a hang)";
              cat "$OUT/ws_probe.log" ;;
    # the loader kernel's softmax exchange (FUSED_WGMMA_TUNING "xchg", off) beside the default;
    # a hang leaves its GPU tests out of fused_tests after it
    xchg_probe) timeout -k 10 300 python3 gpu/gluon_wgmma_probe.py --xchg > "$OUT/xchg_probe.log" 2>&1; r=$?
              [ $r -ge 124 ] && touch /tmp/kvpatch_xchg_hung && echo "xchg_probe: TIMED OUT (a hang)";
              cat "$OUT/xchg_probe.log" ;;
    gluon_pv) python3 gpu/gluon_pv_probe.py 2>&1 | tee "$OUT/gluon_pv_probe.log" ;;
    splits) python3 gpu/split_count_probe.py 2>&1 | tee "$OUT/split_count.log" ;;
    step_sweep) python3 gpu/sweep_step.py --json "$OUT/sweep_step.json" 2>&1 | tee "$OUT/sweep_step.log" ;;
    profile) for c in '{}'; do
               ncu --clock-control none -k regex:_fused_split --launch-skip 3 --launch-count 1 \
                 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
                 --section WarpStateStats --section LaunchStats --section SchedulerStats --section InstructionStats \
                 python3 gpu/profile_fused.py "$c" 2>&1 | tee -a "$OUT/profile_fused.log"; done ;;
    profile_wgmma) ncu --clock-control none -k regex:_fused_wgmma --launch-skip 3 --launch-count 1 \
                 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
                 --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
                 --print-details all python3 gpu/profile_fused.py '{"wgmma": true}' 128 2>&1 | tee "$OUT/profile_wgmma.log" ;;
    # the loader-partition variant (ncu serialises and replays kernels: under timeout, a hang)
    profile_ws) timeout -k 10 240 ncu --clock-control none -k regex:_fused_wgmma_ws --launch-skip 3 --launch-count 1 \
                 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
                 --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
                 --print-details all python3 gpu/profile_fused.py '{"wgmma": true}' 128 2>&1 \
                 | tee "$OUT/profile_ws.log" ;;
    profile_gluon) ncu --clock-control none -k regex:_fused_gluon_split --launch-skip 3 --launch-count 1 \
                 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
                 --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
                 --print-details all python3 gpu/profile_fused.py '{"gluon": true}' 16 2>&1 | tee "$OUT/profile_gluon.log" ;;
    profile_full) for c in '{}' '{"block_n": 32, "num_stages": 5}'; do
               ncu --clock-control none -k regex:_fused_split --launch-skip 3 --launch-count 1 --set full \
                 --print-details all python3 gpu/profile_fused.py "$c" 2>&1 | tee -a "$OUT/profile_full.log"; done ;;
    host_times) python3 benchmarks/bench_fused.py --host-only --json "$OUT/host_times.json" 2>&1 | tee "$OUT/host_times.log" ;;
    host) python3 gpu/host_profile.py 2>&1 | tee "$OUT/host_profile.log" ;;
    attention) python3 benchmarks/bench_attention.py --json "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.log" ;;
    *) echo "unknown step $s" ;;
  esac
  r=${PIPESTATUS[0]}; echo "=== $s rc=$r"; [ "$r" = 0 ] || rc=1
done
exit $rc
