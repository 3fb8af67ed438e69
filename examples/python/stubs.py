"""Generates the gRPC stubs from the repository's .proto files with grpcio-tools, into
`generated/` beside this file (not committed; regenerated when a .proto is newer), and imports them.

    python stubs.py            # generate (the "build" step); orchestrate.py also does it on first use
"""

import os
import sys

from grpc_tools import protoc

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
OUT = os.path.join(HERE, "generated")
PROTOS = ["orchestrator/v1/orchestrator.proto", "toolrunner/v1/tool_runner.proto"]


def _stale():
    stamp = os.path.join(OUT, ".built")
    if not os.path.exists(stamp):
        return True
    built = os.path.getmtime(stamp)
    return any(os.path.getmtime(os.path.join(PROTO_ROOT, p)) > built for p in PROTOS)


def generate():
    """Runs protoc (grpcio-tools) on every contract; raises SystemExit naming the one that failed."""
    os.makedirs(OUT, exist_ok=True)
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    for proto in PROTOS:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={OUT}", f"--grpc_python_out={OUT}", proto]
        if protoc.main(args) != 0:
            raise SystemExit(f"grpc_tools.protoc failed on {proto}")
    for package in ("orchestrator", "orchestrator/v1", "toolrunner", "toolrunner/v1"):
        open(os.path.join(OUT, package, "__init__.py"), "a").close()
    open(os.path.join(OUT, ".built"), "w").close()


def load():
    """The generated modules: (orchestrator_pb2, orchestrator_pb2_grpc)."""
    if _stale():
        generate()
    if OUT not in sys.path:
        sys.path.insert(0, OUT)
    from orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc

    return orchestrator_pb2, orchestrator_pb2_grpc


if __name__ == "__main__":
    generate()
    print(f"stubs generated in {OUT}")
