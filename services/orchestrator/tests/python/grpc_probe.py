#!/usr/bin/env python3
"""Calls the orchestrator and the tool-runner with grpcio (gRPC's C core, not tonic), the way a
service in another language would.

Reads a plan on stdin: {"proto_root": dir, "steps": [step, ...]}, where a step is
  {"name": str, "target": "host:port", "service": "orchestrator" | "runner",
   "method": "Orchestrate" | "GetRun" | "CancelRun" | "ListTools",
   "request": {...proto fields as JSON...},
   "tls": null | {"ca": path, "cert": path?, "key": path?}, "token": str?}
and prints one JSON line per step: {"name", "code" (grpc.StatusCode name), "details", "response"}.
The stubs are generated from the .proto files with grpcio-tools at start (never committed).
Used by services/orchestrator/tests/surfaces/security.rs.
"""

import json
import os
import sys
import tempfile

import grpc
from google.protobuf import json_format
from grpc_tools import protoc

PROTOS = ["orchestrator/v1/orchestrator.proto", "toolrunner/v1/tool_runner.proto"]
TIMEOUT_S = 30


def generate_stubs(proto_root):
    out = tempfile.mkdtemp(prefix="grpc-stubs-")
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    for proto in PROTOS:
        args = ["protoc", f"-I{proto_root}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}", proto]
        if protoc.main(args) != 0:
            raise SystemExit(f"grpc_tools.protoc failed on {proto}")
    sys.path.insert(0, out)
    from orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
    from toolrunner.v1 import tool_runner_pb2, tool_runner_pb2_grpc

    return {
        "orchestrator": (orchestrator_pb2, orchestrator_pb2_grpc.OrchestratorStub),
        "runner": (tool_runner_pb2, tool_runner_pb2_grpc.ToolRunnerStub),
    }


def read(path):
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def channel(step):
    tls = step.get("tls")
    if not tls:
        return grpc.insecure_channel(step["target"])
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(tls.get("ca")),
        private_key=read(tls.get("key")),
        certificate_chain=read(tls.get("cert")),
    )
    return grpc.secure_channel(step["target"], credentials)


REQUEST_TYPES = {
    "Orchestrate": "OrchestrateRequest",
    "GetRun": "GetRunRequest",
    "CancelRun": "CancelRunRequest",
    "AttachRun": "AttachRunRequest",
    "ListTools": "ListToolsRequest",
}
STREAMING = {"Orchestrate", "AttachRun"}


def call(stubs, step):
    pb2, stub_type = stubs[step["service"]]
    request = json_format.ParseDict(step.get("request", {}), getattr(pb2, REQUEST_TYPES[step["method"]])())
    metadata = [("authorization", f"Bearer {step['token']}")] if step.get("token") else []
    as_dict = lambda m: json_format.MessageToDict(m, preserving_proto_field_name=True)
    with channel(step) as ch:
        method = getattr(stub_type(ch), step["method"])
        try:
            if step["method"] in STREAMING:
                response = [as_dict(m) for m in method(request, metadata=metadata, timeout=TIMEOUT_S)]
            else:
                response = as_dict(method(request, metadata=metadata, timeout=TIMEOUT_S))
            return {"name": step["name"], "code": "OK", "details": "", "response": response}
        except grpc.RpcError as e:
            return {"name": step["name"], "code": e.code().name, "details": e.details() or "", "response": None}


def main():
    plan = json.load(sys.stdin)
    stubs = generate_stubs(plan["proto_root"])
    for step in plan["steps"]:
        print(json.dumps(call(stubs, step)), flush=True)


if __name__ == "__main__":
    main()
