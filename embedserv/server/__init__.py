"""The gRPC surface: servicers, error mapping, health and reflection."""
