#!/usr/bin/env bash
# Runs a command in the background; if it is still running after HANG_S seconds, dumps the native stacks of every
# spawned rank process (gdb or cuda-gdb) into $OUT/stacks, then waits for it.   tools/device/hang_stacks.sh CMD...
set -u
out=${OUT:-/tmp}/stacks
mkdir -p "$out"
"$@" >"$out/cmd.log" 2>&1 &
pid=$!
for _ in $(seq 1 "${HANG_S:-30}"); do sleep 1; kill -0 $pid 2>/dev/null || break; done
dbg=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null)
if kill -0 $pid 2>/dev/null && [ -n "$dbg" ]; then
  for c in $(pgrep -f "multiprocessing.spawn"); do
    timeout 90 "$dbg" -p "$c" -batch -ex "thread apply all bt 16" >"$out/stack_$c.txt" 2>&1
  done
fi
wait $pid; echo "exit $?" >>"$out/cmd.log"
