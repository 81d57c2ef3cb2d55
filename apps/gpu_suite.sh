#!/usr/bin/env bash
# The GPU machine's work, in two calls on one warm machine (FlashAttention-4 travels in two halves).
#   bash apps/gpu_suite.sh a   # wheels + FA4 half a; the Triton kernel tests (a short call)
#   bash apps/gpu_suite.sh b   # FA4 half b + install; every gpu test, kernel/step benchmarks, bench.py
# Carried (git-ignored): .whl/ (pyzmq, msgspec cp312 wheels), .gpu/fa4/{a,b} (made by
# ../shared/gpu/fa4-prepare.sh), .gpu/tools/ (fa4-install.sh, fa4-smoke.py). Logs go to $OUT (or ./gpu-out).
set -uo pipefail
stage=${1:?usage: gpu_suite.sh a|b}; shift
site=/tmp/nanostream-site
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl || exit 1
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# nanostream.kernels lives in kernels/: without an install, expose it by a link inside the package.
[ -e nanostream/kernels ] || ln -s ../kernels nanostream/kernels
out=${OUT:-gpu-out}; mkdir -p "$out"
[ -d ".gpu/fa4/$stage" ] && bash .gpu/tools/fa4-install.sh ".gpu/fa4/$stage" 2>&1 | tail -n 3
[ -f /tmp/fa4-site/env.sh ] && . /tmp/fa4-site/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
bench=(python3 apps/bench.py --preset qwen3-0.6b --build-dir /tmp/qwen3-0.6b-random)

if [ "$stage" = a ]; then
    timeout 240 python3 -m pytest -q tests/test_kernels.py 2>&1 | tee "$out/tests-a.log" | tail -n 30
else
    python3 .gpu/tools/fa4-smoke.py 2>&1 | tail -n 2
    python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$out/tests-b.log" | tail -n 15
    timeout 240 python3 apps/bench_kernels.py --out "$out/kernels.json" 2>&1 | tee "$out/kernels.log" | tail -n 60
    timeout 400 "${bench[@]}" --backends flash_attn,triton --hf --hf-batch-size 256 "$@" 2>&1 | tee "$out/bench-b.log"
    echo "== summary (b) =="; tail -n 1 "$out/tests-b.log"; sed -n '/^engine /,$p' "$out/bench-b.log"
fi
