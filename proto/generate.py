"""Regenerate the checked-in Python stubs: `python proto/generate.py [OUT_ROOT]`.

Writes, under OUT_ROOT (default: the repository root):
- embedserv/v1/embedserv_pb2{.py,.pyi,_grpc.py}: the server's copy of our contract, and the same three files
  under clients/python/embedserv_client/v1/ (the client package's copy, which must not need the server package);
- embedserv/tei/v1/tei_pb2{.py,.pyi,_grpc.py}: TEI's contract (proto/tei/v1/tei.proto), served beside ours.
The stub drift test runs this into a temporary folder and compares.
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
# TEI's package is tei.v1; its stubs live inside ours, so its service module's import is rewritten too.
TEI_PROTO_FILE = "tei/v1/tei.proto"
TEI_STUBS = ("tei_pb2.py", "tei_pb2.pyi", "tei_pb2_grpc.py")
TEI_SERVER_STUBS = Path("embedserv/tei/v1")
TEI_IMPORT = "from tei.v1 import tei_pb2"
TEI_SERVER_IMPORT = "from embedserv.tei.v1 import tei_pb2"


def run_protoc(out_dir: Path, proto_file: str) -> None:
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        proto_file,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto_file}")


def _rewrite_import(name: str, text: str, old: str, new: str) -> str:
    if old not in text:
        raise RuntimeError(f"{name} no longer imports its messages as {old!r}")
    return text.replace(old, new)


def generate(out_root: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_protoc(Path(tmp), PROTO_FILE)
        run_protoc(Path(tmp), TEI_PROTO_FILE)
        fresh = Path(tmp) / SERVER_STUBS
        for folder in (SERVER_STUBS, CLIENT_STUBS, TEI_SERVER_STUBS):
            (out_root / folder).mkdir(parents=True, exist_ok=True)
        for name in STUBS:
            shutil.copyfile(fresh / name, out_root / SERVER_STUBS / name)
            text = (fresh / name).read_text()
            if name == "embedserv_pb2_grpc.py":
                text = _rewrite_import(name, text, SERVER_IMPORT, CLIENT_IMPORT)
            (out_root / CLIENT_STUBS / name).write_text(text)
        for name in TEI_STUBS:
            text = (Path(tmp) / "tei/v1" / name).read_text()
            if name == "tei_pb2_grpc.py":
                text = _rewrite_import(name, text, TEI_IMPORT, TEI_SERVER_IMPORT)
            (out_root / TEI_SERVER_STUBS / name).write_text(text)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT.parent)
