#!/usr/bin/env bash
# Build the trtllm-lite CUDA kernels into one shared library with nvcc.
#
#   plugins_cu/build.sh [--arch "80 89 90"] [--out DIR] [--compile-only [--ptx-only]] [--jobs N]
#   plugins_cu/build.sh --emulation [--asan] [--out DIR]
#
# Output: DIR/libtrtllm_lite_kernels.so (default DIR: plugins_cu/build), C ABI in
# plugins_cu/include/trtllm_lite_kernels.h, CUDA runtime linked statically. Machine code (SASS) for
# each listed architecture plus PTX for the highest, so newer GPUs can JIT it.
# --compile-only stops after the object files (what CI checks on a machine without a GPU);
# --ptx-only (with it) embeds PTX alone, skipping ptxas's machine code (~half of the time: the
# C++ and CUDA front end and NVVM still check every source).
# --emulation builds DIR/libtrtllm_lite_kernels_emu.so instead: the same sources compiled by the
# host C++ compiler (CXX, default g++) against plugins_cu/emulation, a CPU model of the CUDA
# execution model with the same C ABI, for checking the kernels without a GPU; --asan adds
# AddressSanitizer (load it with LD_PRELOAD=$(g++ -print-file-name=libasan.so)).
# Environment: NVCC (default: nvcc on PATH), TL_CUDA_ARCHS (default "80 89 90"),
# TL_PTXAS_VERBOSE=1 (print ptxas resource usage).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ARCHS="${TL_CUDA_ARCHS:-80 89 90}"
OUT_DIR="$HERE/build"
COMPILE_ONLY=0
PTX_ONLY=0
EMULATION=0
ASAN=0
JOBS="$(nproc 2>/dev/null || echo 2)"
NVCC="${NVCC:-nvcc}"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --arch) ARCHS="$2"; shift 2 ;;
    --out) OUT_DIR="$2"; shift 2 ;;
    --compile-only) COMPILE_ONLY=1; shift ;;
    --ptx-only) PTX_ONLY=1; shift ;;
    --emulation) EMULATION=1; shift ;;
    --asan) ASAN=1; shift ;;
    --jobs) JOBS="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

if (( EMULATION )); then
  CUDA_INC=""
  NVCC_PATH="$(command -v "$NVCC" 2>/dev/null || true)"
  for root in "${CUDA_HOME:-}" "${NVCC_PATH:+$(dirname "$(dirname "$(readlink -f "$NVCC_PATH")")")}" \
              /usr/local/cuda; do
    [[ -n "$root" && -f "$root/include/cuda_fp16.h" ]] && { CUDA_INC="$root/include"; break; }
  done
  [[ -n "$CUDA_INC" ]] || { echo "build.sh: CUDA headers not found (set CUDA_HOME)" >&2; exit 1; }
  EXTRA=()
  (( ASAN )) && EXTRA=(-fsanitize=address -fno-omit-frame-pointer)
  mkdir -p "$OUT_DIR/emu_obj"
  EMU_FLAGS=(-std=c++17 -O2 -g -fPIC -DTL_EMULATE -fno-strict-aliasing -Wall -Wno-unknown-pragmas
             "${EXTRA[@]}" -I"$HERE/include" -I"$CUDA_INC")
  # one compiler per source, at most JOBS at a time (decode_attention alone is ~60% of the work),
  # then one link: ~20 s serial, ~12 s on 2 cores
  running=0
  for src in "$HERE"/src/{decode_attention,prefill_attention,kv_write,api}.cu "$HERE/emulation/cuda_emulation.cpp"; do
    "${CXX:-g++}" "${EMU_FLAGS[@]}" -x c++ -c "$src" -o "$OUT_DIR/emu_obj/$(basename "${src%.*}").o" &
    if (( ++running >= JOBS )); then wait -n; running=$((running - 1)); fi   # any one to finish (set -e: a failure exits)
  done
  while (( running > 0 )); do wait -n; running=$((running - 1)); done
  "${CXX:-g++}" -shared "${EXTRA[@]}" "$OUT_DIR"/emu_obj/*.o -o "$OUT_DIR/libtrtllm_lite_kernels_emu.so"
  echo "build.sh: built $OUT_DIR/libtrtllm_lite_kernels_emu.so (CPU emulation)"
  exit 0
fi

command -v "$NVCC" >/dev/null || { echo "build.sh: nvcc not found (set NVCC)" >&2; exit 1; }
mkdir -p "$OUT_DIR/obj"

(( PTX_ONLY && ! COMPILE_ONLY )) && { echo "build.sh: --ptx-only goes with --compile-only" >&2; exit 2; }
GENCODE=()
HIGHEST=0
for a in $ARCHS; do
  (( PTX_ONLY )) || GENCODE+=("-gencode=arch=compute_${a},code=sm_${a}")
  (( a > HIGHEST )) && HIGHEST=$a
done
GENCODE+=("-gencode=arch=compute_${HIGHEST},code=compute_${HIGHEST}")

FLAGS=(-O3 -std=c++17 -lineinfo -Xcompiler -fPIC -I"$HERE/include" "${GENCODE[@]}")
[[ "${TL_PTXAS_VERBOSE:-0}" == 1 ]] && FLAGS+=(-Xptxas -v)  # registers/spills/smem per kernel
SOURCES=(decode_attention prefill_attention kv_write api)

# Compile the translation units in parallel, at most JOBS at a time.
pids=()
for src in "${SOURCES[@]}"; do
  "$NVCC" "${FLAGS[@]}" -c "$HERE/src/$src.cu" -o "$OUT_DIR/obj/$src.o" &
  pids+=($!)
  if (( ${#pids[@]} >= JOBS )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
# Also catch failures among jobs already reaped above.
for src in "${SOURCES[@]}"; do [[ -s "$OUT_DIR/obj/$src.o" ]] || status=1; done
(( status == 0 )) || { echo "build.sh: compilation failed" >&2; exit 1; }

if (( COMPILE_ONLY )); then
  echo "build.sh: compiled ${#SOURCES[@]} sources for sm_{${ARCHS// /,}} into $OUT_DIR/obj"
  exit 0
fi
"$NVCC" -shared -cudart static "${GENCODE[@]}" "$OUT_DIR"/obj/*.o -o "$OUT_DIR/libtrtllm_lite_kernels.so"
echo "build.sh: built $OUT_DIR/libtrtllm_lite_kernels.so for sm_{${ARCHS// /,}}"
