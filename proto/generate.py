"""Regenerate the checked-in Python stubs: `python proto/generate.py [OUT_ROOT]`.

Writes embedserv/v1/embedserv_pb2{.py,.pyi,_grpc.py} (the server's copy) and the same three files under
clients/python/embedserv_client/v1/ (the client package's copy, which must not need the server package),
both under OUT_ROOT (default: the repository root). The stub drift test runs this into a temporary folder
and compares.
"""

import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILE = "embedserv/v1/embedserv.proto"
STUBS = ("embedserv_pb2.py", "embedserv_pb2.pyi", "embedserv_pb2_grpc.py")
SERVER_STUBS = Path("embedserv/v1")
CLIENT_STUBS = Path("clients/python/embedserv_client/v1")
# The generated service module imports its messages by the proto's package path; the client's copy
# imports its own.
SERVER_IMPORT = "from embedserv.v1 import embedserv_pb2"
CLIENT_IMPORT = "from embedserv_client.v1 import embedserv_pb2"


def run_protoc(out_dir: Path) -> None:
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        PROTO_FILE,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE}")


def generate(out_root: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_protoc(Path(tmp))
        fresh = Path(tmp) / SERVER_STUBS
        for folder in (SERVER_STUBS, CLIENT_STUBS):
            (out_root / folder).mkdir(parents=True, exist_ok=True)
        for name in STUBS:
            shutil.copyfile(fresh / name, out_root / SERVER_STUBS / name)
            text = (fresh / name).read_text()
            if name == "embedserv_pb2_grpc.py":
                if SERVER_IMPORT not in text:
                    raise RuntimeError(f"{name} no longer imports its messages as {SERVER_IMPORT!r}")
                text = text.replace(SERVER_IMPORT, CLIENT_IMPORT)
            (out_root / CLIENT_STUBS / name).write_text(text)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT.parent)
