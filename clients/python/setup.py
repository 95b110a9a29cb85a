"""Builds the package with its gRPC stubs generated from the Holdfast protocol files.

The protocol lives in the repository's proto/holdfast/v1 (the contract for every client); the stubs are
generated into the build directory by grpcio-tools on every build, so they always match it. Set
HOLDFAST_PROTO_DIR to build from a copy of the protocol elsewhere.
"""

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PROTOS = ["holdfast/v1/lock.proto", "holdfast/v1/fence.proto"]


def proto_dir() -> Path:
    root = Path(os.environ.get("HOLDFAST_PROTO_DIR", HERE.parent.parent / "proto"))
    if not (root / PROTOS[0]).is_file():
        raise SystemExit(
            f"cannot find {PROTOS[0]} under {root}: build from a Holdfast checkout "
            "(pip install ./clients/python) or set HOLDFAST_PROTO_DIR"
        )
    return root


def protobuf_requirement() -> str:
    """The protobuf runtime the generated code needs: the major version grpcio-tools generates for, at
    least at the version it was built with (the stubs check this when imported)."""
    try:
        from google.protobuf import __version__ as v
    except ImportError:  # metadata-only steps may run without the build requirements
        return "protobuf>=5.27"
    major = int(v.split(".")[0])
    return f"protobuf>={v},<{major + 1}"


class BuildWithStubs(build_py):
    def run(self) -> None:
        super().run()
        from grpc_tools import protoc
        import grpc_tools

        out = Path(self.build_lib)
        include = Path(grpc_tools.__file__).parent / "_proto"
        args = [
            "grpc_tools.protoc",
            f"-I{proto_dir()}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *PROTOS,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("grpc_tools.protoc failed on " + ", ".join(PROTOS))
        (out / "holdfast" / "v1" / "__init__.py").write_text(
            '"""Generated from proto/holdfast/v1 by grpcio-tools at build time."""\n'
        )


def grpcio_requirement() -> str:
    """The stubs refuse a grpcio older than the grpcio-tools that generated them."""
    try:
        from grpc_tools.grpc_version import VERSION
    except ImportError:
        return "grpcio>=1.66"
    return f"grpcio>={VERSION}"


setup(
    cmdclass={"build_py": BuildWithStubs},
    install_requires=[grpcio_requirement(), protobuf_requirement()],
)
