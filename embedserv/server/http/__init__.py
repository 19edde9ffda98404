"""The HTTP APIs (OpenAI-compatible, Cohere/Jina rerank, TEI) served beside gRPC; see app.py."""
