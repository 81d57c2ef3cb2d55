#!/usr/bin/env bash
# The GPU machine's work, as consecutive calls on one warm machine (FlashAttention-4 travels in two
# halves, each call must start within the machine's 30 s warm window after the previous one):
#   bash apps/gpu_suite.sh a       # wheels + FA4 half a; every gpu-marked test (FA4's skip), ~5 min
#   bash apps/gpu_suite.sh b       # FA4 half b + install + smoke; the FA4 tests; bench.py with both
#                                  #   backends and HF, step times and profiles, ~8 min
#   bash apps/gpu_suite.sh tests   # every gpu-marked test (no FA4); then the triton backend on the bench
#                                  #   workload with step times and profiles
#   bash apps/gpu_suite.sh bench   # apps/bench.py: flash_attn, triton and HF on the 256-request workload,
#                                  #   then a torch.profiler table of a dozen full-batch steps
#   bash apps/gpu_suite.sh kernels # apps/bench_kernels.py: ceilings, kernels vs FA4, decode steps, prefill
#   bash apps/gpu_suite.sh train   # apps/train_demo_model.py on .gpu/corpus/corpus.txt (issue 6), ~3 min
#   bash apps/gpu_suite.sh stream  # apps/bench_stream.py through AsyncClient, 5 rounds of 4x64 and 8x32,
#                                  #   with a py-spy profile of the engine, ~4 min
#   bash apps/gpu_suite.sh http    # apps/bench_stream.py through HTTP (WORKERS, 8), then apps/bench_serve.py, ~6 min
#   bash apps/gpu_suite.sh profile # 3 rounds of 4x64 through AsyncClient and HTTP (4 workers) with py-spy on
#                                  #   the engine and the frontend workers, then bench_structured under py-spy
#   bash apps/gpu_suite.sh interval # bench_stream.py at each --stream-interval of INTERVALS (1 4), HTTP only,
#                                  #   with WORKERS (2,8) frontend workers in turn, STREAM_S (240 s) each at most
#   bash apps/gpu_suite.sh phases  # apps/bench_phases.py: the prefill and decode phases of offline rounds, with
#                                  #   the prefill graphs and without (--enforce-eager), ~2 min
#   bash apps/gpu_suite.sh tp PART # issue 17 on nvidia-h200-x2, one call per PART: tests (the two-GPU tests),
#                                  #   bench-0.6b / bench-8b (bench.py at tp=1 then tp=2; the first 8B call builds
#                                  #   the bf16 model, ~3 min), stream (bench_stream at tp=2), steps (8B decode
#                                  #   phases at batch 1 and 256, tp=1 and tp=2, with their floors)
#   bash apps/gpu_suite.sh regress # apps/bench.py (triton) in this checkout and in OLD (a carried export of
#                                  #   an earlier commit), in turn: new, old, new, old, ~3 min
#   bash apps/gpu_suite.sh service # issue 30: HTTP through `nanostream serve MODEL --openai-port P` at its defaults,
#                                  #   3 rounds of 4x64 and 1,024 connections at once, then frontend --workers 8, ~7 min
#   bash apps/gpu_suite.sh dialects # issue 59: bench_stream.py through /v1/completions, the Responses and the Messages
#                                  #   APIs (8 frontend workers, 3 rounds of 4x64 each against offline, the same prompt
#                                  #   ids) on the 0.6B shape with a 151,643-token tokenizer (.gpu/tok if carried), ~5 min
#   bash apps/gpu_suite.sh families # issue 32: gpt-oss-20b and Gemma-3-4B (dummy) on the bench workload and at
#                                  #   batch 1, the window kernel section, the gpu-marked window/sink tests, ~5 min
#   bash apps/gpu_suite.sh fp8kv   # issue 33's KV half: the FP8 KV gpu tests, the 0.6B bench with bf16 and FP8 KV
#   bash apps/gpu_suite.sh fp8 PART # issue 33 on the 8B shape (dummy weights), one call per PART: tests (the FP8
#                                  #   gpu tests, the FP8 GEMM kernel section), bench (bf16, FP8 W, FP8 W + KV on
#                                  #   the bench workload), one (the same at batch 1), agree (fp8_agreement.py)
#   bash apps/gpu_suite.sh invariant PART # issue 34, one call per PART: tests (the gpu-marked batch-invariance
#                                  #   tests, then bench.py without and with --batch-invariant), soak (apps/soak.py
#                                  #   with --batch-invariant, bf16 then float32, 90 s and 3 kills each;
#                                  #   SOAK_DTYPES=float32 for one)
#   bash apps/gpu_suite.sh structured  # apps/bench_structured.py (json at 0.5, regex at 1.0) on the preset with
#                                  #   a carried 151,643-token tokenizer (TOKENIZER dir), ~2 min
# Carried (git-ignored): .whl/ (bash apps/gpu_wheels.sh: cp312 wheels of what the GPU image lacks: pyzmq, msgspec; jsonschema,
# jsonschema-specifications, referencing, rpds-py for test_gpu_structured.py; xgrammar, apache-tvm-ffi, pydantic,
# pydantic-core, annotated-types, typing-inspection for structured output), .gpu/fa4/{a,b} (made by
# ../shared/gpu/fa4-prepare.sh), .gpu/tools/ (fa4-install.sh, fa4-smoke.py), .gpu/corpus (train).
# Logs and results go to $OUT (or ./gpu-out); each stage prints a short summary last.
set -uo pipefail
stage=${1:?usage: gpu_suite.sh a|b|bench|kernels|train}; shift
site=/tmp/nanostream-site
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl || exit 1
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast off for every engine this suite starts (a shared host; the library leaves NCCL's
# environment to its entry points): nanostream.distributed.rendezvous.MULTICAST_OFF
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-gpu-out}; mkdir -p "$out"
# What an earlier call's killed run left behind (an engine, frontend workers, client processes) would
# hold the GPU and the CPUs: a stage starts on a quiet machine.
pkill -9 -f '[n]anostream (serve|frontend)'; pkill -9 -f '[s]pawn_main'

