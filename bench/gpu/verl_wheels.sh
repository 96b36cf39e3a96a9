#!/bin/bash
# Downloads into .whl-verl/ (git-ignored) verl 0.9.1 and every package it needs that the H200 machine
# lacks once ../shared/gpu's packs are there (its image: torch 2.11, transformers 5.17, pyarrow, pandas,
# accelerate, peft, tensorboard, ...; rayprefect-1: ray 2.60, uvicorn, orjson, jsonschema, ...;
# vllm-1/-2: vLLM 0.26, pydantic, fastapi, starlette, pyzmq, msgspec, ...): ~5 MiB of Python 3.12 wheels.
# Found by importing verl's trainer, FSDP engine, vLLM server, agent and reward loops and every other
# module of verl's (less Megatron, NPU, SGLang, TRT-LLM) with only those packages present. uvicorn and
# orjson are also in rayprefect-1, at the same versions: carried so verl does not depend on it for them.
# On the machine: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
#   --target /tmp/site .whl-verl/*.whl    (bench/gpu/verl_peer.py's docstring has the whole command)
set -euo pipefail
REPO=$(git rev-parse --show-toplevel)
OUT="$REPO/.whl-verl"
PLAT="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
# verl's own requirements, less those already there; TransferQueue (its default v1 trainer's data plane),
# tensordict's and hydra's needs, and what vLLM's OpenAI server (verl's rollout server) imports beyond the pack
WHEELS="verl==0.9.1 transferqueue==0.1.11 codetiming==1.4.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
 hydra-core==1.3.8 omegaconf==2.3.0 pylatexenc==2.11 torchdata==0.11.0 tensordict==0.10.0 pyvers==0.1.0
 importlib-metadata==10.2.0 orjson==3.13.0 uvicorn==0.55.0 prometheus-fastapi-instrumentator==8.1.0
 watchfiles==1.3.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0"
grep -qx "/.whl-verl/" "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null \
  || echo "/.whl-verl/" >> "$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$OUT"
# shellcheck disable=SC2086
python3 -m pip download -q $PLAT -d "$OUT" $WHEELS
# hydra-core's antlr4 runtime is published as a source archive only: build its (pure Python) wheel here
python3 -m pip wheel -q --no-deps -w "$OUT" antlr4-python3-runtime==4.9.3
ls "$OUT" | wc -l && du -sh "$OUT"
