#!/usr/bin/env python3
"""The paced relay's callers, in Python through grpcio (as many of the orchestrator's callers are):
`--runs` Orchestrate streams at once on one channel (grpc.aio), each read to its end, one line of
JSON out per run: {"ok": bool, "text_events": int, "ttft_ms": float or null}.

    python grpcio_caller.py --target 127.0.0.1:50051 --model paced --runs 20 --interval-ms 20

The stubs are generated from the repository's protos by examples/python/stubs.py.
"""

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python"))

import grpc  # noqa: E402

import stubs  # noqa: E402

pb, pb_grpc = stubs.load()


async def one(stub, model, n, interval_ms):
    request = pb.OrchestrateRequest(
        model=model,
        messages=[pb.ChatMessage(role="user", content=f"paced #{n}")],
        params=pb.ModelParams(stream_interval_ms=interval_ms),
    )
    started = time.perf_counter()
    seen = {"ok": False, "text_events": 0, "ttft_ms": None}
    try:
        async for event in stub.Orchestrate(request, timeout=120):
            kind = event.WhichOneof("event")
            if kind == "text_delta":
                if seen["ttft_ms"] is None:
                    seen["ttft_ms"] = (time.perf_counter() - started) * 1e3
                seen["text_events"] += 1
            elif kind == "run_finished":
                seen["ok"] = event.run_finished.result.status == pb.RUN_STATUS_COMPLETED
    except grpc.aio.AioRpcError as e:
        seen["error"] = f"{e.code().name}: {e.details()}"
    return seen


async def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--runs", type=int, required=True)
    p.add_argument("--interval-ms", type=int, required=True)
    args = p.parse_args()
    async with grpc.aio.insecure_channel(args.target) as channel:
        stub = pb_grpc.OrchestratorStub(channel)
        seen = await asyncio.gather(*(one(stub, args.model, n, args.interval_ms) for n in range(args.runs)))
    for s in seen:
        print(json.dumps(s))


if __name__ == "__main__":
    asyncio.run(main())
