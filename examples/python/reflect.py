#!/usr/bin/env python3
"""A small grpcurl for this project's services, built on gRPC reflection v1alpha (the version
Python's `grpc_reflection` client and older tools speak): it needs no .proto files.

    python reflect.py [-plaintext | -cacert CA [-cert C -key K]] [-H 'name: value']... [-v]
                      [-d JSON] [-max-time S] TARGET list [SERVICE]
    python reflect.py ... TARGET describe SERVICE[/METHOD]
    python reflect.py ... -d '{"run_id": "r1"}' TARGET orchestrator.v1.Orchestrator/GetRun

The flags are grpcurl's, so the grpcurl recipes in docs/clients.md run with either tool. Responses
are printed as JSON (field names as in the .proto), one object per message; -v also prints the
method and, once they arrive, the response headers (for a stream: the call is established). An
RPC error prints its code and message to stderr and exits 1; a bad command line exits 2.
"""

import json
import sys

import grpc
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


class Headers(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the -H headers to every call, reflection's own included."""

    def __init__(self, headers):
        self.headers = headers

    def _details(self, details):
        metadata = list(details.metadata or []) + self.headers
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


class _Details(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


def usage(message):
    print(f"reflect.py: {message}\n\n{__doc__}", file=sys.stderr)
    sys.exit(2)


def parse(argv):
    opts = {"plaintext": False, "verbose": False, "headers": [], "data": None, "max_time": None, "cacert": None, "cert": None, "key": None}
    rest = []
    it = iter(argv)
    for arg in it:
        flag = arg.lstrip("-") if arg.startswith("-") else None
        if flag == "plaintext":
            opts["plaintext"] = True
        elif flag == "v":
            opts["verbose"] = True
        elif flag in ("H", "d", "max-time", "cacert", "cert", "key"):
            value = next(it, None)
            if value is None:
                usage(f"{arg} needs a value")
            if flag == "H":
                name, _, val = value.partition(":")
                opts["headers"].append((name.strip().lower(), val.strip()))
            elif flag == "d":
                opts["data"] = value
            elif flag == "max-time":
                opts["max_time"] = float(value)
            else:
                opts[flag] = value
        elif flag is not None:
            usage(f"unknown flag {arg}")
        else:
            rest.append(arg)
    if len(rest) < 2:
        usage("give a target and a command (list, describe, or SERVICE/METHOD)")
    return opts, rest[0], rest[1:]


def read(path):
    with open(path, "rb") as f:
        return f.read()


def open_channel(opts, target):
    if opts["plaintext"]:
        channel = grpc.insecure_channel(target)
    else:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=read(opts["cacert"]) if opts["cacert"] else None,
            private_key=read(opts["key"]) if opts["key"] else None,
            certificate_chain=read(opts["cert"]) if opts["cert"] else None,
        )
        channel = grpc.secure_channel(target, credentials)
    return grpc.intercept_channel(channel, Headers(opts["headers"])) if opts["headers"] else channel


def print_message(message):
    print(json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True), indent=2), flush=True)


def find_method(pool, symbol):
    """`package.Service/Method` (or grpcurl's `package.Service.Method`)."""
    separator = "/" if "/" in symbol else "."
    service_name, _, method_name = symbol.rpartition(separator)
    service = pool.FindServiceByName(service_name)
    method = service.methods_by_name.get(method_name)
    if method is None:
        raise SystemExit(f"reflect.py: service {service_name} has no method {method_name}")
    return method


def invoke(channel, pool, symbol, opts):
    method = find_method(pool, symbol)
    request_type = message_factory.GetMessageClass(method.input_type)
    response_type = message_factory.GetMessageClass(method.output_type)
    request = json_format.Parse(opts["data"] or "{}", request_type())
    path = f"/{method.containing_service.full_name}/{method.name}"
    kwargs = {"request_serializer": request_type.SerializeToString, "response_deserializer": response_type.FromString}
    if opts["verbose"]:
        print(f"Resolved method descriptor: {path}", file=sys.stderr, flush=True)
    if method.server_streaming:
        call = channel.unary_stream(path, **kwargs)(request, timeout=opts["max_time"])
        if opts["verbose"]:
            headers = "".join(f"\n{k}: {v}" for k, v in call.initial_metadata())
            print(f"Response headers received:{headers}", file=sys.stderr, flush=True)
        for response in call:
            print_message(response)
    else:
        print_message(channel.unary_unary(path, **kwargs)(request, timeout=opts["max_time"]))


def describe(pool, symbol):
    if "/" in symbol:
        method = find_method(pool, symbol)
        stream = "stream " if method.server_streaming else ""
        print(f"rpc {method.name}({method.input_type.full_name}) returns ({stream}{method.output_type.full_name})")
        return
    service = pool.FindServiceByName(symbol)
    print(f"service {service.full_name} {{")
    for method in service.methods:
        stream = "stream " if method.server_streaming else ""
        print(f"  rpc {method.name}({method.input_type.full_name}) returns ({stream}{method.output_type.full_name});")
    print("}")


def main(argv):
    opts, target, command = parse(argv)
    with open_channel(opts, target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        pool = DescriptorPool(database)
        try:
            if command[0] == "list" and len(command) == 1:
                for name in sorted(database.get_services()):
                    print(name)
            elif command[0] == "list":
                for method in pool.FindServiceByName(command[1]).methods:
                    print(f"{command[1]}.{method.name}")
            elif command[0] == "describe" and len(command) == 2:
                describe(pool, command[1])
            elif len(command) == 1 and command[0] not in ("list", "describe"):
                invoke(channel, pool, command[0], opts)
            else:
                usage(f"unknown command {' '.join(command)}")
        except grpc.RpcError as e:
            print(f"ERROR:\n  Code: {e.code().name}\n  Message: {e.details()}", file=sys.stderr)
            return 1
        except KeyError as e:
            print(f"reflect.py: the server does not know {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
