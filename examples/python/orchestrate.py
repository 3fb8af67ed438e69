#!/usr/bin/env python3
"""Runs one LLM tool loop on the orchestrator and prints its events as they stream.

    python orchestrate.py --target 127.0.0.1:50051 --prompt "check the tools" \
        --exit-tool submit_report [--tool calculate ...] [--ca ca.pem] [--token T] [--json]
    python orchestrate.py --target 127.0.0.1:50051 --prompt "check the tools" --detach
    python orchestrate.py --target 127.0.0.1:50051 --attach RUN_ID [--after SEQ]
    python orchestrate.py --target 127.0.0.1:50051 --list-approvals [--run-id RUN_ID]
    python orchestrate.py --target 127.0.0.1:50051 --list-runs [--status RUNNING] [--label K=V]

TLS: --ca (the server's CA; without it the channel is plaintext), --cert/--key for mTLS,
--server-name when the certificate names another host. Token: --token or ORCHESTRATOR_TOKEN,
sent as `authorization: Bearer <token>`. --cancel-after S calls CancelRun after S seconds (the run
ends CANCELED with its output so far; with --cancel-mode after-turn once its turn in progress has
ended, the turn's tool calls run and recorded); Ctrl-C drops the call, which cancels a run that is not
--detached. --detach starts the run in the background instead (StartRun): it prints the run's id
(with --json, the answer) once the run is let in and exits 0; the run goes on bounded by its own
timeout, and --attach follows it. --agent NAME runs as a named agent of the server's agents file
(its model, system message, tools, exit tools, approvals and limits; the other flags set only
what the agent lets a request override). --say TEXT sends a user message to the run --say-after S seconds after it starts
(SendMessage: it joins the conversation at the run's next turn boundary). --thread ID continues
a thread (the model sees its earlier runs), --on-busy reject|enqueue|interrupt|rollback says what
the run does when another run holds it, and --get-thread ID prints one as JSON. --attach follows a live or finished run from any replica (AttachRun) instead of
starting one. --needs-approval TOOL makes that tool's calls wait for a person's decision; --decide
approve|reject decides each such call as it is asked for (DecideToolCalls, standing in for the
person); --answer accept|decline|cancel answers each question a tool asks as it is asked
(AnswerToolInput; a form accepted with --answer-content JSON, a URL question accepted as visited);
--list-approvals prints the calls waiting that this caller may decide or answer (one JSON line each)
and exits. --label K=V labels the run (repeatable); --list-runs prints the caller's runs (ListRuns,
every page, one JSON line each, newest first), filtered by --status (RUNNING, AWAITING_APPROVAL,
COMPLETED, FAILED, CANCELED; repeatable), --label and --thread. A stream that ends UNAVAILABLE (the replica drains) or breaks off (INTERNAL,
UNKNOWN or CANCELLED) before run_finished is attached again from the last seq printed, up to --reattach-attempts times in a row
without a new event, so the printed stream has no gap and no duplicate. A --run-id whose run had
ended replays it (said on stderr, from the answer's `orchestrator-replay` header). --target takes any gRPC
name, e.g. `dns:///orchestrator:50051`, or `ipv4:10.0.0.1:50051,10.0.0.2:50051` with --authority
(gRPC would send the list itself as :authority, which HTTP/2 servers refuse). Exit status: 0
completed, 1 failed, 2 canceled, 3 the call itself failed (the gRPC status is printed), 130
interrupted.
"""

import argparse
import json
import os
import sys
import threading
import time

import grpc
from google.protobuf import json_format

import stubs

pb, pb_grpc = stubs.load()

