#!/usr/bin/env bash
# One call on the GPU machine: the gpu-marked tests, then the offline benchmark on a Qwen3-0.6B-shaped
# model; logs go to $OUT (or ./gpu-out), a short table is printed last.
#   usage: bash apps/gpu_suite.sh [extra apps/bench.py options]
# The GPU machine lacks pyzmq and msgspec: carry their cp312 wheels in .whl/ (git-ignored), e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       -d .whl pyzmq msgspec
set -uo pipefail
site=/tmp/nanostream-site
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl || exit 1
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-gpu-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"

python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$out/gpu-tests.log"
tests=$(tail -n 1 "$out/gpu-tests.log")

timeout 480 python3 apps/bench.py --preset qwen3-0.6b --build-dir /tmp/qwen3-0.6b-random --hf --hf-batch-size 256 "$@" \
    2>&1 | tee "$out/bench.log"

echo "== summary =="
echo "gpu tests: $tests"
sed -n '/^engine /,$p' "$out/bench.log"
