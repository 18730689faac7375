#!/usr/bin/env bash
# fetch_serve_wheels.sh [DIR] — download the wheels `drvqwen serve` and its tests need (Starlette,
# uvicorn, prometheus_client, the openai client, httpx and their dependencies) for the GPU
# machines (CPython 3.12, x86-64 Linux), which have no network. DIR (default .carry/wheels,
# git-ignored) is carried there; `tools/gpu_check.sh serve` installs from it. ~7 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.carry/wheels}
mkdir -p "$DIR"
python3 -m pip download --dest "$DIR" --only-binary=:all: --implementation cp --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any \
    'starlette>=0.37' 'uvicorn>=0.30' 'prometheus_client>=0.20' 'openai>=1.40' 'httpx>=0.27'
du -sh "$DIR"
