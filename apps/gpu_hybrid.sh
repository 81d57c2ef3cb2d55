#!/usr/bin/env bash
# Issues 55 (Gated DeltaNet hybrids) and 56 (latent attention) on one GPU, one call a stage:
#   bash apps/gpu_hybrid.sh tests   # the gpu-marked hybrid and MLA tests, bench_gdn.py, the MLA kernel section, ~6 min
#   bash apps/gpu_hybrid.sh first   # tests, then bench's 8B and 9B runs: one call where few are to be had, ~9 min
#   bash apps/gpu_hybrid.sh engine  # test_hybrid_engine.py's GPU tests alone, then bench's 8B and 9B runs, ~9 min
#   bash apps/gpu_hybrid.sh bench   # the bench workload: Qwen3-8B, Qwen3.5-9B, Qwen3.6-35B-A3B (FP8 on an H100,
#                                   #   bf16 on an H200) shapes, dummy weights, the same call, ~7 min
#   bash apps/gpu_hybrid.sh moe     # bench's 8B beside the 35B-A3B shape alone (FP8 on an H100, bf16 on an H200), ~6 min
#   bash apps/gpu_hybrid.sh htests  # test_hybrid_engine.py's GPU tests alone, ~5 min
#   bash apps/gpu_hybrid.sh long    # 64 sequences of 16k context, 256 output tokens: Qwen3-8B then Qwen3.5-9B, ~8 min
#   bash apps/gpu_hybrid.sh turns   # apps/bench_multiturn.py: TTFT of the fifth turn, caching on and off, 9B and 8B
#   bash apps/gpu_hybrid.sh images  # issue 58: the image GPU tests (Qwen, Gemma 3, the kernel), then apps/bench_images.py on the
#                                   #   Qwen3.5-9B VL shape (dummy weights): 256 requests with a 448 x 448 image vs without
#   bash apps/gpu_hybrid.sh families # issue 57: its gpu tests (Gemma 4, Scout, chunk kernels); the Gemma 4 shape on the
#                                   #   bench workload and at batch 1; Llama 4 Scout (a quarter of its 48 layers on an H100,
#                                   #   whole on an H200) likewise, and at 8 x 32k tokens with its chunked layers, then full
#   bash apps/gpu_hybrid.sh mla     # apps/mla_sweep.py (the MLA kernel's tiles); Moonlight-16B-A3B (bf16, dummy): the
#                                   #   bench workload and batch 1, the pool's size
# Carried: .whl/ (the wheels the GPU image lacks, fla-core and einops among them: bash apps/gpu_wheels.sh). Logs go to $OUT.
set -uo pipefail
stage=${1:?usage: gpu_hybrid.sh tests|first|engine|bench|moe|htests|long|turns|images|families|mla}
site=/tmp/nanostream-site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$site" . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$site:$PWD" NCCL_NVLS_ENABLE=0
out=${OUT:-gpu-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$out/gpu.txt"
python3 -c "import torch, transformers, triton, fla; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__, 'fla-core', fla.__version__)" | tee -a "$out/gpu.txt"
h200=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -c H200)
dummy=(--tiny-config '{"weights": false}' --load-format dummy)
one=(--num-requests 1 --min-input-len 128 --max-input-len 128 --min-output-len 512 --max-output-len 512)
# bench NAME PRESET [args]: one bench.py run, its summary lines kept
bench() {
    local name=$1 preset=$2; shift 2
    timeout "${BENCH_S:-200}" python3 apps/bench.py --preset "$preset" --backends triton --step-stats "$@" 2>&1 \
        | grep -v "Loading weights" >"$out/$name.log"
    echo "== $name"
    grep -E "^nanostream|^steps|^(with prefill|decode|all) " "$out/$name.log" | tail -n 14
}

case "$stage" in
tests|first)
    # the kernel test files side by side (Triton compiles on the CPU cores), the engine tests one after another
    # (each engine sizes its pool from the GPU's free memory), then the benches alone
    for f in tests/test_gated_delta_decode.py tests/test_delta_rule_fla.py tests/test_mla_decode_kernel.py; do
        timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=3 "$f" >"$out/$(basename "$f" .py).log" 2>&1 &
    done
    wait
    for f in tests/test_hybrid_engine.py tests/test_gpu_mla.py; do
        timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=3 "$f" >"$out/$(basename "$f" .py).log" 2>&1
    done
    timeout 100 python3 apps/bench_gdn.py 2>&1 | tee "$out/bench_gdn.log" | tail -n 14
    timeout 120 python3 apps/bench_kernels.py --only mla --budget 100 2>&1 | tee "$out/mla_kernel.log" | tail -n 16
    for f in "$out"/test_*.log; do echo "== $(basename "$f"): $(tail -n 1 "$f")"; done
    grep -h -E "^(FAILED|ERROR)" "$out"/test_*.log | head -n 20
    if [ "$stage" = first ]; then  # and the bench workload, the 8B shape beside the 9B hybrid
        bench qwen3-8b qwen3-8b "${dummy[@]}"
        bench qwen3.5-9b qwen3.5-9b
    fi ;;
