/**
 * Runs one LLM tool loop on the orchestrator and prints its events as they stream.
 *
 *   npm ci && npm run build
 *   node dist/orchestrate.js --target 127.0.0.1:50051 --prompt "check the tools" \
 *     --exit-tool submit_report [--tool calculate ...] [--ca ca.pem] [--token T] [--json]
 *   node dist/orchestrate.js --target 127.0.0.1:50051 --prompt "check the tools" --detach
 *   node dist/orchestrate.js --target 127.0.0.1:50051 --attach RUN_ID [--after SEQ]
 *   node dist/orchestrate.js --target 127.0.0.1:50051 --list-approvals [--run-id RUN_ID]
 *   node dist/orchestrate.js --target 127.0.0.1:50051 --list-runs [--status RUNNING] [--label K=V]
 *
 * The contract is loaded from the repository's .proto at run time (@grpc/proto-loader).
 * TLS: --ca (the server's CA; without it the channel is plaintext), --cert/--key for mTLS,
 * --server-name when the certificate names another host. Token: --token or ORCHESTRATOR_TOKEN,
 * sent as `authorization: Bearer <token>`. --cancel-after S calls CancelRun after S seconds (the
 * run ends CANCELED with its output so far; with --cancel-mode after-turn once its turn in
 * progress has ended, the turn's tool calls run and recorded); Ctrl-C drops the call, which cancels a run that is
 * not --detached. --detach starts the run in the background instead (StartRun): it prints the run's
 * id (with --json, the answer) once the run is let in and exits 0; the run goes on bounded by its
 * own timeout, and --attach follows it. --agent NAME runs as a named agent of the server's agents
 * file (its model, system message, tools, exit tools, approvals and limits; the other flags set
 * only what the agent lets a request override). --say TEXT sends a user message to the run --say-after S seconds after it starts
 * (SendMessage: it joins the conversation at the run's next turn boundary). --thread ID continues
 * a thread (the model sees its earlier runs), --on-busy reject|enqueue|interrupt|rollback says
 * what the run does when another run holds it, and --get-thread ID prints one as JSON. --attach
 * follows a live or finished run from any replica (AttachRun) instead of
 * starting one. --needs-approval TOOL makes that tool's calls wait for a person's decision; --decide
 * approve|reject decides each such call as it is asked for (DecideToolCalls, standing in for the
 * person); --answer accept|decline|cancel answers each question a tool asks as it is asked
 * (AnswerToolInput; a form accepted with --answer-content JSON, a URL question accepted as
 * visited); --list-approvals prints the calls waiting that this caller may decide or answer (one
 * JSON line each) and exits. --label K=V labels the run (repeatable); --list-runs prints the caller's runs
 * (ListRuns, every page, one JSON line each, newest first), filtered by --status (RUNNING,
 * AWAITING_APPROVAL, COMPLETED, FAILED, CANCELED; repeatable), --label and --thread. A stream that ends UNAVAILABLE (the replica drains) or breaks off (INTERNAL,
 * UNKNOWN or CANCELLED) before run_finished is attached again from the last seq printed, up to --reattach-attempts times in a
 * row without a new event, so the printed stream has no gap and no duplicate. A --run-id whose run
 * had ended replays it (said on stderr, from the answer's `orchestrator-replay` header). --target takes any
 * gRPC name, e.g. `dns:///orchestrator:50051`, or `ipv4:10.0.0.1:50051,10.0.0.2:50051` with
 * --authority (gRPC would send the list itself as :authority, which HTTP/2 servers refuse). Exit
 * status: 0 completed, 1 failed, 2 canceled, 3 the call itself failed (the gRPC status is
 * printed), 130 interrupted.
 */

import * as fs from "node:fs";
import * as path from "node:path";
import { parseArgs } from "node:util";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "..", "proto");
const EXIT: Record<string, number> = {
  RUN_STATUS_COMPLETED: 0,
  RUN_STATUS_FAILED: 1,
  RUN_STATUS_CANCELED: 2,
};

