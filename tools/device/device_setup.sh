# Source me on a device machine: carried wheels (.whl) into /tmp/site, the CUDA build, the safe NCCL env.
# Usage: . tools/device/device_setup.sh   (sets PYTHONPATH, prints the build time; returns 1 on failure)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
_t0=$(date +%s)
# A warm machine keeps build/inplace, and the tree arrives with the file times it has on this side: a source that an
# earlier call changed on the device (a variant built by sed, then put back) can look older than its objects, and
# ninja would keep the variant. The sources' content decides instead: where it differs from the last build's, the
# build starts afresh.
_stamp=$(find native CMakeLists.txt uccl_moe/env_knobs.def -type f -print0 2>/dev/null | sort -z | xargs -0 sha1sum \
  | sha1sum | cut -c1-40)
[ "$(cat build/inplace/.sources_sha1 2>/dev/null)" = "$_stamp" ] || rm -rf build/inplace
UCCL_MOE_JOBS=${UCCL_MOE_JOBS:-16} tools/build_inplace.sh -DUCCL_MOE_CUDA_ARCHS=90 > /tmp/build.log 2>&1 \
  || { tail -40 /tmp/build.log; return 1; }
echo "$_stamp" > build/inplace/.sources_sha1
echo "build $(( $(date +%s) - _t0 )) s; $(nvidia-smi -L | wc -l) GPU(s); $(python3 -c 'import matplotlib' 2>&1 | tail -1 || true)"
