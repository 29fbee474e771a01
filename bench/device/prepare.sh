#!/usr/bin/env bash
# Here, once per machine: everything the lent GPU machine needs that its image lacks, into
# folders git ignores. .mlxcuda/{a,b}: MLX's CUDA wheel in two halves (shared/gpu); .whl/:
# wheels of the serving dependencies at this venv's versions; .gpuaux/tok/: the default
# model's tokenizer, which the random 8B-shape checkpoint takes. Run from the repository root.
set -euo pipefail
py=${PY:-.venv/bin/python}
for d in .mlxcuda .whl .gpuaux; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
[ -f .mlxcuda/a/part.aa ] || ../shared/gpu/stage-mlx-cuda
pins=$($py -c 'from importlib.metadata import version as v
print(" ".join(f"{p}=={v(p)}" for p in ("pyzmq", "lz4", "cryptography", "cffi", "pycparser", "falcon", "gunicorn", "llguidance")))')
plats=(); for m in 17 24 26 27 28 31 34 35; do plats+=(--platform "manylinux_2_${m}_x86_64"); done
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" $pins -d .whl
$py -m pip download -q --no-deps --only-binary=:all: py-spy -d .whl  # gpu_serving.py --py-spy: the workers' stacks
tok=$($py -c "import sys; from tandem.pipeline import model_store; print(model_store.resolve_model(None, log=lambda s: print(s, file=sys.stderr)))")
mkdir -p .gpuaux/tok && cp "$tok"/{tokenizer.json,tokenizer_config.json,config.json} .gpuaux/tok/
du -sh .mlxcuda/a .mlxcuda/b .whl .gpuaux
cat <<'MSG'
Ready. Two device calls back to back (the machine goes back after 30 s idle):
  1) carry [".mlxcuda/a", ".whl", ".gpuaux"]  command: bash bench/device/setup.sh
  2) carry [".mlxcuda/b"]                       command: . bench/device/env.sh && <work>
     e.g. <work> = bash bench/device/serving.sh   (docs/gpu.md lists the rest)
MSG
