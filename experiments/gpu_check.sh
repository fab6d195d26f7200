#!/usr/bin/env bash
# The checks that need an accelerator, in one run (JAX with CUDA or TPU support installed):
#   experiments/gpu_check.sh OUT_DIR
# 1. The Pallas kernel tests, compiled for the device (tree_attention lowers through Triton
#    on cuda and Mosaic on tpu; the interpreter is for CPU only).
# 2. kernels.bench_tree_attention against the XLA attention, float32 and bfloat16.
# 3. The bf16 compute mode's invariance tests on the device: they assert this CPU's bitwise
#    promises, so a failure here is a finding about the device's kernels (which identities
#    hold there), recorded in bf16_invariance.log, not a reason to stop.
# 4. W3 (configs/bench_w3.py) with bfloat16 parameters, float32 and bfloat16 compute, when
#    its model is in workdir (the imported model is 540 MB; it is made by
#    experiments.import_gguf, which needs torch).
# Each step's output goes to OUT_DIR/<step>.log; the script stops at the first other failure.
set -euo pipefail
out=${1:?usage: experiments/gpu_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c 'import jax; print(jax.__version__, jax.devices())' | tee "$out/devices.log"
if python3 -c 'import jax, sys; sys.exit(jax.default_backend() != "cpu")'; then
  echo 'JAX sees no accelerator: these checks would run the CPU interpreter' >&2
  exit 1
fi
python3 -m pytest -q tests/kernels/test_tree_attention.py tests/kernels/test_kernel_export.py \
  tests/model/test_accelerator_export.py 2>&1 | tee "$out/kernel_tests.log"
for dtype in float32 bfloat16; do
  python3 -m kernels.bench_tree_attention --dtype "$dtype" 2>&1 | tee "$out/bench_kernel_$dtype.log"
done
python3 -m pytest -q tests/model/test_bf16_compute.py 2>&1 | tee "$out/bf16_invariance.log" \
  || echo 'bf16 invariance: failures on this device, see the log' | tee -a "$out/bf16_invariance.log"
w3_model=workdir/models/smollm2-135m-instruct
if [[ -f $w3_model/config.json ]]; then
  for compute in float32 bfloat16; do
    python3 -m experiments.bench.rollout --config=configs/bench_w3.py --config.dtype=bfloat16 \
      --config.compute_dtype="$compute" --config.hf_generate=False \
      --config.out_dir="$out/bench_w3_gpu_$compute" 2>&1 | tee "$out/bench_w3_$compute.log"
  done
else
  echo "skipped W3: no $w3_model (python -m experiments.import_gguf makes it)" | tee "$out/bench_w3.log"
fi
