"""The per-task services (embedding outputs, encodings, rerank, chunking, multi-vector, classification):
each works through the narrow port of engine/ports.py and never sees the Engine."""