EXIT = {pb.RUN_STATUS_COMPLETED: 0, pb.RUN_STATUS_FAILED: 1, pb.RUN_STATUS_CANCELED: 2}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.environ.get("ORCHESTRATOR_TARGET", "127.0.0.1:50051"))
    start = p.add_mutually_exclusive_group(required=True)
    start.add_argument("--prompt", help="the user message")
    start.add_argument("--attach", metavar="RUN_ID", help="follow this run instead of starting one")
    start.add_argument("--list-approvals", action="store_true", help="list the calls waiting for approval")
    start.add_argument("--get-thread", metavar="THREAD_ID", help="print this thread (GetThread) as JSON")
    start.add_argument("--list-runs", action="store_true", help="list this caller's runs (ListRuns)")
    p.add_argument("--status", action="append", default=[], help="with --list-runs: runs in this status (repeatable)")
    p.add_argument("--label", action="append", default=[], metavar="K=V", help="label the run; with --list-runs: runs with it")
    p.add_argument("--after", type=int, default=0, help="with --attach: the last seq already seen")
    p.add_argument("--reattach-attempts", type=int, default=5, help="re-attaches in a row without a new event")
    p.add_argument("--system", default="", help="a system message")
    p.add_argument("--model", default="", help="model name (default: the server's)")
    p.add_argument("--run-id", default="", help="idempotency key (default: the server makes one)")
    p.add_argument("--tool", action="append", default=[], help="allow only these normal tools (repeatable)")
    p.add_argument("--exit-tool", action="append", default=[], help="offer this exit tool (repeatable)")
    p.add_argument("--detached", action="store_true", help="the run goes on if this client goes away")
    p.add_argument("--detach", action="store_true", help="start the run in the background (StartRun): print its id and exit")
    p.add_argument("--agent", default="", help="run as this named agent (ListAgents): its prompt, tools and limits")
    p.add_argument("--needs-approval", action="append", default=[], metavar="TOOL", help="calls of this tool wait for a decision")
    p.add_argument("--decide", choices=["approve", "reject"], help="decide each call that waits, as it is asked for")
    p.add_argument("--answer", choices=["accept", "decline", "cancel"], help="answer each tool's questions as they are asked")
    p.add_argument("--answer-content", default="{}", metavar="JSON", help="with --answer accept: a form's content")
    p.add_argument("--ca", help="PEM CA of the server's certificate (TLS)")
    p.add_argument("--cert", help="PEM client certificate (mTLS)")
    p.add_argument("--key", help="PEM client key (mTLS)")
    p.add_argument("--server-name", help="host name to check the server's certificate against")
    p.add_argument("--authority", help="the :authority sent (needed with a list of addresses, e.g. ipv4:a,b)")
    p.add_argument("--token", default=os.environ.get("ORCHESTRATOR_TOKEN"), help="bearer token")
    p.add_argument("--cancel-after", type=float, help="call CancelRun after this many seconds")
    p.add_argument("--cancel-mode", choices=["immediate", "after-turn"], default="immediate",
                   help="with --cancel-after: stop at once, or once the turn in progress has ended")
    p.add_argument("--thread", default="", metavar="THREAD_ID", help="continue this thread")
    p.add_argument("--on-busy", choices=["reject", "enqueue", "interrupt", "rollback"], default="reject",
                   help="with --thread: what the run does when another run holds the thread")
    p.add_argument("--say", metavar="TEXT", help="send this user message to the run (SendMessage)")
    p.add_argument("--say-after", type=float, default=1.0, help="with --say: after this many seconds")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of the whole call, seconds")
    p.add_argument("--json", action="store_true", help="print each event as one JSON line")
    args = p.parse_args(argv)
    if args.detach and args.prompt is None:
        p.error("--detach starts a run: it needs --prompt")
    return args


def read(path):
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


# A run's result (run_finished, GetRun) holds all its text, reasoning and tool-call records, so it
# can pass gRPC's default 4 MiB receive limit; take up to 64 MiB, as the Rust client does.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def open_channel(args):
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    if args.authority:
        options.append(("grpc.default_authority", args.authority))
    if not args.ca:
        return grpc.insecure_channel(args.target, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(args.ca), private_key=read(args.key), certificate_chain=read(args.cert)
    )
    if args.server_name:
        options.append(("grpc.ssl_target_name_override", args.server_name))
    return grpc.secure_channel(args.target, credentials, options=options)


