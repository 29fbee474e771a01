#!/usr/bin/env bash
# On the device, call 1 (carry .mlxcuda/a, .whl, .gpuaux): the first half of MLX's CUDA wheel
# kept outside the tree for call 2, the serving dependencies into /root/site2, and the
# default model's tokenizer where tandem looks for it (with an empty weights file: only
# the random checkpoint's tokenizer comes from there).
set -uo pipefail
mkdir -p /root/mlxcuda && cp .mlxcuda/a/part.aa /root/mlxcuda/ || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site2 .whl/*.whl || exit 5
d=/root/.cache/tandem/models/SmolLM2-135M-Instruct-Q4_1
mkdir -p "$d" && cp .gpuaux/tok/* "$d"/ && touch "$d/model.safetensors"
PYTHONPATH=/root/site2 python3 -c "import zmq, lz4.frame, cryptography, falcon, gunicorn, llguidance, msgpack; print('deps ok')" || exit 6
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; nproc
