"""Generated gRPC stubs for embedserv.v1 (see proto/generate.py); do not edit by hand."""