def labels(args):
    """The --label K=V pairs as a dict; SystemExit naming one without '='."""
    pairs = {}
    for label in args.label:
        key, sep, value = label.partition("=")
        if not sep or not key:
            raise SystemExit(f"--label {label!r} is not K=V")
        pairs[key] = value
    return pairs


def build_request(args):
    return pb.OrchestrateRequest(
        labels=labels(args),
        run_id=args.run_id,
        system=args.system,
        model=args.model,
        detached=args.detached,
        agent=args.agent,
        messages=[pb.ChatMessage(role="user", content=args.prompt)],
        thread_id=args.thread,
        on_busy=pb.ThreadBusyPolicy.Value(f"THREAD_BUSY_POLICY_{args.on_busy.upper()}"),
        tools=pb.ToolSelection(
            normal=args.tool,
            exit=[pb.ExitToolSpec(name=name, description=f"signal {name}") for name in args.exit_tool],
            approval=pb.ApprovalPolicy(tools=args.needs_approval),
        ),
    )


def describe(event):
    """One human-readable line for an event."""
    kind = event.WhichOneof("event")
    e = getattr(event, kind)
    if kind == "run_started":
        thread = f"; thread {e.thread_id} ({e.thread_turns} earlier turns)" if e.thread_id else ""
        return f"run {event.run_id} started on {e.model}; tools {list(e.normal_tools)}, exit tools {list(e.exit_tools)}{thread}"
    if kind == "tool_call_started":
        return f"tool call {e.call_id}: {e.name}({e.arguments_json})"
    if kind == "tool_call_finished":
        outcome = e.content_json if e.ok else f"error {e.error.code}: {e.error.message}"
        return f"tool call {e.call_id} finished in {e.duration_ms} ms: {outcome}"
    if kind == "signal":
        return f"signal {e.tool_name}({e.arguments_json})"
    if kind == "turn_finished":
        return f"turn {e.turn} finished"
    if kind == "turn_restarted":
        return f"turn {e.turn} restarted (attempt {e.attempt}: {e.reason}); its text above is void"
    if kind == "approval_requested":
        return f"tool call {e.call_id}: {e.name}({e.arguments_json}) waits for approval (expires at {e.expires_at_unix_ms} ms)"
    if kind == "tool_input_requested":
        questions = "; ".join(f"{q.key} ({q.mode}): {q.message} {q.url or q.schema_json}" for q in e.requests)
        return f"tool call {e.call_id}: {e.name} asks before it can finish: {questions}"
    if kind == "message_added":
        return f"a message joins turn {e.turn}: {e.message.content}"
    if kind == "call_decided":
        d = e.decision
        outcome = pb.ApprovalOutcome.Name(d.outcome).removeprefix("APPROVAL_OUTCOME_").lower()
        reason = f": {d.message}" if d.message else ""
        return f"tool call {e.call_id}: {e.name} {outcome} by {d.principal or 'the anonymous caller'} after {e.waited_ms} ms{reason}"
    if kind == "tool_call_progress":
        return f"tool call {e.call_id}: {e.name} {e.message} ({e.progress}/{e.total})"
    if kind != "run_finished":
        return f"{kind} (an event this client does not know yet)"
    r = e.result
    reason = f" ({pb.FailureReason.Name(r.failure_reason)}: {r.failure_detail})" if r.failure_reason else ""
    return f"run finished {pb.RunStatus.Name(r.status)}{reason} after {r.turns} turns"


