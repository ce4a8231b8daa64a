#!/usr/bin/env bash
# Wheels for the lent GPU machine (no network there; ../.library/device/README.md): what its image lacks for
# `gpu_bench.sh` (the server's packages) and for the whole suite there (`gpu_bench.sh suite`: the reference
# packages minicpmo-utils, openai, openbmb-realtime), for its Python 3.12 on x86_64. Writes .whl/ (git-ignored;
# pass carry [".whl"] and install with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
binary=(pip download -q --no-deps --python-version 3.12 --platform manylinux2014_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --only-binary=:all: -d .whl)
# the server and the benches (the image has torch, numpy, pyyaml, safetensors, httpx, prometheus-client, onnxruntime)
"${binary[@]}" pydantic pydantic-core annotated-types typing-inspection "typing-extensions>=4.16" annotated-doc \
  fastapi starlette uvicorn websockets opentelemetry-api soxr silero-vad pillow
# the suite's reference clients and their dependencies the image lacks or has too old
"${binary[@]}" openai jiter sniffio distro httpx2 httpcore2 truststore anyio idna h11 "openbmb-realtime==0.1.6"
# minicpmo-utils ships as a source distribution only: build its (pure Python) wheel here
pip wheel -q --no-deps -w .whl "minicpmo-utils==1.0.5"
ls .whl
