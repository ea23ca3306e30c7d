#!/usr/bin/env bash
# One 2- or 4-GPU device call in stages (STAGES, space-separated, in order); logs land in $OUT (one tarball + the .log files).
#   quick    the small GPU test files: dma-buf export, doctor on GPUs, default device/dtype, streams, native core,
#            the GPU example, the device-side topk_idx check, the preset sweep
#   bench    `uccl-moe bench` in its default mode (the API defaults, FP8 column-major scales) at each EP size of
#            BENCH_RANKS (default 2), and the Megatron dispatcher benchmark (uccl vs alltoall vs flex over the shim)
#   deepep   DeepEP V1's own tests/test_intranode.py through the shim at 2 and (with 4 GPUs) 4 processes (carry .deepep:
#            a 567632d tests/ snapshot)
#   inter    emulated-internode GPU tests (ranks share the 2 GPUs)
#   itest    the intranode GPU suite (UMOE_TEST_ITERS back-to-back calls; default 5)
#   cetest   the copy-engine ops' GPU tests: the dispatch against the rings (EP1-4, 6 and 8 sharing the GPUs, chunk
#            counts 1 and 8, the enter kernel always, launches that block), the combine's (EP1-4, 6 and 8, the enter
#            kernel always) and their fault tests (early copies, a rank that skips, other chunks, outputs whose
#            allocation fails on one rank); two runs of
#            about 2.5 minutes each (2 x H100)
#   lprobe   native/bench/probes/landing_poll_probe.cu: copy-engine landing with chunk flags against one copy whose
#            readers poll the landing area for a sentinel (combine- and dispatch-shaped), at 4096 and 2048 rows, checked
#   mtest    Megatron dispatcher GPU tests, the profiling test and the 1F1B EP overlap tests
#   staged   the staged combine (UCCL_MOE_COMBINE_STAGED): its GPU test (bits against the ring), then the bench at each
#            EP size of BENCH_RANKS with --combine-staged --device-time (the ring and the staged combine side by side)
#   scales   FP8 dispatch with column- against row-major scales, alternating, in device time (ab_summary.py table),
#            and whether Nsight Compute / Systems are on the machine
#   direct   the ring-free dispatch (UCCL_MOE_DISPATCH_DIRECT): its GPU test (bits against the rings), then the bench at
#            each EP size of BENCH_RANKS with --dispatch-direct --device-time (ring and direct dispatch side by side)
#   trace    the intranode kernels' phase trace (a second build with -DUCCL_MOE_TRACE_DISPATCH, phase_trace.cuh): where
#            each warp role of dispatch (FP8, BF16), the ring combine and the staged combine (stage, pull) spends
#            its time at EP2, API defaults
#            (tools/device/trace_summary.py); the normal build's module is put back afterwards
#   probe    native/bench/probes/nvlink_probe.cu: SM push, pull, local and mixed copies between the GPUs at 8-64 SMs
#            (what 24 SMs can move, against the all-SM ceilings the bench prints)
#   cprobe   native/bench/probes/combine_pull_probe.cu: combine designs at 4096 tokens (SM pull, SM push, and the
#            copy engines moving the rows while 24 SMs sum: ce_sum / ce_wait, on two streams per peer: ce_sum2 /
#            ce_wait2, with stream-memop flags: ce_sumwv / ce_waitwv, the flag on a second stream per peer after an
#            event on the chunk: ce_sumws / ce_waitws (a stream write), ce_waitcs (a copy); chunks up to one copy; the
#            engines and the SMs moving shares of the rows at once: ce_push), each checked, median us;
#            CPROBE_MODE=<mode> runs one mode
#   sanitize compute-sanitizer memcheck and racecheck on small EP2 cases (UMOE_TEST_SMALL=1; SAN_TESTS, default the
#            copy-engine combine's and dispatch's tests); sanitizer.log
# carry: .whl (megatron-core 0.19 for Python 3.12, hydra-core, omegaconf, antlr4, nanobind, pytest-timeout)
set -uo pipefail
FINAL=${OUT:-/tmp/out}; OUT=/tmp/res; mkdir -p "$OUT" "$FINAL"
trap 'tar czf "$FINAL/results.tgz" -C "$OUT" . ; cp "$OUT"/*.log "$FINAL"/ 2>/dev/null' EXIT
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# shellcheck source=tools/device/device_setup.sh
. tools/device/device_setup.sh || exit 1
P=(python3 -m pytest -q -p no:cacheprovider -rA)
sum() { grep -E "^(FAILED|ERROR)|passed|failed|no tests ran" "$1" | tail -"${2:-8}"; }
# path_bench NAME FLAG: the bench at each EP size of BENCH_RANKS with FLAG (a second path timed beside the default's)
# in device time; logs NAME_bench_ep<R>.log, NAME_ep<R>.json.
path_bench() {
  for r in ${BENCH_RANKS:-2}; do   # 256 experts do not split over 3 ranks: 255 there
    e=256; [ "$r" = 3 ] && e=255
    timeout 150 python3 -m uccl_moe.bench --ranks "$r" --experts $e "$2" --device-time --png= \
      --json "$OUT/$1_ep$r.json" 2>&1 | grep -v "it/s\]" > "$OUT/$1_bench_ep$r.log"
    echo "$1 bench EP$r rc=$?"; head -10 "$OUT/$1_bench_ep$r.log"
  done
}
for stage in ${STAGES:-quick bench}; do
  case $stage in
  quick)
    timeout 240 "${P[@]}" --timeout 200 tests/gpu/test_gpu_mr_gpu.py tests/gpu/test_doctor_gpu.py \
      tests/gpu/test_default_device_gpu.py tests/gpu/test_streams_gpu.py tests/uccl_moe/test_native_core.py \
      tests/examples/test_examples.py tests/gpu/test_topk_check_gpu.py tests/uccl_moe/bench/test_tune_gpu.py -m gpu \
      > "$OUT/quick.log" 2>&1
    echo "quick rc=$?"; sum "$OUT/quick.log" 12 ;;
  bench)
    for r in ${BENCH_RANKS:-2}; do   # 256 experts do not split over 3 ranks: 255 there
      e=256; [ "$r" = 3 ] && e=255
      timeout 150 python3 -m uccl_moe.bench --ranks "$r" --experts $e --json "$OUT/api_ep$r.json" \
        --png "$OUT/api_ep$r.png" 2>&1 | grep -v "it/s\]" > "$OUT/bench_ep$r.log"
      echo "bench EP$r rc=$?"; tail -"${BENCH_TAIL:-16}" "$OUT/bench_ep$r.log"
    done
    timeout 200 python3 -m uccl_moe.bench.megatron_dispatcher --ranks 2 --json "$OUT/megatron.json" 2>&1 \
      | grep -vi warn > "$OUT/megatron_bench.log"; echo "megatron bench rc=$?"; tail -14 "$OUT/megatron_bench.log" ;;
  deepep)
    UCCL_MOE_DEEPEP_V1_TESTS=$PWD/.deepep/tests timeout "${DEEPEP_T:-300}" "${P[@]}" -s --timeout 290 \
      tests/gpu/test_deepep_v1_intranode.py > "$OUT/deepep_v1.log" 2>&1
    echo "deepep rc=$?"; sum "$OUT/deepep_v1.log" 6 ;;
  inter)
    timeout "${INTER_T:-240}" "${P[@]}" --timeout 230 tests/gpu/test_internode_native.py -k "${INTER_K:-}" \
      > "$OUT/inter.log" 2>&1
    echo "inter rc=$?"; sum "$OUT/inter.log" ;;
  cetest)
    timeout 300 "${P[@]}" --timeout 290 tests/gpu/test_dispatch_direct_gpu.py -k "ce_dispatch or ce_ops" \
      > "$OUT/cetest.log" 2>&1
    echo "cetest (dispatch) rc=$?"; sum "$OUT/cetest.log" 12
    C=tests/gpu/test_combine_staged_gpu.py N=tests/gpu/test_intranode_native.py
    timeout 290 "${P[@]}" --timeout 280 \
      "$C::test_staged_and_ce_combine_match_the_ring[ce-1]" "$C::test_staged_and_ce_combine_match_the_ring[ce-2]" \
      "$C::test_staged_and_ce_combine_match_the_ring[ce-3]" "$C::test_staged_and_ce_combine_match_the_ring[ce-4]" \
      "$C::test_staged_and_ce_combine_more_ranks[ce-6]" "$C::test_staged_and_ce_combine_more_ranks[ce-8]" \
      "$C::test_ce_combine_with_the_enter_kernel_always" "$N::test_native_combine_from_buffer_timeout[ce_skip_early]" \
      "$N::test_native_combine_from_buffer_timeout[ce_skip_late_early]" \
      "$N::test_native_combine_view_and_staged_tensor_refused[ce_late_early]" \
      "$N::test_native_combine_view_and_staged_tensor_refused[mixed_ce]" \
      "$N::test_native_combine_view_and_staged_tensor_refused[ce_chunks]" \
      "$N::test_native_combine_view_and_staged_tensor_refused[ce_chunks_early]" \
      "$N::test_native_combine_view_and_staged_tensor_refused[ce_hidden]" \
      "$N::test_native_combine_view_and_staged_tensor_refused[staged_hidden]" > "$OUT/cetest_combine.log" 2>&1
    echo "cetest (combine) rc=$?"; sum "$OUT/cetest_combine.log" 12
    timeout 60 "${P[@]}" --timeout 50 tests/uccl_moe/test_native_core.py -m gpu > "$OUT/cetest_core.log" 2>&1
    echo "cetest (device records) rc=$?"; sum "$OUT/cetest_core.log" 6 ;;
  itest)
    UMOE_TEST_ITERS=${UMOE_TEST_ITERS:-5} timeout "${ITEST_T:-330}" "${P[@]}" --timeout 320 tests/gpu/test_intranode_native.py \
      -k "${ITEST_K:-}" > "$OUT/itest.log" 2>&1
    echo "itest rc=$?"; sum "$OUT/itest.log" ;;
  staged)
    timeout "${STAGED_T:-540}" "${P[@]}" --timeout 300 tests/gpu/test_combine_staged_gpu.py > "$OUT/staged.log" 2>&1
    echo "staged test rc=$?"; sum "$OUT/staged.log"
    path_bench staged --combine-staged ;;
  scales)
    mkdir -p "$OUT/scales"; i=0
    for s in col row col row; do
      i=$((i + 1))
      timeout 120 python3 -m uccl_moe.bench --ranks 2 --dtypes fp8 --scales "$s" --device-time --png= \
        --json "$OUT/scales/ab${i}_$s.json" > "$OUT/scales_$i.log" 2>&1 || tail -5 "$OUT/scales_$i.log"
    done
    python3 tools/device/ab_summary.py "$OUT/scales" --base col
    echo "ncu: $(command -v ncu || echo none); nsys: $(command -v nsys || echo none)" ;;
  direct)
    timeout "${DIRECT_T:-400}" "${P[@]}" --timeout 380 tests/gpu/test_dispatch_direct_gpu.py > "$OUT/direct.log" 2>&1
    echo "direct test rc=$?"; sum "$OUT/direct.log"
    path_bench direct --dispatch-direct ;;
  trace)
    UCCL_MOE_BUILD_DIR=build/trace UCCL_MOE_JOBS=16 tools/build_inplace.sh -DUCCL_MOE_CUDA_ARCHS=90 \
      -DCMAKE_CUDA_FLAGS=-DUCCL_MOE_TRACE_DISPATCH > "$OUT/trace_build.log" 2>&1 || tail -20 "$OUT/trace_build.log"
    for dt in fp8 bf16; do   # bf16 also times the ring and the staged combine (stage and pull kernels)
      extra=(); [ "$dt" = bf16 ] && extra=(--combine-staged)
      timeout 120 python3 -m uccl_moe.bench --ranks 2 --dtypes "$dt" --iters 20 --warmup 2 --no-nccl --png= "${extra[@]}" \
        > "$OUT/trace_$dt.log" 2>&1; echo "trace $dt rc=$?"
    done
    python3 tools/device/trace_summary.py "$OUT"/trace_fp8.log "$OUT"/trace_bf16.log
    tools/build_inplace.sh -DUCCL_MOE_CUDA_ARCHS=90 > /dev/null 2>&1 || echo "could not restore the normal build" ;;
  probe)
    nvcc -O3 -arch=sm_90 -o /tmp/nvlink_probe native/bench/probes/nvlink_probe.cu > "$OUT/probe.log" 2>&1 \
      && timeout "${PROBE_T:-120}" /tmp/nvlink_probe "${PROBE_MB:-48}" 9 >> "$OUT/probe.log" 2>&1
    echo "probe rc=$?"; tail -16 "$OUT/probe.log" ;;
  cprobe)
    nvcc -O3 -arch=sm_90 -std=c++17 -Inative/include -o /tmp/combine_probe native/bench/probes/combine_pull_probe.cu \
      > "$OUT/cprobe.log" 2>&1 && timeout "${CPROBE_T:-150}" /tmp/combine_probe 4096 9 ${CPROBE_MODE:-} >> "$OUT/cprobe.log" 2>&1
    echo "cprobe rc=$?"; tail -60 "$OUT/cprobe.log" ;;
  lprobe)
    nvcc -O3 -arch=sm_90 -std=c++17 -Inative/include -o /tmp/landing_probe native/bench/probes/landing_poll_probe.cu \
      > "$OUT/lprobe.log" 2>&1 && for t in 4096 2048; do timeout 60 /tmp/landing_probe $t 25 >> "$OUT/lprobe.log" 2>&1
    done
    echo "lprobe rc=$?"; tail -20 "$OUT/lprobe.log" ;;
  mtest)
    UCCL_MOE_TEST_MEGATRON_BACKEND=native timeout "${MTEST_T:-400}" "${P[@]}" --timeout 390 \
      tests/uccl_moe/megatron/test_dispatcher_gpu.py tests/gpu/test_profiling_gpu.py \
      tests/gpu/test_megatron_ep_overlap_gpu.py > "$OUT/mtest.log" 2>&1
    echo "mtest rc=$?"; sum "$OUT/mtest.log" 12; grep -E "under compute|max \|d" "$OUT/mtest.log" | tail -6 ;;
  sanitize)
    san_default="tests/gpu/test_combine_staged_gpu.py::test_staged_and_ce_combine_match_the_ring[ce-2]
      tests/gpu/test_dispatch_direct_gpu.py::test_ce_dispatch_matches_the_rings[2]"
    for tool in memcheck racecheck; do
      # shellcheck disable=SC2086  # (the test ids split into words)
      UMOE_TEST_SMALL=1 UMOE_TEST_ITERS=2 UMOE_TEST_BIG=0 UCCL_MOE_TIMEOUT_S=100 timeout "${SAN_T:-170}" \
        compute-sanitizer --tool $tool --target-processes all python3 -m pytest -q -s -p no:cacheprovider -o addopts="" \
        ${SAN_TESTS:-$san_default} \
        >> "$OUT/sanitizer.log" 2>&1
      echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -2
    done ;;
  *) echo "unknown stage $stage"; exit 2 ;;
  esac
  el "$stage done"
done