class Transcript:
    """The run's text as the stream builds it: a turn_restarted voids the text its turn streamed
    before (the replica that took the run over asks the model again), as in RunResult.text."""

    def __init__(self):
        self.text = ""
        self.turn = 0
        self.turn_text_at = 0  # where the current turn's text begins
        self.restarted = False

    def apply(self, event):
        kind = event.WhichOneof("event")
        if kind == "text_delta":
            if event.text_delta.turn != self.turn:
                self.turn, self.turn_text_at = event.text_delta.turn, len(self.text)
            self.text += event.text_delta.text
        elif kind == "turn_restarted":
            self.restarted = True
            if event.turn_restarted.turn == self.turn:
                self.text = self.text[: self.turn_text_at]


class Printer:
    """Prints events: text and reasoning as they stream (inline), every other event on its own
    line, and the run's whole text again at the end when a turn restarted; or each event as one
    JSON line."""

    def __init__(self, as_json):
        self.as_json = as_json
        self.inline = None  # "text_delta" or "reasoning_delta" while a stream of them is printed
        self.transcript = Transcript()

    def event(self, event):
        self.transcript.apply(event)
        if self.as_json:
            print(json.dumps(json_format.MessageToDict(event, preserving_proto_field_name=True)), flush=True)
            return
        kind = event.WhichOneof("event")
        if kind in ("text_delta", "reasoning_delta"):
            if self.inline != kind:
                self.end_inline()
                print("reasoning: " if kind == "reasoning_delta" else "text: ", end="")
                self.inline = kind
            print(getattr(event, kind).text, end="", flush=True)
            return
        self.end_inline()
        print(f"[{event.seq}] {describe(event)}", flush=True)
        if kind == "run_finished" and self.transcript.restarted:
            print(f"text after restarts: {self.transcript.text}", flush=True)

    def end_inline(self):
        if self.inline is not None:
            print(flush=True)
            self.inline = None


CANCEL_MODES = {"immediate": pb.CANCEL_MODE_IMMEDIATE, "after-turn": pb.CANCEL_MODE_AFTER_TURN}


def say_later(stub, metadata, run_id, seconds, text):
    """Sends `text` to the run after `seconds` (SendMessage; it joins at the run's next turn)."""
    def say():
        request = pb.SendMessageRequest(run_id=run_id, message=pb.ChatMessage(role="user", content=text))
        try:
            answer = stub.SendMessage(request, metadata=metadata, timeout=10)
            print(f"SendMessage({run_id}): {answer.waiting} waiting", file=sys.stderr, flush=True)
        except grpc.RpcError as e:
            print(f"SendMessage({run_id}) refused: {e.code().name}: {e.details()}", file=sys.stderr, flush=True)

    timer = threading.Timer(seconds, say)
    timer.daemon = True
    timer.start()
    return timer


def cancel_later(stub, metadata, run_id, seconds, mode):
    def cancel():
        request = pb.CancelRunRequest(run_id=run_id, mode=CANCEL_MODES[mode])
        answer = stub.CancelRun(request, metadata=metadata, timeout=10)
        print(f"CancelRun({run_id}): canceled={answer.canceled}", file=sys.stderr, flush=True)

    timer = threading.Timer(seconds, cancel)
    timer.daemon = True
    timer.start()
    return timer


# Codes that end a stream the run outlives: a draining replica (UNAVAILABLE), or a connection that
# broke (grpcio reads a dead connection as INTERNAL "Stream removed" or UNKNOWN, a stream the server
# reset as CANCELLED; the orchestrator never ends a stream CANCELLED itself).
REATTACH = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED}


