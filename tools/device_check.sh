#!/usr/bin/env bash
# GPU device check for the CUDA paged-attention kernels: one script, a few minutes.
#
#   bash tools/device_check.sh            (on a machine with a CUDA GPU, nvcc and PyTorch)
#
# 1. builds plugins_cu (sm_90 by default; TL_CUDA_ARCHS to change) and prints the register report;
# 2. runs tests/test_cuda_kernels.py on the GPU backend: KV write, decode (every kernel) and
#    (chunked) prefill vs the float64 numpy reference on fresh random data (GQA/MQA/MHA, block
#    sizes 16/32/64, outputs poisoned with NaN);
# 3. times decode attention (every kernel variant), contexts 1k-32k x batch 1-64, against PyTorch SDPA on
#    a contiguous cache and the measured copy bandwidth (tools/bench_cuda_attention.py), a split
#    policy sweep at 32k, and prefill;
# 4. runs compute-sanitizer memcheck/racecheck on a few small cases when it is installed.
# Results go to $OUT (set by the device tool) or ./device_check_out: device_check.md (the table),
# build.log, pytest.log, bench.log, sanitizer.log.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/device_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the repo is not pip-installed there
export TL_CUDA_ARCHS="${TL_CUDA_ARCHS:-90}"
status=0
t0=$SECONDS

echo "== GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem \
  --format=csv 2>&1 | tee "$OUT/gpu.txt"

echo "== build (sm_${TL_CUDA_ARCHS})"
if ! TL_PTXAS_VERBOSE=1 bash plugins_cu/build.sh --jobs 8 >"$OUT/build.log" 2>&1; then
  cat "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
tail -1 "$OUT/build.log"
grep -E "Used [0-9]+ registers|spill stores" "$OUT/build.log" | grep -v " 0 bytes spill" | head -30
echo "build done at $((SECONDS - t0)) s"

echo "== correctness vs float64 reference"
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -rs \
  -k "not emulation and not compile" 2>&1 \
  | tee "$OUT/pytest.log" | tail -25
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
echo "tests done at $((SECONDS - t0)) s"

echo "== timing"
timeout 200 "$PY" tools/bench_cuda_attention.py --out "$OUT/device_check.md" 2>&1 \
  | tee "$OUT/bench.log" | grep -v "^|" | tail -40
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
echo "timing done at $((SECONDS - t0)) s"

SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)"
if [[ -n "$SAN" ]]; then
  echo "== compute-sanitizer (small cases)"
  for tool in memcheck racecheck; do
    timeout 45 "$SAN" --tool "$tool" --error-exitcode 9 "$PY" -m pytest -q -p no:cacheprovider \
      tests/test_cuda_kernels.py -k "gpu and h9kv3d64b16 and float16 and not nosplit" \
      >>"$OUT/sanitizer.log" 2>&1
    rc=$?
    echo "$tool: exit $rc ($( [[ $rc -eq 0 ]] && echo clean || echo 'see sanitizer.log'))"
    grep -E "ERROR SUMMARY|Error|error" "$OUT/sanitizer.log" | tail -3
  done
fi

echo "== summary ($((SECONDS - t0)) s)"
[[ -f "$OUT/device_check.md" ]] && cat "$OUT/device_check.md"
exit $status
