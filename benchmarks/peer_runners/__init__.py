"""The peers of benchmarks/peers.py: one runner module per in-process peer (st, vllm_offline), the server
client and the Infinity ONNX export, each run as `python -m benchmarks.peer_runners.NAME JOB.json` by the
peer's own interpreter (so they import only the standard library, numpy and that venv's packages), and the
driver's helpers (servers, report)."""