class Follower:
    """The run's events, one stream across replicas: Orchestrate (or AttachRun), then AttachRun
    from the last seq seen whenever the stream ends UNAVAILABLE or breaks off."""

    def __init__(self, stub, metadata, args):
        self.stub, self.metadata, self.args = stub, metadata, args
        self.run_id = args.attach
        self.last_seq = args.after if args.attach else 0
        self.call = None
        self.reattached = 0

    def open(self):
        if self.run_id is None:
            self.call = self.stub.Orchestrate(build_request(self.args), metadata=self.metadata, timeout=self.args.timeout)
        else:
            request = pb.AttachRunRequest(run_id=self.run_id, after_seq=self.last_seq)
            self.call = self.stub.AttachRun(request, metadata=self.metadata, timeout=self.args.timeout)

    def events(self):
        """Yields each event once, in seq order, until run_finished."""
        self.open()
        failures = 0
        while True:
            try:
                for event in self.call:
                    if event.seq <= self.last_seq:
                        continue  # sent again by the replica this stream re-attached to
                    if self.run_id is None:
                        tell_replay(self.call.initial_metadata(), event.run_id)
                    self.run_id, self.last_seq, failures = event.run_id, event.seq, 0
                    yield event
                    if event.WhichOneof("event") == "run_finished":
                        return
                broke = None
            except grpc.RpcError as e:
                if e.code() not in REATTACH:
                    raise
                broke = e
            failures += 1
            if self.run_id is None or failures >= self.args.reattach_attempts:
                if broke is not None:
                    raise broke
                return
            reason = f"{broke.code().name}: {broke.details()}" if broke else "the stream ended early"
            print(f"re-attaching to run {self.run_id} after seq {self.last_seq} ({reason})", file=sys.stderr, flush=True)
            time.sleep(min(0.1 * 2 ** (failures - 1), 2.0))
            self.reattached += 1
            self.open()


# The header an Orchestrate answer carries when it replays a run that had ended under its run id
# (a retry of a call whose run finished) instead of starting one: "log" or "result".
REPLAY_HEADER = "orchestrator-replay"
REPLAYS = {
    "log": "its events as logged, replayed",
    "result": "its log no longer holds it whole: its output, replayed as one piece",
}


def tell_replay(initial_metadata, run_id):
    """Says on stderr when the call replays a run that had ended rather than starting one."""
    replay = dict(initial_metadata or ()).get(REPLAY_HEADER)
    if replay is not None:
        print(f"run {run_id} had ended: {REPLAYS.get(replay, replay)}", file=sys.stderr, flush=True)


def decide(stub, metadata, event, kind):
    """Decides the call an approval_requested event asks about (as a person would)."""
    asked = event.approval_requested
    decision = pb.ToolCallDecision(call_id=asked.call_id)
    if kind == "approve":
        decision.kind = pb.DECISION_KIND_APPROVE
    else:
        decision.kind = pb.DECISION_KIND_REJECT
        decision.message = "rejected by the caller's --decide"
    request = pb.DecideToolCallsRequest(run_id=event.run_id, decisions=[decision])
    answer = stub.DecideToolCalls(request, metadata=metadata, timeout=10)
    print(f"DecideToolCalls({asked.call_id}): {kind}d; {len(answer.still_pending)} still waiting", file=sys.stderr, flush=True)


def answer(stub, metadata, event, action, content):
    """Answers every question a tool_input_requested event asks (as a person would)."""
    asked = event.tool_input_requested
    answers = []
    for question in asked.requests:
        answer = pb.ToolInputAnswer(key=question.key, action=pb.InputAction.Value(f"INPUT_ACTION_{action.upper()}"))
        if action == "accept" and question.mode == "form":
            answer.content_json = content
        answers.append(answer)
    request = pb.AnswerToolInputRequest(run_id=event.run_id, call_id=asked.call_id, answers=answers)
    reply = stub.AnswerToolInput(request, metadata=metadata, timeout=10)
    print(f"AnswerToolInput({asked.call_id}): {action}; {len(reply.still_pending)} still waiting", file=sys.stderr, flush=True)


def start_detached(args, metadata):
    """Starts the run in the background (StartRun) and prints its id (with --json, the answer) once
    it is let in; 0 when it goes on, the status's code when its run id named a run that had ended."""
    with open_channel(args) as channel:
        stub = pb_grpc.OrchestratorStub(channel)
        started = stub.StartRun(build_request(args), metadata=metadata, timeout=args.timeout)
    if args.json:
        print(json.dumps(json_format.MessageToDict(started, preserving_proto_field_name=True)), flush=True)
    else:
        print(started.run_id, flush=True)
    if started.status != pb.RUN_STATUS_RUNNING:
        status = pb.RunStatus.Name(started.status)
        print(f"run {started.run_id} had ended {status}: nothing was started", file=sys.stderr)
        return EXIT.get(started.status, 1)
    print(f"run {started.run_id} goes on in the background; follow it with --attach {started.run_id}", file=sys.stderr)
    return 0