/** The events as proto-loader decodes them (keepCase, enums as names, `event` names the oneof). */
interface ToolCallError {
  code: string;
  message: string;
}
interface RunResult {
  run_id: string;
  status: string;
  failure_reason: string;
  failure_detail: string;
  turns: number;
  text: string;
}
interface OrchestrateEvent {
  run_id: string;
  seq: string;
  event: string;
  run_started?: { model: string; normal_tools: string[]; exit_tools: string[]; thread_id: string; thread_turns: number };
  text_delta?: { text: string; turn: number };
  reasoning_delta?: { text: string; turn: number };
  tool_call_started?: { call_id: string; name: string; arguments_json: string };
  tool_call_finished?: {
    call_id: string;
    name: string;
    ok: boolean;
    content_json: string;
    error: ToolCallError | null;
    duration_ms: string;
  };
  signal?: { tool_name: string; arguments_json: string };
  turn_finished?: { turn: number };
  turn_restarted?: { turn: number; attempt: number; reason: string };
  approval_requested?: { call_id: string; name: string; arguments_json: string; expires_at_unix_ms: string };
  tool_input_requested?: {
    call_id: string;
    name: string;
    requests: { key: string; mode: string; message: string; schema_json: string; url: string }[];
  };
  message_added?: { turn: number; message: { content: string } };
  call_decided?: {
    call_id: string;
    name: string;
    waited_ms: string;
    decision: { outcome: string; principal: string; message: string };
  };
  run_finished?: { result: RunResult };
}

type Options = ReturnType<typeof options>;

function options() {
  const { values } = parseArgs({
    options: {
      target: { type: "string", default: process.env.ORCHESTRATOR_TARGET ?? "127.0.0.1:50051" },
      prompt: { type: "string" },
      attach: { type: "string" },
      after: { type: "string", default: "0" },
      "reattach-attempts": { type: "string", default: "5" },
      system: { type: "string", default: "" },
      model: { type: "string", default: "" },
      "run-id": { type: "string", default: "" },
      tool: { type: "string", multiple: true, default: [] },
      "exit-tool": { type: "string", multiple: true, default: [] },
      detached: { type: "boolean", default: false },
      detach: { type: "boolean", default: false },
      agent: { type: "string", default: "" },
      "needs-approval": { type: "string", multiple: true, default: [] },
      decide: { type: "string" },
      answer: { type: "string" },
      "answer-content": { type: "string", default: "{}" },
      "list-approvals": { type: "boolean", default: false },
      "get-thread": { type: "string" },
      "list-runs": { type: "boolean", default: false },
      status: { type: "string", multiple: true, default: [] },
      label: { type: "string", multiple: true, default: [] },
      thread: { type: "string", default: "" },
      "on-busy": { type: "string", default: "reject" },
      ca: { type: "string" },
      cert: { type: "string" },
      key: { type: "string" },
      "server-name": { type: "string" },
      authority: { type: "string" },
      token: { type: "string", default: process.env.ORCHESTRATOR_TOKEN },
      "cancel-after": { type: "string" },
      "cancel-mode": { type: "string", default: "immediate" },
      say: { type: "string" },
      "say-after": { type: "string", default: "1" },
      timeout: { type: "string", default: "600" },
      json: { type: "boolean", default: false },
    },
  });
  const modes = [values.prompt, values.attach, values["list-approvals"] || undefined, values["get-thread"], values["list-runs"] || undefined];
  if (modes.filter((v) => v).length !== 1) {
    throw new Error("one of --prompt, --attach, --list-approvals, --get-thread or --list-runs is required");
  }
  if (values.detach && values.prompt === undefined) throw new Error("--detach starts a run: it needs --prompt");
  for (const label of values.label) {
    if (label.indexOf("=") < 1) throw new Error(`--label ${JSON.stringify(label)} is not K=V`);
  }
  if (!["reject", "enqueue", "interrupt", "rollback"].includes(String(values["on-busy"]))) {
    throw new Error("--on-busy is reject, enqueue, interrupt or rollback");
  }
  if (!["immediate", "after-turn"].includes(String(values["cancel-mode"]))) {
    throw new Error("--cancel-mode is immediate or after-turn");
  }
  if (values.decide !== undefined && values.decide !== "approve" && values.decide !== "reject") {
    throw new Error("--decide takes approve or reject");
  }
  if (values.answer !== undefined && !["accept", "decline", "cancel"].includes(values.answer)) {
    throw new Error("--answer takes accept, decline or cancel");
  }
  return values;
}

