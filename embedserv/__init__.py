"""embedserv: a gRPC inference server for embedding, reranking and classification models."""

__version__ = "0.1.0"