def list_approvals(args, metadata):
    """Prints the calls waiting that this caller may decide, one JSON line each."""
    with open_channel(args) as channel:
        stub = pb_grpc.OrchestratorStub(channel)
        answer = stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(run_id=args.run_id), metadata=metadata, timeout=30)
        for pending in answer.approvals:
            print(json.dumps(json_format.MessageToDict(pending, preserving_proto_field_name=True)), flush=True)
    return 0


def list_runs(args, metadata):
    """Prints every page of the caller's runs that the filters match, one JSON line each."""
    statuses = [pb.RunStatus.Value(f"RUN_STATUS_{s.upper()}") for s in args.status]
    request = pb.ListRunsRequest(statuses=statuses, labels=labels(args), thread_id=args.thread)
    with open_channel(args) as channel:
        stub = pb_grpc.OrchestratorStub(channel)
        while True:
            page = stub.ListRuns(request, metadata=metadata, timeout=30)
            for summary in page.runs:
                print(json.dumps(json_format.MessageToDict(summary, preserving_proto_field_name=True)), flush=True)
            if not page.next_page_token:
                return 0
            request.page_token = page.next_page_token


def get_thread(args, metadata):
    """Prints the thread as one JSON object; exit 3 with the gRPC status when refused."""
    with open_channel(args) as channel:
        stub = pb_grpc.OrchestratorStub(channel)
        try:
            thread = stub.GetThread(pb.GetThreadRequest(thread_id=args.get_thread), metadata=metadata, timeout=30)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 3
        print(json.dumps(json_format.MessageToDict(thread, preserving_proto_field_name=True)), flush=True)
    return 0


def run(args):
    """Streams the run; returns the exit status."""
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else []
    if args.list_approvals:
        return list_approvals(args, metadata)
    if args.get_thread:
        return get_thread(args, metadata)
    if args.list_runs:
        return list_runs(args, metadata)
    if args.detach:
        return start_detached(args, metadata)
    with open_channel(args) as channel:
        stub = pb_grpc.OrchestratorStub(channel)
        follower = Follower(stub, metadata, args)
        timer, say_timer = None, None
        printer = Printer(args.json)
        try:
            for event in follower.events():
                if timer is None and args.cancel_after is not None:
                    timer = cancel_later(stub, metadata, event.run_id, args.cancel_after, args.cancel_mode)
                if say_timer is None and args.say:
                    say_timer = say_later(stub, metadata, event.run_id, args.say_after, args.say)
                printer.event(event)
                if args.decide and event.WhichOneof("event") == "approval_requested":
                    decide(stub, metadata, event, args.decide)
                if args.answer and event.WhichOneof("event") == "tool_input_requested":
                    answer(stub, metadata, event, args.answer, args.answer_content)
                if event.WhichOneof("event") == "run_finished":
                    return EXIT.get(event.run_finished.result.status, 1)
        except KeyboardInterrupt:
            printer.end_inline()
            if follower.call is not None:
                follower.call.cancel()
            print("interrupted: the call was dropped", file=sys.stderr)
            return 130
        finally:
            for pending in (timer, say_timer):
                if pending is not None:
                    # Not fired yet: it never will. Fired: its answer may come after
                    # run_finished, so wait for it (each call has its own 10 s deadline).
                    pending.cancel()
                    pending.join(timeout=15)
    print("error: the stream ended without run_finished", file=sys.stderr)
    return 3


def main(argv):
    args = parse_args(argv)
    try:
        return run(args)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
