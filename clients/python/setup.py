"""Builds the package with its gRPC stubs generated from the Holdfast protocol files.

The protocol lives in the repository's proto/holdfast/v1 (the contract for every client). Every build
regenerates the stubs with grpcio-tools (a build requirement) into src/holdfast/v1, which is not checked in,
so they always match the protocol; a package built from anything but a Holdfast checkout needs
HOLDFAST_PROTO_DIR pointing at a copy of proto/. The runtime requirements follow the generator: grpcio at
least the grpcio-tools version, protobuf of the major version the stubs were generated for and at least
that version (the stubs check both when imported).
"""

import os
import re
import shutil
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
PROTOS = ["holdfast/v1/lock.proto", "holdfast/v1/fence.proto"]
OUT = HERE / "src"


def proto_dir() -> Path:
    root = Path(os.environ.get("HOLDFAST_PROTO_DIR", HERE.parent.parent / "proto"))
    if not (root / PROTOS[0]).is_file():
        raise SystemExit(
            f"cannot find {PROTOS[0]} under {root}: build from a Holdfast checkout "
            "(pip install ./clients/python) or set HOLDFAST_PROTO_DIR"
        )
    return root


def generate() -> list[str]:
    """Generates the stubs and returns the runtime requirements they need."""
    try:
        import grpc_tools
        from grpc_tools import protoc
        from grpc_tools.grpc_version import VERSION as grpc_version
    except ImportError:
        raise SystemExit("building the holdfast package needs grpcio-tools (pip install grpcio-tools)")
    target = OUT / "holdfast" / "v1"
    shutil.rmtree(target, ignore_errors=True)  # nothing stale from a removed .proto
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir()}",
        f"-I{include}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("grpc_tools.protoc failed on " + ", ".join(PROTOS))
    (target / "__init__.py").write_text(
        '"""Generated from proto/holdfast/v1 by grpcio-tools when the package was built."""\n'
    )
    header = (target / "lock_pb2.py").read_text()
    m = re.search(r"^# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", header, re.M)
    if m is None:
        raise SystemExit("cannot tell which protobuf version the generated stubs need")
    major = int(m.group(1))
    return [f"grpcio>={grpc_version}", f"protobuf>={'.'.join(m.groups())},<{major + 1}"]


setup(install_requires=generate())
