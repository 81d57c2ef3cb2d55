#!/usr/bin/env bash
# The wheels the GPU machine's image lacks (Python 3.12, x86-64), downloaded into .whl/ (git-ignored) for the
# device calls to carry: bash apps/gpu_wheels.sh, then carry [".whl", ".gpu"]. A fresh checkout has none.
# Versions: those the CPU machine's install resolved (pip list), so the two run the same code.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
    platforms+=(--platform "$p")
done
# fla-core and einops (the Gated DeltaNet kernels); pyzmq and msgspec (the engine's wire); xgrammar and what it needs
# (structured output); jsonschema and its parts (test_gpu_structured.py); fastapi, uvicorn and what they need (the
# HTTP frontends; starlette 1.10 imports opentelemetry)
packages=(fla-core==0.6.0 einops pyzmq msgspec xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types
    typing-inspection jsonschema jsonschema-specifications referencing rpds-py fastapi uvicorn starlette httptools
    opentelemetry-api typing-extensions idna anyio annotated-doc click h11 prometheus-client uvloop)
pinned=()
for name in "${packages[@]}"; do
    if [[ $name == *==* ]]; then pinned+=("$name"); continue; fi
    version=$(python3 -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    pinned+=("$name${version:+==$version}")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "${pinned[@]}"
ls .whl | wc -l
