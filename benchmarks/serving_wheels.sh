#!/usr/bin/env bash
# Download the wheels that `minivllm serve`, benchmarks/bench_serving.py and tests/test_server.py need on a machine that
# has the engine's dependencies (torch, numpy, transformers, tokenizers, safetensors, jinja2, tqdm)
# but no network: Python 3.12, x86-64 Linux. Run it where pip can reach the package index; carry
# the folder; install there with (no index, no dependency resolution, into a folder of its own):
#
#   bash benchmarks/serving_wheels.sh [DIR]            # default DIR: .whl
#   pip install --no-index --no-deps --target .serving_pkgs .whl/*.whl      # on the GPU machine
#   export PYTHONPATH=$PWD/.serving_pkgs:$PWD
#
# Versions are the ones the server tests pass with. uvloop and httptools are optional speed-ups
# that uvicorn picks up by itself (a faster event loop and HTTP parser).
set -euo pipefail
DIR=${1:-.whl}
PYTHON=${PYTHON:-python3}
WHEELS=(
  # the server
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  anyio==4.16.0 idna==3.20 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 prometheus-client==0.26.0
  uvloop==0.23.0 httptools==0.9.0
  # the benchmark client
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
  multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
  # the OpenAI client that tests/test_server.py talks to the server with
  openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
)
mkdir -p "$DIR"
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" "${WHEELS[@]}"
echo "$(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