[ -d ".gpu/fa4/$stage" ] && bash .gpu/tools/fa4-install.sh ".gpu/fa4/$stage" 2>&1 | tail -n 3
[ -f /tmp/fa4-site/env.sh ] && . /tmp/fa4-site/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
bench=(python3 apps/bench.py --preset qwen3-0.6b --build-dir /tmp/qwen3-0.6b-random)

# Every gpu-marked test: one pytest process per kernel test file side by side (Triton compiles on the
# CPU cores), then the engine tests (test_gpu.py, test_gpu_structured.py) alone (one of them measures the
# GPU's free memory).
gpu_tests() {
    local f files=(tests/test_kernels.py tests/test_sampling_kernel.py tests/test_flash_attention_backend.py)
    for f in "${files[@]}"; do
        timeout "${TESTS_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 "$f" "$@" \
            >"$out/$(basename "$f" .py).log" 2>&1 &
    done
    wait
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 tests/test_gpu.py tests/test_gpu_structured.py "$@" \
        >"$out/test_gpu.log" 2>&1
    for f in "${files[@]}" tests/test_gpu.py; do echo "== $f: $(tail -n 1 "$out/$(basename "$f" .py).log")"; done
    grep -h -E "^(FAILED|ERROR)" "$out"/test_*.log | head -n 20
}