function loadClient(opts: Options) {
  const definition = protoLoader.loadSync("orchestrator/v1/orchestrator.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const loaded = grpc.loadPackageDefinition(definition) as any;
  const Orchestrator = loaded.orchestrator.v1.Orchestrator as grpc.ServiceClientConstructor;
  const read = (file?: string) => (file ? fs.readFileSync(file) : null);
  const credentials = opts.ca
    ? grpc.credentials.createSsl(read(opts.ca), read(opts.key), read(opts.cert))
    : grpc.credentials.createInsecure();
  // A run's result (run_finished, GetRun) holds all its text, reasoning and tool-call records, so it
  // can pass gRPC's default 4 MiB receive limit; take up to 64 MiB, as the Rust client does.
  const channelOptions: grpc.ChannelOptions = { "grpc.max_receive_message_length": 64 * 1024 * 1024 };
  if (opts["server-name"]) channelOptions["grpc.ssl_target_name_override"] = opts["server-name"];
  if (opts.authority) channelOptions["grpc.default_authority"] = opts.authority;
  return new Orchestrator(opts.target, credentials, channelOptions) as any;
}

/** The --label K=V pairs. */
function labels(opts: Options): Record<string, string> {
  return Object.fromEntries(opts.label.map((label) => [label.slice(0, label.indexOf("=")), label.slice(label.indexOf("=") + 1)]));
}

function request(opts: Options) {
  return {
    labels: labels(opts),
    run_id: opts["run-id"],
    system: opts.system,
    model: opts.model,
    detached: opts.detached,
    agent: opts.agent,
    messages: [{ role: "user", content: opts.prompt }],
    thread_id: opts.thread,
    on_busy: `THREAD_BUSY_POLICY_${String(opts["on-busy"]).toUpperCase()}`,
    tools: {
      normal: opts.tool,
      exit: opts["exit-tool"].map((name) => ({ name, description: `signal ${name}` })),
      approval: { tools: opts["needs-approval"] },
    },
  };
}

/** One human-readable line for an event that is not streamed text. */
function describe(e: OrchestrateEvent): string {
  switch (e.event) {
    case "run_started": {
      const s = e.run_started!;
      const thread = s.thread_id ? `; thread ${s.thread_id} (${s.thread_turns} earlier turns)` : "";
      return `run ${e.run_id} started on ${s.model}; tools ${JSON.stringify(s.normal_tools)}, exit tools ${JSON.stringify(s.exit_tools)}${thread}`;
    }
    case "tool_call_started": {
      const c = e.tool_call_started!;
      return `tool call ${c.call_id}: ${c.name}(${c.arguments_json})`;
    }
    case "tool_call_finished": {
      const c = e.tool_call_finished!;
      const outcome = c.ok ? c.content_json : `error ${c.error?.code}: ${c.error?.message}`;
      return `tool call ${c.call_id} finished in ${c.duration_ms} ms: ${outcome}`;
    }
    case "signal":
      return `signal ${e.signal!.tool_name}(${e.signal!.arguments_json})`;
    case "turn_finished":
      return `turn ${e.turn_finished!.turn} finished`;
    case "turn_restarted": {
      const r = e.turn_restarted!;
      return `turn ${r.turn} restarted (attempt ${r.attempt}: ${r.reason}); its text above is void`;
    }
    case "approval_requested": {
      const a = e.approval_requested!;
      return `tool call ${a.call_id}: ${a.name}(${a.arguments_json}) waits for approval (expires at ${a.expires_at_unix_ms} ms)`;
    }
    case "tool_input_requested": {
      const t = e.tool_input_requested!;
      const questions = t.requests.map((q) => `${q.key} (${q.mode}): ${q.message} ${q.url || q.schema_json}`).join("; ");
      return `tool call ${t.call_id}: ${t.name} asks before it can finish: ${questions}`;
    }
    case "message_added": {
      const m = e.message_added!;
      return `a message joins turn ${m.turn}: ${m.message.content}`;
    }
    case "call_decided": {
      const c = e.call_decided!;
      const outcome = c.decision.outcome.replace("APPROVAL_OUTCOME_", "").toLowerCase();
      const reason = c.decision.message ? `: ${c.decision.message}` : "";
      return `tool call ${c.call_id}: ${c.name} ${outcome} by ${c.decision.principal || "the anonymous caller"} after ${c.waited_ms} ms${reason}`;
    }
    case "run_finished": {
      const r = e.run_finished!.result;
      const reason = r.failure_reason !== "FAILURE_REASON_UNSPECIFIED" ? ` (${r.failure_reason}: ${r.failure_detail})` : "";
      return `run finished ${r.status}${reason} after ${r.turns} turns`;
    }
    default:
      return e.event;
  }
}

/**
 * The run's text as the stream builds it: a turn_restarted voids the text its turn streamed before
 * (the replica that took the run over asks the model again), as in RunResult.text.
 */
class Transcript {
  text = "";
  restarted = false;
  private turn = 0;
  private turnTextAt = 0; // where the current turn's text begins

  apply(e: OrchestrateEvent) {
    if (e.event === "text_delta") {
      const d = e.text_delta!;
      if (d.turn !== this.turn) [this.turn, this.turnTextAt] = [d.turn, this.text.length];
      this.text += d.text;
    } else if (e.event === "turn_restarted") {
      this.restarted = true;
      if (e.turn_restarted!.turn === this.turn) this.text = this.text.slice(0, this.turnTextAt);
    }
  }
}

/**
 * Prints text and reasoning inline as they stream, every other event on its own line, and the
 * run's whole text again at the end when a turn restarted.
 */
class Printer {
  private inline: string | null = null;
  private readonly transcript = new Transcript();
  constructor(private readonly json: boolean) {}

  event(e: OrchestrateEvent) {
    this.transcript.apply(e);
    if (this.json) {
      process.stdout.write(`${JSON.stringify(e)}\n`);
      return;
    }
    if (e.event === "text_delta" || e.event === "reasoning_delta") {
      if (this.inline !== e.event) {
        this.endInline();
        process.stdout.write(e.event === "text_delta" ? "text: " : "reasoning: ");
        this.inline = e.event;
      }
      process.stdout.write((e.text_delta ?? e.reasoning_delta)!.text);
      return;
    }
    this.endInline();
    process.stdout.write(`[${e.seq}] ${describe(e)}\n`);
    if (e.event === "run_finished" && this.transcript.restarted) {
      process.stdout.write(`text after restarts: ${this.transcript.text}\n`);
    }
  }

  endInline() {
    if (this.inline !== null) {
      process.stdout.write("\n");
      this.inline = null;
    }
  }
}

/**
 * Codes that end a stream the run outlives: a draining replica (UNAVAILABLE), or a connection that
 * broke (gRPC libraries read a dead connection as INTERNAL or UNKNOWN, a stream the server reset as
 * CANCELLED; the orchestrator never ends a stream CANCELLED itself).
 */
const REATTACH = new Set([
  grpc.status.UNAVAILABLE,
  grpc.status.UNKNOWN,
  grpc.status.INTERNAL,
  grpc.status.CANCELLED,
]);

const sleep = (ms: number) => new Promise((done) => setTimeout(done, ms));

/** A unary call as a promise (deadline 10 s). */
function unary<T>(client: any, method: string, message: object, metadata: grpc.Metadata): Promise<T> {
  const deadline = new Date(Date.now() + 10_000);
  return new Promise((done, fail) =>
    client[method](message, metadata, { deadline }, (err: grpc.ServiceError | null, answer: T) => (err ? fail(err) : done(answer))),
  );
}

/** Decides the call an approval_requested event asks about (as a person would). */
async function decide(client: any, metadata: grpc.Metadata, e: OrchestrateEvent, kind: string) {
  const asked = e.approval_requested!;
  const decision =
    kind === "approve"
      ? { call_id: asked.call_id, kind: "DECISION_KIND_APPROVE" }
      : { call_id: asked.call_id, kind: "DECISION_KIND_REJECT", message: "rejected by the caller's --decide" };
  const answer = await unary<{ still_pending: unknown[] }>(client, "DecideToolCalls", { run_id: e.run_id, decisions: [decision] }, metadata);
  process.stderr.write(`DecideToolCalls(${asked.call_id}): ${kind}d; ${answer.still_pending.length} still waiting\n`);
}

/** Answers every question a tool_input_requested event asks (as a person would). */
async function answer(client: any, metadata: grpc.Metadata, e: OrchestrateEvent, action: string, content: string) {
  const asked = e.tool_input_requested!;
  const answers = asked.requests.map((q) => ({
    key: q.key,
    action: `INPUT_ACTION_${action.toUpperCase()}`,
    content_json: action === "accept" && q.mode === "form" ? content : "",
  }));
  const reply = await unary<{ still_pending: unknown[] }>(
    client,
    "AnswerToolInput",
    { run_id: e.run_id, call_id: asked.call_id, answers },
    metadata,
  );
  process.stderr.write(`AnswerToolInput(${asked.call_id}): ${action}; ${reply.still_pending.length} still waiting\n`);
}

/**
 * Starts the run in the background (StartRun): prints its id (with --json, the answer) once it
 * is let in; 0 when it goes on, the status's code when its run id named a run that had ended.
 */
async function startDetached(opts: Options): Promise<number> {
  const client = loadClient(opts);
  const metadata = new grpc.Metadata();
  if (opts.token) metadata.set("authorization", `Bearer ${opts.token}`);
  const deadline = new Date(Date.now() + Number(opts.timeout) * 1000);
  try {
    const started = await new Promise<{ run_id: string; status: string }>((done, fail) =>
      client.StartRun(request(opts), metadata, { deadline }, (err: grpc.ServiceError | null, answer: any) =>
        err ? fail(err) : done(answer),
      ),
    );
    process.stdout.write(opts.json ? `${JSON.stringify(started)}\n` : `${started.run_id}\n`);
    if (started.status !== "RUN_STATUS_RUNNING") {
      process.stderr.write(`run ${started.run_id} had ended ${started.status}: nothing was started\n`);
      return EXIT[started.status] ?? 1;
    }
    process.stderr.write(`run ${started.run_id} goes on in the background; follow it with --attach ${started.run_id}\n`);
    return 0;
  } catch (err) {
    const e = err as grpc.ServiceError;
    process.stderr.write(`error: ${grpc.status[e.code]}: ${e.details}\n`);
    return 3;
  } finally {
    client.close();
  }
}

/** Prints the calls waiting that this caller may decide, one JSON line each. */
async function listApprovals(opts: Options): Promise<number> {
  const client = loadClient(opts);
  const metadata = new grpc.Metadata();
  if (opts.token) metadata.set("authorization", `Bearer ${opts.token}`);
  try {
    const answer = await unary<{ approvals: object[] }>(client, "ListPendingApprovals", { run_id: opts["run-id"] }, metadata);
    for (const pending of answer.approvals) process.stdout.write(`${JSON.stringify(pending)}\n`);
    return 0;
  } catch (err) {
    const e = err as grpc.ServiceError;
    process.stderr.write(`error: ${grpc.status[e.code]}: ${e.details}\n`);
    return 3;
  } finally {
    client.close();
  }
}

/** Prints every page of the caller's runs the filters match (ListRuns), one JSON line each. */
async function listRuns(opts: Options): Promise<number> {
  const client = loadClient(opts);
  const metadata = new grpc.Metadata();
  if (opts.token) metadata.set("authorization", `Bearer ${opts.token}`);
  const asked = {
    statuses: opts.status.map((s) => `RUN_STATUS_${s.toUpperCase()}`),
    labels: labels(opts),
    thread_id: opts.thread,
    page_token: "",
  };
  try {
    for (;;) {
      const page = await unary<{ runs: object[]; next_page_token: string }>(client, "ListRuns", asked, metadata);
      for (const summary of page.runs) process.stdout.write(`${JSON.stringify(summary)}\n`);
      if (!page.next_page_token) return 0;
      asked.page_token = page.next_page_token;
    }
  } catch (err) {
    const e = err as grpc.ServiceError;
    process.stderr.write(`error: ${grpc.status[e.code]}: ${e.details}\n`);
    return 3;
  } finally {
    client.close();
  }
}

/** Prints the thread (GetThread) as one JSON object; 3 with the gRPC status when refused. */
async function getThread(opts: Options): Promise<number> {
  const client = loadClient(opts);
  const metadata = new grpc.Metadata();
  if (opts.token) metadata.set("authorization", `Bearer ${opts.token}`);
  try {
    const thread = await unary<object>(client, "GetThread", { thread_id: opts["get-thread"] }, metadata);
    process.stdout.write(`${JSON.stringify(thread)}\n`);
    return 0;
  } catch (err) {
    const e = err as grpc.ServiceError;
    process.stderr.write(`error: ${grpc.status[e.code]}: ${e.details}\n`);
    return 3;
  } finally {
    client.close();
  }
}

/**
 * Streams the run (Orchestrate, or AttachRun with --attach), re-attaching from the last seq seen
 * whenever the stream ends UNAVAILABLE or breaks off; resolves to the exit status.
 */
/** The header an Orchestrate answer carries when it replays a run that had ended under its run id
 * (a retry of a call whose run finished) instead of starting one: "log" or "result". */
const REPLAY_HEADER = "orchestrator-replay";
const REPLAYS: Record<string, string> = {
  log: "its events as logged, replayed",
  result: "its log no longer holds it whole: its output, replayed as one piece",
};

/** Says on stderr when the call replays a run that had ended rather than starting one. */
function tellReplay(headers: grpc.Metadata, runId: string) {
  const [replay] = headers.get(REPLAY_HEADER);
  if (replay !== undefined) process.stderr.write(`run ${runId} had ended: ${REPLAYS[String(replay)] ?? replay}\n`);
}

async function run(opts: Options): Promise<number> {
  const client = loadClient(opts);
  const metadata = new grpc.Metadata();
  if (opts.token) {
    metadata.set("authorization", `Bearer ${opts.token}`);
  }
  const deadline = new Date(Date.now() + Number(opts.timeout) * 1000);
  const printer = new Printer(opts.json);
  let runId: string | null = opts.attach ?? null;
  let lastSeq = opts.attach ? Number(opts.after) : 0;
  let status: number | null = null;
  let timer: NodeJS.Timeout | null = null;
  let sayTimer: NodeJS.Timeout | null = null;
  // The CancelRun (and SendMessage) answer may come after run_finished; the program waits for it
  // before exiting.
  let canceling: Promise<void> = Promise.resolve();
  let saying: Promise<void> = Promise.resolve();
  let call: grpc.ClientReadableStream<OrchestrateEvent> | null = null;
  const open = (): grpc.ClientReadableStream<OrchestrateEvent> => {
    if (runId !== null) return client.AttachRun({ run_id: runId, after_seq: String(lastSeq) }, metadata, { deadline });
    const started = client.Orchestrate(request(opts), metadata, { deadline });
    started.on("metadata", (headers: grpc.Metadata) => tellReplay(headers, opts["run-id"]));
    return started;
  };
  const cancelLater = (id: string) => {
    timer = setTimeout(() => {
      canceling = new Promise((done) => {
        const deadline = new Date(Date.now() + 10_000);
        const mode = opts["cancel-mode"] === "after-turn" ? "CANCEL_MODE_AFTER_TURN" : "CANCEL_MODE_IMMEDIATE";
        client.CancelRun({ run_id: id, mode }, metadata, { deadline }, (err: grpc.ServiceError | null, answer: any) => {
          process.stderr.write(err ? `CancelRun failed: ${err.message}\n` : `CancelRun(${id}): canceled=${answer.canceled}\n`);
          done();
        });
      });
    }, Number(opts["cancel-after"]) * 1000);
  };

  const sayLater = (id: string) => {
    sayTimer = setTimeout(() => {
      saying = new Promise((done) => {
        const deadline = new Date(Date.now() + 10_000);
        const message = { role: "user", content: opts.say };
        client.SendMessage({ run_id: id, message }, metadata, { deadline }, (err: grpc.ServiceError | null, answer: any) => {
          process.stderr.write(
            err ? `SendMessage(${id}) refused: ${grpc.status[err.code]}: ${err.details}\n` : `SendMessage(${id}): ${answer.waiting} waiting\n`,
          );
          done();
        });
      });
    }, Number(opts["say-after"]) * 1000);
  };

  process.once("SIGINT", () => {
    printer.endInline();
    process.stderr.write("interrupted: the call was dropped\n");
    status = 130;
    call?.cancel();
  });

  try {
    let failures = 0;
    while (status === null) {
      call = open();
      let broke: grpc.ServiceError | null = null;
      try {
        // Read to the end of the call (its trailers), also after run_finished.
        for await (const e of call as AsyncIterable<OrchestrateEvent>) {
          if (Number(e.seq) <= lastSeq) continue; // sent again by the replica re-attached to
          [runId, lastSeq, failures] = [e.run_id, Number(e.seq), 0];
          if (timer === null && opts["cancel-after"] !== undefined) cancelLater(e.run_id);
          if (sayTimer === null && opts.say !== undefined) sayLater(e.run_id);
          printer.event(e);
          if (opts.decide !== undefined && e.event === "approval_requested") {
            await decide(client, metadata, e, opts.decide);
          }
          if (opts.answer !== undefined && e.event === "tool_input_requested") {
            await answer(client, metadata, e, opts.answer, String(opts["answer-content"]));
          }
          if (e.event === "run_finished") {
            status = EXIT[e.run_finished!.result.status] ?? 1;
          }
        }
      } catch (err) {
        broke = err as grpc.ServiceError;
      }
      if (status !== null) break;
      failures += 1;
      const reason = broke ? `${grpc.status[broke.code]}: ${broke.details}` : "the stream ended without run_finished";
      const attempts = Number(opts["reattach-attempts"]);
      if ((broke && !REATTACH.has(broke.code)) || runId === null || failures >= attempts) {
        printer.endInline();
        process.stderr.write(`error: ${reason}\n`);
        status = 3;
        break;
      }
      process.stderr.write(`re-attaching to run ${runId} after seq ${lastSeq} (${reason})\n`);
      await sleep(Math.min(100 * 2 ** (failures - 1), 2000));
    }
  } finally {
    if (timer !== null) clearTimeout(timer);
    if (sayTimer !== null) clearTimeout(sayTimer);
    await canceling;
    await saying;
    client.close();
  }
  return status ?? 3;
}

async function main() {
  // A closed pipe (`| head`) ends the program quietly, as it would a shell tool.
  process.stdout.on("error", (err: NodeJS.ErrnoException) => process.exit(err.code === "EPIPE" ? 0 : 3));
  let opts: Options;
  try {
    opts = options();
  } catch (err) {
    process.stderr.write(`orchestrate: ${(err as Error).message}\n`);
    return 2;
  }
  if (opts["list-approvals"]) return listApprovals(opts);
  if (opts["list-runs"]) return listRuns(opts);
  if (opts.detach) return startDetached(opts);
  return opts["get-thread"] !== undefined ? getThread(opts) : run(opts);
}

// Not process.exit(): it would cut off what is still queued for a piped stdout.
main().then((code) => {
  process.exitCode = code;
});
