"""The gRPC face: our Inference service, TEI's tei.v1 services, health and reflection, and how an engine error
becomes a status code. app.py builds the server and runs it; services.py registers everything on it."""
