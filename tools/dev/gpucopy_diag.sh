#!/usr/bin/env bash
# Device-side diagnosis of a GPU-copy loopback hang: run the probe under a given environment; if it has not finished
# after HANG_S seconds, dump every thread's native stack of the rank processes (gdb or cuda-gdb) into $OUT/NAME.
#   tools/dev/gpucopy_diag.sh NAME [VAR=VALUE ...]
set -u
name=$1; shift
out=${OUT:-/tmp}/$name
mkdir -p "$out"
env "$@" python3 tools/dev/gpucopy_probe.py >"$out/probe.log" 2>&1 &
pid=$!
for _ in $(seq 1 "${HANG_S:-6}"); do sleep 1; kill -0 $pid 2>/dev/null || break; done
dbg=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null)
if kill -0 $pid 2>/dev/null && [ -n "$dbg" ]; then
  nvidia-smi >"$out/nvidia-smi.txt" 2>&1
  for c in $(pgrep -f "multiprocessing.spawn"); do
    timeout 90 "$dbg" -p "$c" -batch -ex "info threads" -ex "thread apply all bt 14" >"$out/stack_$c.txt" 2>&1
  done
fi
wait $pid; echo "exit $?" >>"$out/probe.log"
echo "== $name (debugger: ${dbg:-none})"; tail -3 "$out/probe.log"
