#!/usr/bin/env bash
# Device-side diagnosis of the GPU-copy loopback hang: run the probe under a given environment; if it has not
# finished after HANG_S seconds, dump every thread's native stack of the rank processes (gdb) into $OUT.
#   tools/dev/gpucopy_diag.sh NAME [VAR=VALUE ...]
set -u
name=$1; shift
out=${OUT:-/tmp}/$name
mkdir -p "$out"
env "$@" python3 tools/dev/gpucopy_probe.py >"$out/probe.log" 2>&1 &
pid=$!
for _ in $(seq 1 ${HANG_S:-6}); do sleep 1; kill -0 $pid 2>/dev/null || break; done
if kill -0 $pid 2>/dev/null && command -v gdb >/dev/null; then
  for c in $(pgrep -f "multiprocessing.spawn" ); do
    timeout 60 gdb -p "$c" -batch -ex "thread apply all bt 12" >"$out/stack_$c.txt" 2>&1
  done
fi
wait $pid; echo "exit $?" >>"$out/probe.log"
echo "== $name"; tail -5 "$out/probe.log"
