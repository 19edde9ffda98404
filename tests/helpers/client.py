"""Thin helpers over the generated stubs for e2e tests."""

from __future__ import annotations

import grpc
import numpy as np

RPC_TIMEOUT_S = 120.0


def inference_stub(channel):
    from embedserv.v1 import embedserv_pb2_grpc as pb_grpc

    return pb_grpc.InferenceStub(channel)


def embed_request(inputs, **fields):
    from embedserv.v1 import embedserv_pb2 as pb

    return pb.EmbedRequest(inputs=list(inputs), **fields)


def response_matrix(response) -> np.ndarray:
    """[n, d] float32 from an EmbedResponse, whichever encoding it carries."""
    rows = []
    for emb in response.embeddings:
        if emb.raw:
            rows.append(np.frombuffer(emb.raw, dtype="<f4"))
        else:
            rows.append(np.asarray(emb.values, dtype=np.float32))
    return np.stack(rows) if rows else np.zeros((0, 0), dtype=np.float32)


def embed_all(stub, texts: list[str], chunk: int, **fields) -> tuple[np.ndarray, list]:
    """Embed texts in requests of at most `chunk` inputs; return the stacked matrix and the responses."""
    responses = [
        stub.Embed(embed_request(texts[i : i + chunk], **fields), timeout=RPC_TIMEOUT_S)
        for i in range(0, len(texts), chunk)
    ]
    return np.concatenate([response_matrix(r) for r in responses]), responses


def outcome(future) -> grpc.StatusCode:
    """How a call started with `stub.Method.future(...)` ended; CANCELLED also when this client cancelled it."""
    try:
        future.result()
    except grpc.FutureCancelledError:
        return grpc.StatusCode.CANCELLED
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def serve_fake_inference(servicer):
    """Serves a fake Inference servicer (the client package's stubs) on a free local port in this process;
    yields (servicer, target) and stops the server on exit. For generator fixtures."""
    from concurrent import futures

    from embedserv_client.v1 import embedserv_pb2_grpc as client_pb_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    client_pb_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(None)
