#!/usr/bin/env bash
# The GPU machine's work, as consecutive calls on one warm machine (FlashAttention-4 travels in two
# halves, each call must start within the machine's 30 s warm window after the previous one):
#   bash apps/gpu_suite.sh a       # wheels + FA4 half a; every gpu-marked test that needs no FA4, while
#                                  #   three demo-model trainings (issue 6) share the GPU; the best comes back
#   bash apps/gpu_suite.sh b       # FA4 half b + install + smoke; the FA4 tests; then the bench stage
#   bash apps/gpu_suite.sh tests   # every gpu-marked test, one pytest process per file side by side; then
#                                  #   the triton backend on the bench workload with step times and profiles
#   bash apps/gpu_suite.sh bench   # apps/bench.py: flash_attn, triton and HF on the 256-request workload,
#                                  #   then a torch.profiler table of a dozen full-batch steps
#   bash apps/gpu_suite.sh kernels # apps/bench_kernels.py: ceilings, kernels vs FA4, decode steps, prefill
#   bash apps/gpu_suite.sh train   # apps/train_demo_model.py on .gpu/corpus/corpus.txt (issue 6), ~8 min
# Carried (git-ignored): .whl/ (pyzmq, msgspec cp312 wheels), .gpu/fa4/{a,b} (made by
# ../shared/gpu/fa4-prepare.sh), .gpu/tools/ (fa4-install.sh, fa4-smoke.py), .gpu/corpus (train).
# Logs and results go to $OUT (or ./gpu-out); each stage prints a short summary last.
set -uo pipefail
stage=${1:?usage: gpu_suite.sh a|b|bench|kernels|train}; shift
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

case "$stage" in
a)
    # Correctness tests only beside the trainings: nothing here is timed.
    if [ -f .gpu/corpus/corpus.txt ]; then
        for steps in ${TRAIN_STEPS:-1000 2000 3000}; do
            timeout 520 python3 apps/train_demo_model.py --corpus .gpu/corpus/corpus.txt --out /tmp/demo-$steps \
                --steps "$steps" --time-limit "${TRAIN_S:-330}" >"/tmp/train-$steps.log" 2>&1 &
        done
    fi
    timeout 480 python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$out/tests-a.log" | tail -n 25
    wait
    for f in /tmp/train-*.log; do echo "== $f"; grep -E "val loss|limit|keeping|final|Error|error" "$f" | tail -n 8; done
    best=$(python3 - <<'PY'
import glob, json
logs = [(json.load(open(p))["final_val_loss"], p) for p in glob.glob("/tmp/demo-*/training_log.json")]
print(min(logs)[1].rsplit("/", 2)[1] if logs else "")
PY
)
    [ -n "$best" ] || exit 1
    echo "best: $best"; cp /tmp/train-*.log "$out/"
    tar -C /tmp -cf - "$best" | split -b 15m - "$out/demo-model.tar.part." && ls -la "$out" ;;
b)
    python3 .gpu/tools/fa4-smoke.py 2>&1 | tail -n 2
    timeout 200 python3 -m pytest -q -m gpu tests/test_flash_attention_backend.py tests/test_gpu.py -k "fa4 or flash" \
        2>&1 | tee "$out/tests-b.log" | tail -n 15
    timeout 330 "${bench[@]}" --backends flash_attn,triton --step-stats --profile "$out" "$@" 2>&1 \
        | grep -v "Loading weights" | tee "$out/bench.log" | tail -n 80
    echo "== summary =="; sed -n '/^engine /,$p' "$out/bench.log" | head -n 8 ;;
tests)
    files=(tests/test_kernels.py tests/test_sampling_kernel.py tests/test_flash_attention_backend.py tests/test_gpu.py)
    for f in "${files[@]}"; do
        name=$(basename "$f" .py)
        timeout "${TESTS_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 "$f" \
            >"$out/$name.log" 2>&1 &
    done
    wait
    for f in "${files[@]}"; do echo "== $f: $(tail -n 1 "$out/$(basename "$f" .py).log")"; done
    grep -h -E "^(FAILED|ERROR)" "$out"/test_*.log | head -n 20
    timeout 240 "${bench[@]}" --backends triton --step-stats --profile "$out" "$@" 2>&1 \
        | grep -v "Loading weights" | tee "$out/bench.log" | tail -n 60 ;;
bench)
    timeout 560 "${bench[@]}" --backends flash_attn,triton --hf --hf-batch-size 256 --step-stats --profile "$out" "$@" 2>&1 \
        | grep -v "Loading weights" | tee "$out/bench.log" | tail -n 80
    echo "== summary =="; sed -n '/^engine /,$p' "$out/bench.log" | head -n 8 ;;
kernels)
    timeout 560 python3 apps/bench_kernels.py --out "$out/kernels.json" --budget 500 "$@" 2>&1 \
        | tee "$out/kernels.log" | tail -n 70 ;;
train)
    timeout 560 python3 apps/train_demo_model.py --corpus .gpu/corpus/corpus.txt --out /tmp/demo-model \
        --time-limit 420 "$@" 2>&1 | tee "$out/train.log" | tail -n 60
    # What comes back is at most 8 files of 16 MiB: the ~24 MB checkpoint travels as a split tar.
    tar -C /tmp -cf - demo-model | split -b 15m - "$out/demo-model.tar.part." && ls -la "$out" ;;
*)
    echo "unknown stage $stage"; exit 2 ;;
esac
