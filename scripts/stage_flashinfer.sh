#!/usr/bin/env bash
# Stages into .flashinfer/ (git-ignored) what scripts/flashinfer_gpu_check.sh needs to run
# FlashInfer's fused_topk_deepseek on a GPU machine without internet (Python 3.12, x86_64, torch
# with CUDA 13, nvcc): one archive, .flashinfer/flashinfer-site.tar.gz, of a folder to put on
# PYTHONPATH holding
#   - flashinfer-python 0.7.2.post1 (pure Python; its wheel is 59 MiB, most of it the CUDA sources
#     and headers its JIT builds read, under flashinfer/data/), all of its Python, and of data/
#     only what the JIT build of fused_topk_deepseek's module (dsv3_fused_routing) reads: the
#     kernel's sources, the few csrc/include headers they include, and the CCCL FlashInfer ships
#     (put before the toolkit's on the include path). No CUTLASS, no cubins: that module is
#     compiled from source on first use and downloads nothing;
#   - apache-tvm-ffi, the one requirement of flashinfer-python that `import flashinfer` and that
#     module need and the GPU image lacks. Its other requirements are either on the image (torch,
#     numpy, ninja, einops, nvidia-ml-py, requests, packaging, click, tqdm, tabulate, filelock,
#     cuda-bindings) or imported only by other kernels, behind guards (cuda-python's cuda-tile,
#     nccl4py, nccl-extensions, nvidia-cudnn-frontend, nvidia-cutlass-dsl).
# The downloads are kept in build/flashinfer-stage/ for the next run. Prints the archive's size
# (about 20 MiB: it travels with the checkout, 64 MiB at most in all).
# Usage: scripts/stage_flashinfer.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHINFER_VERSION=0.7.2.post1
TVM_FFI_REQUIREMENT="apache-tvm-ffi>=0.1.11,<0.2"  # flashinfer-python 0.7.2.post1's
stage=build/flashinfer-stage
site="$stage/site"
mkdir -p "$stage/wheels" .flashinfer
if ! ls "$stage/wheels"/flashinfer_python-"$FLASHINFER_VERSION"-*.whl >/dev/null 2>&1 ||
   ! ls "$stage/wheels"/apache_tvm_ffi-*.whl >/dev/null 2>&1; then
  rm -f "$stage/wheels"/*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$stage/wheels" \
    "flashinfer-python==$FLASHINFER_VERSION" "$TVM_FFI_REQUIREMENT"
fi
for w in "$stage/wheels"/*.whl; do
  echo "== $(basename "$w"): $(du -h "$w" | cut -f1); requirements outside extras:"
  unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed 's/^/   /'
done
rm -rf "$site"
python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform any --target "$site" "$stage/wheels"/*.whl
rm -rf "$site/bin"  # console scripts with this machine's interpreter in them
python3 - "$site/flashinfer/data" <<'EOF'
# Keeps, of flashinfer/data, only what the JIT build of dsv3_fused_routing reads: the sources
# flashinfer/jit/dsv3_optimizations.py names and the headers they include (listed with nvcc -M
# and g++ -M under the include flags of flashinfer/jit/cpp_ext.py, for sm_90a), with whole
# folders where that costs little, and all of cccl/ (the vendored CCCL, 29 MiB, 3 MiB packed).
import os, shutil, sys
data = sys.argv[1]
keep_files = {
    "csrc/fused_moe/noAuxTcKernels.cu",
    "csrc/fused_moe/moeTopKFuncs.cuh",
    "csrc/tvm_ffi_utils.h",
    "include/flashinfer/trtllm/fused_moe/noAuxTcKernels.h",
}
keep_dirs = (
    "cccl/",
    "csrc/nv_internal/cpp/common/",
    "csrc/nv_internal/include/tensorrt_llm/common/",
    "csrc/nv_internal/tensorrt_llm/common/",
)
kept = removed = 0
for root, dirs, files in os.walk(data, topdown=False):
    for name in files:
        path = os.path.join(root, name)
        rel = os.path.relpath(path, data).replace(os.sep, "/")
        top_level_header = (rel.startswith("include/flashinfer/") and rel.count("/") == 2
                            and rel.endswith((".h", ".cuh")))
        if rel in keep_files or rel.startswith(keep_dirs) or top_level_header:
            kept += os.path.getsize(path)
        else:
            removed += os.path.getsize(path)
            os.remove(path)
    for name in dirs:
        path = os.path.join(root, name)
        if not os.listdir(path):
            os.rmdir(path)
missing = sorted(f for f in keep_files if not os.path.isfile(os.path.join(data, f)))
if missing:
    sys.exit(f"flashinfer/data lacks {missing}: not the wheel this script was written for")
print(f"== flashinfer/data: kept {kept / 2**20:.1f} MiB, removed {removed / 2**20:.1f} MiB")
EOF
archive=.flashinfer/flashinfer-site.tar.gz
tar -czf "$archive" -C "$site" .
echo "== $archive: $(du -h "$archive" | cut -f1) ($(du -sh "$site" | cut -f1) unpacked); it travels with the checkout:"
echo "   name .flashinfer in carry and run scripts/flashinfer_gpu_check.sh there"
