#!/usr/bin/env bash
# 4-GPU device call in stages (STAGES, space-separated, run in order); logs and results land in $OUT.
#   itest    intranode GPU tests (ITEST_K selects, UMOE_TEST_ITERS back-to-back calls, default 200)
#   caller   UCCL_MOE_CALLER_STREAM_OPS=1 (synchronous ops on the caller's stream): the streams tests, the intranode GPU
#            tests with the knob on (ITEST_K selects), and the host time per op both ways (tools/device/profile_call.py)
#   bench    `uccl-moe bench` with BENCH_ARGS (JSON and PNG in the results)
#   mtest    Megatron dispatcher GPU tests on the native backend (EP2/EP4, TPxEP, shared-expert overlap)
#   inter    emulated-internode GPU tests on 4 GPUs (2x2 and 4x1, both data paths, reordering)
#   ibench   emulated-internode benchmark 2 nodes x 2 GPUs, GPU-copy and host-staged data paths
#   smoke    `uccl-moe compare` of uccl vs alltoall, a few steps (EP4 DeepSeek-V3 proxy)
#   compare  the 50-step compare: uccl, alltoall twice (run-to-run noise), allgather (COMPARE_OVERRIDES: e.g.
#            train.train_iters=30)
#   fifo     FIFO flood with GPU producers (1/2/4/8 proxy threads), then 4 producers per FIFO
#   profile  one profiled uccl run with --moe-shared-expert-overlap and one without; timeline summaries
#   sanitize compute-sanitizer memcheck and racecheck on small EP2 cases (SAN_TESTS, default: the pull combine)
# carry: .whl (megatron-core, hydra-core, omegaconf, antlr4 wheels for Python 3.12)
set -uo pipefail
FINAL=${OUT:-/tmp/out}; OUT=/tmp/res; mkdir -p "$OUT" "$FINAL"   # 8 files come back: all in one tarball
trap 'tar czf "$FINAL/results.tgz" -C "$OUT" . ; cp "$OUT"/*.log "$FINAL"/ 2>/dev/null' EXIT
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
. tools/device/device_setup.sh || exit 1
filt() { grep -v "UserWarning\|warnings.warn\|param.main_grad\|INFO:megatron\|^\[.*\] *\(decoder\|embedding\|output\)" ; }
for stage in ${STAGES:-mtest inter ibench smoke}; do
  case $stage in
  itest)
    UMOE_TEST_ITERS=${UMOE_TEST_ITERS:-200} timeout ${ITEST_T:-400} python3 -m pytest -q -p no:cacheprovider \
      --timeout 380 -rA tests/gpu/test_intranode_native.py -k "${ITEST_K:-}" > "$OUT/itest.log" 2>&1
    echo "itest rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed|checks failed" "$OUT/itest.log" | tail -10 ;;
  caller)
    timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 180 -rA tests/gpu/test_streams_gpu.py \
      > "$OUT/caller_streams.log" 2>&1
    echo "streams rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/caller_streams.log" | tail -6
    UCCL_MOE_CALLER_STREAM_OPS=1 UMOE_TEST_ITERS=${UMOE_TEST_ITERS:-200} timeout ${ITEST_T:-400} python3 -m pytest -q \
      -p no:cacheprovider --timeout 380 -rA tests/gpu/test_intranode_native.py -k "${ITEST_K:-}" \
      > "$OUT/caller_itest.log" 2>&1
    echo "itest (caller's stream) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/caller_itest.log" | tail -8
    timeout 200 python3 tools/device/profile_call.py --tokens 128 --calls 500 --top 0 --caller-stream both 2>&1 \
      | grep -E "host time per call|Error" | tee "$OUT/caller_host.log" ;;
  bench)
    # shellcheck disable=SC2086
    timeout ${BENCH_T:-300} python3 -m uccl_moe.bench ${BENCH_ARGS:-} --json "$OUT/bench.json" --png "$OUT/bench.png" \
      2>&1 | grep -v "it/s\]" | tail -${BENCH_TAIL:-30} ;;
  mtest)
    UCCL_MOE_TEST_MEGATRON_BACKEND=native timeout ${MTEST_T:-200} python3 -m pytest -q -p no:cacheprovider \
      --timeout 180 -rA tests/uccl_moe/megatron/test_dispatcher_gpu.py tests/gpu/test_profiling_gpu.py \
      > "$OUT/mtest.log" 2>&1
    echo "mtest rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/mtest.log" | tail -8 ;;
  inter)
    timeout ${INTER_T:-260} python3 -m pytest -q -p no:cacheprovider --timeout 240 -rA \
      tests/gpu/test_internode_native.py -k "${INTER_K:-4-2 or 4-4}" > "$OUT/inter.log" 2>&1
    echo "inter rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/inter.log" | tail -10 ;;
  ibench)
    for d in gpu host; do
      UCCL_MOE_PROXY_THREADS=4 timeout 90 python3 -m uccl_moe.bench.internode --ranks 4 --nodes 2 --iters 20 \
        --data $d --json "$OUT/ibench_2x2_$d.json" 2>&1 | grep -v "it/s\]" | tail -14
    done ;;
  smoke)
    timeout ${SMOKE_T:-200} python3 -m uccl_moe.cli compare recipe=dsv3_proxy_local 'dispatchers=[uccl,alltoall]' \
      train.train_iters=${SMOKE_ITERS:-5} --run-dir "$OUT/smoke" --timeout-s 150 2>&1 | filt | tail -14 ;;
  compare)
    timeout ${COMPARE_T:-540} python3 -m uccl_moe.cli compare recipe=dsv3_proxy_local \
      "dispatchers=${DISPATCHERS:-[uccl,alltoall,allgather]}" ${COMPARE_OVERRIDES:-} ${REPEAT---repeat-baseline} --baseline alltoall --warmup-steps 3 \
      --run-dir "$OUT/cmp" --timeout-s 200 ${COMPARE_ARGS:-} 2>&1 | filt | tail -20 ;;
  profile)
    for spec in ${PROFILE_RUNS:-uccl:true uccl:false}; do   # dispatcher:shared-expert-overlap
      d=${spec%%:*}; ov=${spec##*:}; P="$OUT/prof_${d}_$ov"
      timeout ${PROFILE_T:-150} python3 -m uccl_moe.cli train recipe=dsv3_proxy_local train.train_iters=8 \
        dispatcher=$d dispatcher.moe_shared_expert_overlap=$ov \
        "train.extra_args=[--profile,--profile-step-start,5,--profile-step-end,7,--profile-dir,$P]" > "$P.log" 2>&1
      echo "profile $d overlap=$ov rc=$?"; grep -E "iteration [5-8]/|Error" "$P.log" | tail -4 | cut -c1-200
      python3 -m uccl_moe.train.timeline "$P/trace_rank0.json" --json "$P/timeline.json"
      gzip -c "$P/trace_rank0.json" > "$FINAL/trace_${d}_$ov.json.gz"; rm -f "$P/trace_rank0.json"
    done ;;
  fifo)
    timeout 120 python3 -m uccl_moe.bench.fifo_gpu --threads 1,2,4,8 --cmds 20000 --json "$OUT/fifo_p1.json" 2>&1 | tail -8
    timeout 120 python3 -m uccl_moe.bench.fifo_gpu --threads 1,2,4,8 --cmds 20000 --producers 4 \
      --json "$OUT/fifo_p4.json" 2>&1 | tail -8 ;;
  sanitize)  # small cases, two iterations; both tools' logs in one file
    for tool in memcheck racecheck; do
      UMOE_TEST_SMALL=1 UMOE_TEST_ITERS=2 UMOE_TEST_BIG=0 UCCL_MOE_TIMEOUT_S=100 timeout ${SAN_T:-150} \
        compute-sanitizer --tool $tool --target-processes all python3 -m pytest -q -s -p no:cacheprovider \
        -o addopts="" ${SAN_TESTS:-"tests/gpu/test_intranode_native.py::test_native_combine_from_buffer[2]"} \
        >> "$OUT/sanitizer.log" 2>&1
      echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -2
    done ;;
  *) echo "unknown stage $stage"; exit 2 ;;
  esac
  el "$stage done"
done