bench)
    bench qwen3-8b qwen3-8b "${dummy[@]}"
    bench qwen3.5-9b qwen3.5-9b
    if [ "$h200" = 1 ]; then bench qwen3.6-35b-a3b qwen3.6-35b-a3b; else bench qwen3.6-35b-a3b-fp8 qwen3.6-35b-a3b-fp8; fi ;;
moe)
    bench qwen3-8b qwen3-8b "${dummy[@]}"
    if [ "$h200" = 1 ]; then BENCH_S=280 bench qwen3.6-35b-a3b qwen3.6-35b-a3b
    else BENCH_S=280 bench qwen3.6-35b-a3b-fp8 qwen3.6-35b-a3b-fp8; fi ;;
long)
    long=(--num-requests 64 --min-input-len 16384 --max-input-len 16384 --min-output-len 256 --max-output-len 256
        --max-model-len 16640 --max-num-seqs 64)
    BENCH_S=280 bench long-qwen3-8b qwen3-8b "${dummy[@]}" "${long[@]}"
    BENCH_S=280 bench long-qwen3.5-9b qwen3.5-9b "${long[@]}" ;;
turns)
    for preset in qwen3.5-9b qwen3-8b; do
        extra=(); [ "$preset" = qwen3-8b ] && extra=("${dummy[@]}")
        timeout 280 python3 apps/bench_multiturn.py --preset "$preset" "${extra[@]}" 2>&1 \
            | grep -v "Loading weights" | tee "$out/turns-$preset.log" | tail -n 8
    done ;;
engine|htests)  # the hybrid engine's GPU tests alone (a stack dump of every thread where one stalls), then 8B and 9B
    timeout -s INT 270 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=0 -o faulthandler_timeout=150 \
        tests/test_hybrid_engine.py 2>&1 | tail -n 40
    [ "$stage" = htests ] && exit 0
    BENCH_S=120 bench qwen3-8b qwen3-8b "${dummy[@]}"
    BENCH_S=190 bench qwen3.5-9b qwen3.5-9b ;;
images)
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=3 tests/test_image_engine.py \
        tests/test_gemma3_images.py tests/test_image_attention.py 2>&1 | tail -n 12
    timeout 330 python3 apps/bench_images.py --preset qwen3.5-9b-vl 2>&1 | grep -v "Loading weights" \
        | tee "$out/bench_images.log" | tail -n 8 ;;
families)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_families_2025.py tests/test_kernels.py \
        -k "gemma4 or scout or chunks" 2>&1 | tail -n 6
    bench gemma-4-text gemma-4-text
    bench gemma-4-text-b1 gemma-4-text "${one[@]}"
    # Scout's shape: whole (~109 GB in FP8) on an H200; on an H100 its first 12 layers (three chunked to one global)
    scout=$(python3 -c "import json, sys; n = 48 if sys.argv[1] == '1' else 12; print(json.dumps({'num_hidden_layers': n,
'no_rope_layers': [int((i + 1) % 4 != 0) for i in range(n)],
'layer_types': ['full_attention' if (i + 1) % 4 == 0 else 'chunked_attention' for i in range(n)]}))" "$h200")
    full=$(python3 -c "import json, sys; c = json.loads(sys.argv[1]); c['layer_types'] = ['full_attention'] * len(c['layer_types'])
print(json.dumps(c))" "$scout")
    bench scout llama4-scout-fp8 --tiny-config "$scout"
    bench scout-b1 llama4-scout-fp8 --tiny-config "$scout" "${one[@]}"
    long=(--num-requests 8 --min-input-len 32768 --max-input-len 32768 --min-output-len 128 --max-output-len 128
        --max-model-len 32896 --max-num-seqs 8)
    bench scout-32k-chunked llama4-scout-fp8 --tiny-config "$scout" "${long[@]}"
    bench scout-32k-full llama4-scout-fp8 --tiny-config "$full" "${long[@]}" ;;
mla)
    timeout 200 python3 apps/mla_sweep.py 2>&1 | tee "$out/mla_sweep.log" | grep -v "^  fail" | tail -n 20
    bench moonlight moonlight-16b-a3b
    bench moonlight-b1 moonlight-16b-a3b "${one[@]}"
    bench qwen3-8b-b1 qwen3-8b "${dummy[@]}" "${one[@]}" ;;
*)
    echo "unknown stage $stage" >&2; exit 2 ;;
esac
