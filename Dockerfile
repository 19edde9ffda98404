# syntax=docker/dockerfile:1
# The embedserv image, with the server and embedserv-client. Tags the Helm chart expects:
#   docker build --build-arg VARIANT=cpu  -t ghcr.io/embedserv/embedserv:0.1.0-cpu .
#   docker build --build-arg VARIANT=cuda -t ghcr.io/embedserv/embedserv:0.1.0-cuda .
# TORCH_INDEX overrides the wheel index of either variant, CUDA_IMAGE the CUDA base.

ARG VARIANT=cpu
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04

FROM python:3.11-slim AS base-cpu
# A bare `pip install torch` would pull the CUDA wheels (gigabytes) into a CPU image.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
# g++: inductor compiles int8's quantize / dequantize steps into C++ kernels (--cpu-fusion, cached under
# /tmp); without it they run eagerly, about 1.3-1.6x slower end to end on MiniLM int8. It also builds the
# cpu_varlen attention kernels, the default on AVX-512-bf16 CPUs, at a container's first start (about 11 s on 2
# cores, cached under $HOME); without g++ sdpa runs. tcmalloc: CPU
# workers preload it (--cpu-allocator auto), 1.05-1.12x over glibc's malloc.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch>=2.4,<3"

FROM ${CUDA_IMAGE} AS base-cuda
# Must match the base's CUDA major.minor.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch>=2.4,<3"

FROM base-${VARIANT}
# Bind-mounted, not copied, so the sources stay out of the image. rw: setuptools writes its
# build metadata into the tree; those writes are discarded. The batch extra: `embedserv batch` as a Job.
RUN --mount=type=bind,target=/src,rw \
    pip install --no-cache-dir "/src[batch]" /src/clients/python

RUN groupadd --gid 10001 embedserv \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin embedserv

# HOME=/tmp: caches (torch, triton) land on the writable /tmp when the root filesystem is read-only.
# Bytecode is compiled at install time; nothing may be written next to the sources at run time.
ENV HOME=/tmp \
    HF_HUB_OFFLINE=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 8000 9090
ENTRYPOINT ["embedserv", "serve"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--http-port", "8000", "--metrics-port", "9090"]