# Issue 18's cost: the preset's shape with a real-size byte-level BPE vocabulary (TOKENIZER: a dir made by
# apps/make_bench_tokenizer.py), so that masks cost what a real model's do; SPECS: the runs. --py-spy: the
# first run under py-spy (the busy loop's own time: masks, sampling, launches).
# tok_model: /tmp/qwen3-0.6b-tok, the preset's random model with that tokenizer (made here, ~40 s, where none
# is carried): every id of the bench workload decodes to text that encodes back to about as many tokens.
tok_model() {
    local tok=${TOKENIZER:-.gpu/tok}
    [ -f "$tok/tokenizer.json" ] || { tok=/tmp/bench-tok; [ -f "$tok/tokenizer.json" ] \
        || python3 apps/make_bench_tokenizer.py "$tok" 2>&1 | tail -n 1; }
    PYTHONPATH="apps:$PYTHONPATH" python3 -c "from presets import random_model
with random_model('qwen3-0.6b', {}, '/tmp/qwen3-0.6b-random'): pass"
    rm -rf /tmp/qwen3-0.6b-tok && cp -r /tmp/qwen3-0.6b-random /tmp/qwen3-0.6b-tok && cp "$tok"/* /tmp/qwen3-0.6b-tok/
}

structured_bench() {
    local spec model=/tmp/qwen3-0.6b-tok spy_cmd=()
    if [ "${1:-}" = --py-spy ]; then
        shift
        spy_cmd=("$site/bin/py-spy" record --rate 200 --threads --idle --nonblocking --format raw
            --output "$out/structured.pyspy" --)
    fi
    tok_model
    IFS=';' read -ra specs <<<"${SPECS:---kind json --constrained 0.5;--kind regex --constrained 1.0}"
    for spec in "${specs[@]}"; do
        # shellcheck disable=SC2086
        timeout 200 "${spy_cmd[@]}" python3 apps/bench_structured.py --model "$model" --attention-backend triton \
            $spec "$@" 2>&1 | grep -v "Loading weights" | tee -a "$out/structured.log" | tail -n 6
        spy_cmd=()
    done
    if [ -f "$out/structured.pyspy" ]; then
        python3 apps/pyspy_summary.py "$out/structured.pyspy" --top 12 >"$out/structured.txt" 2>&1
    fi
}

case "$stage" in
a)
    gpu_tests "$@" ;;
b)
    python3 .gpu/tools/fa4-smoke.py 2>&1 | tail -n 2
    gpu_tests -k "fa4 or flash"
    TORCH_LOGS=recompiles timeout 400 "${bench[@]}" --backends flash_attn,triton --hf --hf-batch-size 256 \
        --step-stats --profile "$out" "$@" 2>&1 | grep -v "Loading weights" | tee "$out/bench.log" | tail -n 60
    # At most 8 files come back: the traces travel as one.
    tar -C "$out" -cf "$out/traces.tar" $(cd "$out" && ls trace-*.json.gz) && rm -f "$out"/trace-*.json.gz
    echo "== summary =="; sed -n '/^engine /,$p' "$out/bench.log" | head -n 8 ;;
tests)
    gpu_tests
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
stream|http)
    # Issue 15, two calls: `stream`: bench_stream, 5 rounds of 4x64 and 8x32 through AsyncClient, with
    # py-spy on the engine from the second round of the first shape (~4 min); `http`: 5 rounds of 4x64
    # through the OpenAI frontend (4 workers), then bench_serve's sweeps and plots (~6 min).
    python3 -m pip install -q --no-deps --no-build-isolation --target "$site" . >"$out/install.log" 2>&1 \
        || tail -n 5 "$out/install.log"  # the frontends register through entry points: a real install
    pkill -9 -f '[n]anostream serve'  # an engine a killed run left behind would hold the GPU
    common=(--preset qwen3-0.6b --build-dir /tmp/qwen3-0.6b-random --attention-backend triton)
    if [ "$stage" = stream ]; then
        timeout "${STREAM_S:-400}" python3 apps/bench_stream.py "${common[@]}" --shapes 4x64,8x32 --runs 5 "$@" \
            >"$out/stream.log" 2>&1 &
        bs=$!
        for _ in $(seq 1 300); do grep -q "^client 4x64 round 0" "$out/stream.log" && break; kill -0 $bs || break; sleep 1; done
        pid=$(grep -o -m1 'engine pid [0-9]*' "$out/stream.log" | awk '{print $3}')
        if [ -n "$pid" ] && [ -x "$site/bin/py-spy" ]; then  # the engine, and one client process beside it
            timeout 40 "$site/bin/py-spy" record --pid "$pid" --duration 10 --rate 250 --threads --idle --nonblocking \
                --format raw --output "$out/engine.pyspy" >"$out/pyspy.log" 2>&1 &
            spy=$!
            client=$(pgrep -n -f '[s]pawn_main')
            timeout 40 "$site/bin/py-spy" record --pid "$client" --duration 10 --rate 250 \
                --idle --nonblocking --format raw --output "$out/client.pyspy" >>"$out/pyspy.log" 2>&1
            wait $spy
            # Where a client process's CPU goes, per thread (its Python, ZeroMQ's I/O thread, ...): jiffies
            # (1/100 s) of user + system time, 5 s apart.
            for _ in 1 2; do
                for t in /proc/"$client"/task/*; do echo -n "$(cat "$t/comm"):$(awk '{print $14 + $15}' "$t/stat") "; done
                echo; sleep 5
            done >"$out/client-threads.txt" 2>&1
            # The engine again over two 8x32 rounds: the shape whose rounds spread most, so that a slow
            # round's profile can be set beside a fast one's (each round's figures say which is which).
            for _ in $(seq 1 300); do grep -q "^client 8x32 round 0" "$out/stream.log" && break; kill -0 $bs || break; sleep 1; done
            timeout 60 "$site/bin/py-spy" record --pid "$pid" --duration 24 --rate 250 --threads --idle --nonblocking \
                --format raw --output "$out/engine-8x32.pyspy" >>"$out/pyspy.log" 2>&1
        fi
        wait $bs
        grep -v -E "INFO|Loading weights" "$out/stream.log" | tail -n 40
        [ -f "$out/engine.pyspy" ] && python3 apps/pyspy_summary.py "$out/engine.pyspy" --top 15 2>&1 | head -n 40
        [ -f "$out/client-threads.txt" ] && echo "client threads (jiffies, 5 s apart):" && cat "$out/client-threads.txt"
        # At most 8 files come back: the profiles' summaries in one, the raw profiles in one tar.
        for f in engine engine-8x32 client; do
            [ -f "$out/$f.pyspy" ] && echo "== $f ==" && python3 apps/pyspy_summary.py "$out/$f.pyspy" --top 30 2>&1
        done >"$out/profiles.txt"
        (cd "$out" && tar -cf pyspy.tar ./*.pyspy && rm -f ./*.pyspy)
    else
        timeout "${STREAM_S:-300}" python3 apps/bench_stream.py "${common[@]}" --shapes 4x64 --runs 5 \
            --http-workers "${WORKERS:-8}" "$@" >"$out/stream-http.log" 2>&1
        grep -v -E "INFO|Loading weights" "$out/stream-http.log" | tail -n 20
        pkill -9 -f '[n]anostream serve'
        if [ "${SERVE_S:-120}" != 0 ]; then  # SERVE_S=0: only the HTTP sweep
            timeout "${SERVE_S:-120}" python3 apps/bench_serve.py "${common[@]}" --concurrency 1,16,64,256 \
                --rates 16,64 --max-concurrency 256 --input-len 512 --output-len 128 --out "$out/serving" >"$out/serve.log" 2>&1
            grep -E "concurrency|rate|wrote" "$out/serve.log" | tail -n 8
            pkill -9 -f '[n]anostream serve'
        fi
        timeout "${HTTP_S:-100}" python3 apps/bench_serve.py "${common[@]}" --concurrency 16,64,256 \
            --http-workers "${WORKERS:-8}" --input-len 512 --output-len 128 --out "$out/serving-http" \
            >"$out/serve-http.log" 2>&1
        grep -E "concurrency|rate|wrote" "$out/serve-http.log" | tail -n 5
        tar -C "$out" -cf "$out/serving.tar" serving serving-http 2>/dev/null && rm -rf "$out/serving" "$out/serving-http"
    fi ;;
profile)
    # Where the time goes, for what the figures above do not explain: py-spy on the engine (second
    # AsyncClient round), on the frontend's workers (second HTTP round) and on bench_structured.
    python3 -m pip install -q --no-deps --no-build-isolation --target "$site" . >"$out/install.log" 2>&1 \
        || tail -n 5 "$out/install.log"
    pkill -9 -f '[n]anostream serve'
    spy() {  # spy NAME PID SECONDS [py-spy options]: a raw profile into $out/NAME.pyspy
        local name=$1 pid=$2 secs=$3; shift 3
        [ -n "$pid" ] && timeout $((secs + 20)) "$site/bin/py-spy" record --pid "$pid" --duration "$secs" --rate 250 \
            --threads --idle --nonblocking --format raw --output "$out/$name.pyspy" "$@" >>"$out/pyspy.log" 2>&1
    }
    wait_for() { for _ in $(seq 1 300); do grep -q "$1" "$out/profile.log" && return; sleep 1; done; }
    timeout "${STREAM_S:-220}" python3 apps/bench_stream.py --preset qwen3-0.6b --build-dir /tmp/qwen3-0.6b-random \
        --attention-backend triton --shapes 4x64 --runs 3 --http-workers 4 "$@" >"$out/profile.log" 2>&1 &
    bs=$!
    wait_for "^client [0-9x]* round 0"
    spy engine "$(grep -o -m1 'engine pid [0-9]*' "$out/profile.log" | awk '{print $3}')" 6
    wait_for "^http [0-9x]* round 0"
    spy frontend "$(pgrep -o -f '[n]anostream frontend openai')" 6 --subprocesses
    wait $bs
    grep -v -E "INFO|Loading weights" "$out/profile.log" | tail -n 16
    for f in engine frontend; do
        [ -f "$out/$f.pyspy" ] && python3 apps/pyspy_summary.py "$out/$f.pyspy" --top 10 >"$out/$f.txt" 2>&1
    done
    structured_bench --py-spy ;;
interval)
    # What stream_interval buys through HTTP at 256 streams: per interval in INTERVALS, one bench_stream run
    # of RUNS rounds of 4x64 through the frontend at each worker count of WORKERS (one table each).
    python3 -m pip install -q --no-deps --no-build-isolation --target "$site" . >"$out/install.log" 2>&1 \
        || tail -n 5 "$out/install.log"
    for si in ${INTERVALS:-1 4}; do
        pkill -9 -f '[n]anostream (serve|frontend)'
        timeout "${STREAM_S:-240}" python3 apps/bench_stream.py --preset qwen3-0.6b --build-dir /tmp/qwen3-0.6b-random \
            --attention-backend triton --shapes 4x64 --runs "${RUNS:-2}" --http-workers "${WORKERS:-2,8}" --http-only \
            --stream-interval "$si" "$@" >"$out/interval-$si.log" 2>&1
        grep -v -E "INFO|Loading weights" "$out/interval-$si.log" | grep -E "^(==|shape|4x64)" | tail -n 24
    done ;;
phases)
    # Where an offline round's time goes (issue 15): prefill phase and decode phase, host and device wait per
    # step, with the prefill CUDA graphs, then eagerly (no CUDA graph at all), then a profile of 8 prefill steps.
    phases=(python3 apps/bench_phases.py --preset qwen3-0.6b --build-dir /tmp/qwen3-0.6b-random --attention-backend triton)
    for extra in "" "--enforce-eager" "--rounds 1 --profile-steps 8"; do
        echo "== bench_phases $extra"
        # shellcheck disable=SC2086
        timeout 200 "${phases[@]}" $extra "$@" 2>&1 | grep -v "Loading weights" | tee -a "$out/phases.log" \
            | grep -E "^(round|  )"
    done ;;
tp)
    # Issue 17: tensor parallelism on two GPUs, NVLink multicast off (KINDS.md).
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    part=${1:?usage: gpu_suite.sh tp tests|bench-0.6b|bench-8b|stream|steps}; shift
    python3 -m pip install -q --no-deps --no-build-isolation --target "$site" . >"$out/install.log" 2>&1 \
        || tail -n 5 "$out/install.log"  # the engine's workers start through the installed entry point
    nvidia-smi topo -m | head -n 4
    case "$part" in
    tests)
        timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 tests/test_gpu.py -k two_gpus "$@" \
            2>&1 | tee "$out/tp-tests.log" | tail -n 15 ;;
    bench-0.6b | bench-8b)
        preset=qwen3-${part#bench-}
        for tp in 1 2; do
            echo "== $preset tp=$tp"
            timeout 280 python3 apps/bench.py --preset "$preset" --build-dir "/tmp/$preset-random" --backends triton \
                --tensor-parallel-size "$tp" --step-stats "$@" 2>&1 | grep -v "Loading weights" \
                | tee "$out/tp-$preset-$tp.log" | tail -n 12
        done ;;
    stream)
        timeout 560 python3 apps/bench_stream.py --preset qwen3-0.6b --build-dir /tmp/qwen3-0.6b-random \
            --attention-backend triton --tensor-parallel-size 2 --shapes 4x64,8x32 --runs 3 "$@" 2>&1 \
            | grep -v -E "INFO|Loading weights" | tee "$out/tp-stream.log" | tail -n 16 ;;
    steps)
        for batch in 1 256; do
            for tp in 1 2; do
                echo "== qwen3-8b batch $batch tp=$tp"
                timeout 140 python3 apps/bench_phases.py --preset qwen3-8b --build-dir /tmp/qwen3-8b-random \
                    --attention-backend triton --tensor-parallel-size "$tp" --num-requests "$batch" \
                    --min-input-len 1024 --max-input-len 1024 --min-output-len 256 --max-output-len 256 \
                    --rounds 1 --floor "$@" 2>&1 | grep -E "^(round|decode floor)" | tee -a "$out/tp-steps.log"
            done
        done ;;
    *)
        echo "unknown tp part $part"; exit 2 ;;
    esac ;;
regress)
    # Issue 16's check that tp=1 did not regress: the same bench in two checkouts on one warm machine.
    old=${OLD:-.gpu/old}
    [ -e "$old/nanostream/kernels" ] || ln -s ../kernels "$old/nanostream/kernels"
    i=0
    for side in new old new old; do
        i=$((i + 1)); dir=$PWD; [ "$side" = old ] && dir=$old
        (cd "$dir" && PYTHONPATH="$dir:$site" timeout 200 "${bench[@]}" --backends triton --step-stats "$@" 2>&1) \
            | grep -v "Loading weights" >"$out/regress-$i-$side.log"
        echo "$side: $(grep -E '^nanostream.*output tok/s' "$out/regress-$i-$side.log" | tail -n 1)" | tee -a "$out/regress.txt"
    done ;;
structured)
    structured_bench "$@" ;;
service)
    # Issue 30: the one command at its defaults, `nanostream serve MODEL --openai-port P` (its own
    # --openai-workers auto, its default attention backend): the offline runs, then 3 rounds of 4x64 HTTP
    # SSE streams from aiohttp client processes, then 1,024 requests at once, each on a connection of its
    # own; then the same rounds through `nanostream frontend openai --workers 8` for comparison (~7 min).
    python3 -m pip install -q --no-deps --no-build-isolation --target "$site" . >"$out/install.log" 2>&1 \
        || tail -n 5 "$out/install.log"  # the frontends register through entry points: a real install
    timeout "${SERVICE_S:-330}" python3 apps/bench_stream.py --preset qwen3-0.6b --build-dir /tmp/qwen3-0.6b-random \
        --shapes 4x64 --runs 3 --http-service --connections 1024 "$@" >"$out/service.log" 2>&1
    grep -v -E "INFO|Loading weights|^service: " "$out/service.log" | tail -n 14
    pkill -9 -f '[n]anostream (serve|frontend)'
    if [ "${WORKERS_S:-150}" != 0 ]; then
        timeout "${WORKERS_S:-150}" python3 apps/bench_stream.py --preset qwen3-0.6b --build-dir /tmp/qwen3-0.6b-random \
            --shapes 4x64 --runs 3 --http-workers 8 --http-only "$@" >"$out/service-w8.log" 2>&1
        grep -v -E "INFO|Loading weights" "$out/service-w8.log" | tail -n 8
    fi ;;
dialects)
    # Issue 59: 3 rounds of 4x64 SSE streams through 8 frontend workers on each route in turn, one engine: the
    # token-id completions route (the baseline), the Responses API, Anthropic's Messages API; each round ÷ the median
    # of three offline runs in the same call, every route and offline on the same prompt ids (~5 min).
    python3 -m pip install -q --no-deps --no-build-isolation --target "$site" . >"$out/install.log" 2>&1 \
        || tail -n 5 "$out/install.log"
    tok_model  # the dialects send text: the random model's own 512-token tokenizer spells few of the ids
    timeout "${DIALECT_S:-420}" python3 apps/bench_stream.py --model /tmp/qwen3-0.6b-tok --shapes 4x64 --runs 3 \
        --http-workers 8 --http-only --http-api completions,responses,messages "$@" >"$out/dialects.log" 2>&1
    grep -v -E "INFO|Loading weights" "$out/dialects.log" | grep -E "^(offline run|==|shape|4x64|worst)" ;;
families)
    # Issue 32 in one call (~5 min): gpt-oss-20b and Gemma-3-4B (dummy bf16 weights) on the bench workload
    # and at batch 1, bench_kernels' window section, then the gpu-marked window, sink and MoE tests while
    # time is left (FAMILY_TESTS=0 skips them).
    one=(--num-requests 1 --min-input-len 128 --max-input-len 128 --min-output-len 512 --max-output-len 512)
    for preset in gpt-oss-20b gemma-3-4b; do
        timeout 150 python3 apps/bench.py --preset "$preset" --build-dir "/tmp/$preset" --backends triton \
            --step-stats "$@" 2>&1 | grep -v "Loading weights" >"$out/$preset.log"
        tail -n 12 "$out/$preset.log"
    done
    timeout 70 python3 apps/bench_kernels.py --sections window --out "$out/window.json" 2>&1 >"$out/window.log"
    tail -n 14 "$out/window.log"
    for preset in gpt-oss-20b gemma-3-4b; do
        timeout 60 python3 apps/bench.py --preset "$preset" --build-dir "/tmp/$preset" --backends triton "${one[@]}" \
            "$@" 2>&1 | grep -v "Loading weights" >"$out/$preset-1.log"
        tail -n 4 "$out/$preset-1.log"
    done
    if [ "${FAMILY_TESTS:-1}" != 0 ]; then
        timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/test_attention_window.py \
            tests/test_kernels.py -k "window or sink" >"$out/test_window.log" 2>&1
        echo "== window tests: $(tail -n 1 "$out/test_window.log")"
        grep -E "^(FAILED|ERROR)" "$out/test_window.log" | head -n 5
    fi ;;
fp8kv)
    # Issue 33's KV half (~4 min): the gpu-marked FP8 KV tests, then the bench workload on the 0.6B shape with
    # a bf16 cache and an FP8 one, one call, side by side.
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_kv.py >"$out/test_fp8_kv.log" 2>&1
    echo "== FP8 KV tests: $(tail -n 1 "$out/test_fp8_kv.log")"; grep -E "^(FAILED|ERROR)" "$out/test_fp8_kv.log" | head -n 5
    for kv in auto fp8; do
        timeout 120 "${bench[@]}" --backends triton --kv-cache-dtype "$kv" --step-stats "$@" 2>&1 \
            | grep -v "Loading weights" | tee "$out/bench-kv-$kv.log" | tail -n 6
    done ;;
fp8)
    b16=(python3 apps/bench.py --preset qwen3-8b --tiny-config '{"weights": false}' --build-dir /tmp/8b-bf16
         --load-format dummy --backends triton)
    f8=(python3 apps/bench.py --preset qwen3-8b-fp8 --build-dir /tmp/8b-fp8 --backends triton)
    one=(--num-requests 1 --min-input-len 128 --max-input-len 128 --min-output-len 512 --max-output-len 512)
    case ${1:?usage: gpu_suite.sh fp8 tests|bench|one|agree} in
    tests)
        for t in fp8_weights fp8_gemm fp8_gemv fp8_kv; do  # one process each: a file's engines leave the next its memory
            timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider "tests/test_$t.py" >"$out/test_$t.log" 2>&1
            echo "== $t: $(tail -n 1 "$out/test_$t.log")"; grep -E "^(FAILED|ERROR)" "$out/test_$t.log" | head -n 5
        done
        timeout 150 python3 apps/bench_kernels.py --sections fp8 --out "$out/fp8-kernels.json" >"$out/fp8-kernels.log" 2>&1
        tail -n 30 "$out/fp8-kernels.log" ;;
    bench | one)
        extra=(); [ "$1" = one ] && extra=("${one[@]}")
        for run in "bf16" "fp8w" "fp8w+kv"; do
            cmd=("${b16[@]}"); [ "$run" != bf16 ] && cmd=("${f8[@]}")
            [ "$run" = "fp8w+kv" ] && cmd+=(--kv-cache-dtype fp8)
            echo "== $run: ${cmd[*]} ${extra[*]}"
            timeout 170 "${cmd[@]}" "${extra[@]}" --step-stats 2>&1 | grep -v "Loading weights" \
                | tee "$out/fp8-$1-${run/+/-}.log" | grep -E "KV blocks|output tok/s|decode|prefill" | head -n 14
        done ;;
    agree)
        timeout 300 python3 apps/fp8_agreement.py --preset qwen3-8b-fp8 --build-dir /tmp/8b-fp8 2>&1 | tail -n 4 ;;
    esac ;;
invariant)
    case ${1:?usage: gpu_suite.sh invariant tests|soak} in
    tests)  # the gpu-marked batch-invariance tests, then the bench workload without and with the mode, same call
        timeout 240 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_batch_invariant.py \
            >"$out/test_batch_invariant.log" 2>&1
        echo "== batch-invariant tests: $(tail -n 1 "$out/test_batch_invariant.log")"
        grep -E "^(FAILED|ERROR)|^E  |without batch_invariant" "$out/test_batch_invariant.log" | head -n 12
        for mode in --no-batch-invariant --batch-invariant; do
            echo "== bench $mode"
            timeout 150 "${bench[@]}" --backends triton "$mode" 2>&1 | grep -v "Loading weights" \
                | tee "$out/bench$mode.log" | tail -n 5
        done ;;
    soak)  # apps/soak.py with the mode, bf16 then float32: 90 s each, 3 kills, every stream against offline
        [ -d /tmp/qwen3-0.6b-random ] || timeout 120 "${bench[@]}" --backends triton --num-requests 1 >/dev/null 2>&1
        for dtype in ${SOAK_DTYPES:-bfloat16 float32}; do
            echo "== soak $dtype"
            timeout 290 python3 apps/soak.py --model /tmp/qwen3-0.6b-random --device cuda --dtype "$dtype" \
                --num-kvcache-blocks 1024 --clients 8 --streams 32 --requests 0 --seconds 90 --kills 3 \
                --batch-invariant 2>&1 | tee "$out/soak-$dtype.log" | tail -n 8
        done ;;
    esac ;;
*)
    echo "unknown stage $stage"; exit 2 ;;
esac
