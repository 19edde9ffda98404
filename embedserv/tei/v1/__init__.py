"""Generated gRPC stubs for tei.v1 (see proto/generate.py); do not edit by hand."""
