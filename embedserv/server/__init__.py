"""The server's faces, gRPC (grpc/) and HTTP (http/), on what they share (frontend.py, calls.py, security.py);
app.py builds and runs them."""
