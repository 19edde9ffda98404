"""Hugging Face text-embeddings-inference's gRPC contract (package tei.v1), served beside ours."""
