// The orchestrator's console: one page whose views are drawn from the gRPC service's answers
// (posted to /api/rpc/METHOD in the contract's JSON mapping as the signed-in person). No data is
// ever put into the page as HTML: every node is built with textContent, so nothing a model or a
// tool wrote can run here.

const main = document.getElementById("main");
const notice = document.querySelector(".notice");
let session = null; // {principal, roles, csrf, expiresAt, authenticates}
let stopView = () => {}; // stops the current view's timers and streams

// ── helpers ────────────────────────────────────────────────────────────────

/** An element: `h("button", {type: "button", onclick}, "Approve")`. */
function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "class") node.className = value;
    else if (value === true) node.setAttribute(key, "");
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

let ids = 0;
/** A labelled control: the label names it for a person and for a screen reader. */
function field(labelText, control) {
  control.id ||= `field-${++ids}`;
  const label = h("label", { for: control.id }, labelText);
  label.append(control);
  return label;
}

function say(text) {
  notice.textContent = text;
  clearTimeout(say.timer);
  say.timer = setTimeout(() => (notice.textContent = ""), 6000);
}

const statusName = (s) => String(s || "").replace(/^RUN_STATUS_/, "");
const time = (ms) => (Number(ms) ? new Date(Number(ms)).toISOString().replace(/\.\d+Z$/, "Z") : "-");
// A moment as a person reads it: their local time, the UTC time on hover and for machines.
const when = (ms) =>
  Number(ms)
    ? h("time", { datetime: new Date(Number(ms)).toISOString(), title: time(ms) }, new Date(Number(ms)).toLocaleString())
    : "-";
function pretty(json) {
  try {
    return JSON.stringify(JSON.parse(json), null, 2);
  } catch {
    return json;
  }
}

class Refusal extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** Calls `method` of the service as the signed-in person. */
async function rpc(method, request) {
  const answer = await fetch(`/api/rpc/${method}`, {
    method: "POST",
    headers: { "content-type": "application/json", "x-csrf-token": session?.csrf ?? "" },
    body: JSON.stringify(request),
    credentials: "same-origin",
  });
  const body = await answer.json().catch(() => ({}));
  if (!answer.ok) {
    if (answer.status === 401) showSignIn(body.message);
    throw new Refusal(answer.status, body.code, body.message || answer.statusText);
  }
  return body;
}

function every(ms, fn) {
  let stopped = false;
  let timer;
  const tick = async () => {
    if (stopped) return;
    try {
      await fn();
    } catch (e) {
      if (!(e instanceof Refusal) || e.status !== 401) say(String(e.message || e));
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

// ── sign-in ────────────────────────────────────────────────────────────────

function showSignIn(why) {
  stopView();
  session = null;
  document.querySelector("header nav").hidden = true;
  document.querySelector(".sign-out").hidden = true;
  document.querySelector(".who").textContent = "";
  const token = h("input", { type: "password", name: "token", autocomplete: "current-password" });
  const error = h("p", { class: "error", role: "alert" }, why && why !== "not signed in" ? why : "");
  const form = h(
    "form",
    {
      class: "inline",
      onsubmit: async (event) => {
        event.preventDefault();
        const answer = await fetch("/api/session", {
          method: "POST",
          headers: { "content-type": "application/json" },
          body: JSON.stringify({ token: token.value }),
          credentials: "same-origin",
        });
        const body = await answer.json().catch(() => ({}));
        if (!answer.ok) {
          error.textContent = body.message || "signing in failed";
          return;
        }
        token.value = "";
        signedIn(body);
      },
    },
    field("Token", token),
    h("button", { type: "submit" }, "Sign in"),
  );
  main.replaceChildren(
    h("h1", {}, "Sign in"),
    h("p", {}, "Sign in with a token of the orchestrator's tokens file (or your client certificate: leave the token empty)."),
    form,
    error,
  );
  token.focus();
}

function signedIn(body) {
  session = body;
  document.querySelector("header nav").hidden = false;
  document.querySelector(".sign-out").hidden = false;
  const roles = session.roles?.length ? ` (${session.roles.join(", ")})` : "";
  document.querySelector(".who").textContent = session.authenticates
    ? `Signed in as ${session.principal}${roles}`
    : "This server does not authenticate: everyone sees every run";
  route();
}

document.querySelector(".sign-out").addEventListener("click", async () => {
  await fetch("/api/session/end", {
    method: "POST",
    headers: { "content-type": "application/json", "x-csrf-token": session?.csrf ?? "" },
    body: "{}",
    credentials: "same-origin",
  });
  showSignIn();
});

// ── runs ───────────────────────────────────────────────────────────────────

const STATUSES = ["RUNNING", "AWAITING_APPROVAL", "AWAITING_INPUT", "COMPLETED", "FAILED", "CANCELED"];
const isOperator = () => session?.roles?.includes("operator") || !session?.authenticates;

// Why a run failed, beside its status (nothing for another).
const reasonOf = (run) =>
  run.failureReason && run.failureReason !== "FAILURE_REASON_UNSPECIFIED"
    ? h("span", { class: "reason" }, ` · ${run.failureReason.replace("FAILURE_REASON_", "")}`)
    : "";

function runsView(params) {
  const status = h("select", { name: "status" }, h("option", { value: "" }, "any"), STATUSES.map((s) => h("option", { value: s }, s)));
  const thread = h("input", { name: "thread", value: params.get("thread") ?? "" });
  const label = h("input", { name: "label", placeholder: "key=value", value: params.get("label") ?? "" });
  const principal = h("input", { name: "principal", value: params.get("principal") ?? "" });
  const agent = h("input", { name: "agent", value: params.get("agent") ?? "" });
  status.value = params.get("status") ?? "";
  const rows = h("tbody");
  const more = h("p");
  let pageToken = "";
  const request = () => {
    const asked = { threadId: thread.value.trim(), principal: principal.value.trim(), agent: agent.value.trim(), pageSize: 50, pageToken };
    if (status.value) asked.statuses = [`RUN_STATUS_${status.value}`];
    const [key, ...value] = label.value.split("=");
    if (key.trim()) asked.labels = { [key.trim()]: value.join("=") };
    return asked;
  };
  let drawn = "";
  const draw = async () => {
    const page = await rpc("ListRuns", request());
    // Redrawn only when the page changed, keeping the keyboard focus where it was.
    const seen = JSON.stringify(page);
    if (seen === drawn) return;
    drawn = seen;
    const focused = rows.contains(document.activeElement) ? document.activeElement.getAttribute("href") : null;
    rows.replaceChildren(
      ...page.runs.map((run) =>
        h(
          "tr",
          {},
          h("td", {}, h("a", { href: `#/runs/${encodeURIComponent(run.runId)}` }, run.runId)),
          h("td", { class: `status ${statusName(run.status)}` }, statusName(run.status), reasonOf(run)),
          h("td", {}, run.principal || "-"),
          h("td", {}, run.threadId ? h("a", { href: `#/threads/${encodeURIComponent(run.threadId)}` }, run.threadId) : "-"),
          h("td", {}, run.agent ? h("span", { title: `version ${run.agentVersion}` }, run.agent) : "-"),
          h("td", { class: "number" }, run.turns),
          h("td", { class: "number" }, Number(run.usage?.promptTokens ?? 0) + Number(run.usage?.completionTokens ?? 0)),
          h("td", {}, when(run.createdAtMs)),
          h("td", { class: "labels" }, Object.entries(run.labels ?? {}).map(([k, v]) => `${k}=${v}`).join(", ")),
          h("td", { class: "asked", title: run.prompt ?? "" }, run.prompt ?? ""),
        ),
      ),
    );
    if (focused) rows.querySelector(`a[href="${CSS.escape(focused)}"]`)?.focus();
    if (!page.runs.length) rows.replaceChildren(h("tr", {}, h("td", { colspan: 10, class: "muted" }, "No run matches.")));
    more.replaceChildren(
      page.nextPageToken
        ? h("button", { type: "button", onclick: () => { pageToken = page.nextPageToken; draw(); } }, "Next page")
        : "",
      pageToken ? h("button", { type: "button", onclick: () => { pageToken = ""; draw(); } }, "First page") : "",
    );
  };
  // The filters live in the page's address, so a filtered listing can be shared and reloaded.
  const remember = () => {
    const query = new URLSearchParams();
    for (const [name, input] of [["status", status], ["thread", thread], ["label", label], ["principal", principal], ["agent", agent]]) {
      if (input.value.trim()) query.set(name, input.value.trim());
    }
    history.replaceState(null, "", `#/runs${query.size ? `?${query}` : ""}`);
  };
  const filters = h(
    "form",
    { class: "filters", onsubmit: (e) => { e.preventDefault(); pageToken = ""; remember(); draw().catch((x) => say(x.message)); } },
    field("Status", status),
    field("Thread", thread),
    field("Label", label),
    field("Agent", agent),
    isOperator() ? field("Principal", principal) : "",
    h("button", { type: "submit" }, "Apply"),
  );
  const head = ["Run", "Status", "Principal", "Thread", "Agent", "Turns", "Tokens", "Created", "Labels", "Asked"].map((c) =>
    h("th", { scope: "col", class: c === "Turns" || c === "Tokens" ? "number" : "" }, c),
  );
  main.replaceChildren(
    h("h1", {}, "Runs"),
    filters,
    h("table", { "aria-label": "Runs" }, h("thead", {}, h("tr", {}, head)), rows),
    more,
  );
  return every(3000, draw);
}

// ── one run, live ──────────────────────────────────────────────────────────

function runView(runId) {
  const heading = h("h1", {}, `Run ${runId}`);
  const state = h("p", { class: "state", "aria-live": "polite" });
  const log = h("div", { class: "log" });
  const final = h("section", { "aria-label": "Result" });
  // What the run does now, kept at the top, and whether the page scrolls along with it.
  const live = h("p", { class: "live", role: "status" }, "Live");
  const following = h("input", { type: "checkbox", name: "follow", checked: true });
  const toggle = h("label", { class: "check" }, following, "Follow the run");
  main.replaceChildren(heading, live, toggle, state, log, final);
  const running = new Map();
  let turnNow = 0;
  const tell = () => {
    const now = Date.now();
    const inFlight = [...running.values()].map((c) => `${c.name} (${Math.round((now - c.since) / 1000)} s)`);
    live.textContent = `Live · turn ${turnNow || "–"}${inFlight.length ? ` · running: ${inFlight.join(", ")}` : ""}`;
    for (const [id, c] of running) calls.get(id)?.progress.replaceChildren(`running · ${Math.round((now - c.since) / 1000)} s`);
  };
  const ticking = setInterval(() => running.size && tell(), 1000);
  let source = null;
  let stopped = false;
  const turns = new Map();
  const calls = new Map();

  const turnBox = (n) => {
    if (!turns.has(n)) {
      const text = h("p", { class: "text" });
      const reasoningText = h("pre");
      const reasoning = h("details", { hidden: true }, h("summary", {}, "Reasoning"), reasoningText);
      const box = h("section", { class: "turn", "aria-label": `Turn ${n}` }, h("h2", {}, `Turn ${n}`), reasoning, text);
      turns.set(n, { box, text, reasoning, reasoningText });
      log.append(box);
    }
    return turns.get(n);
  };

  const controls = () => {
    const message = h("textarea", { rows: 2, cols: 50, name: "message" });
    return h(
      "div",
      { class: "controls" },
      h("button", { type: "button", onclick: () => confirm(`Cancel run ${runId} now? Its call in progress is abandoned.`) && cancel("CANCEL_MODE_IMMEDIATE") }, "Cancel now"),
      h("button", { type: "button", onclick: () => cancel("CANCEL_MODE_AFTER_TURN") }, "Cancel after this turn"),
      h(
        "form",
        {
          class: "inline",
          onsubmit: async (e) => {
            e.preventDefault();
            try {
              const answer = await rpc("SendMessage", { runId, message: { role: "user", content: message.value } });
              message.value = "";
              say(`Sent; ${answer.waiting} message(s) wait for the run's next turn.`);
            } catch (x) {
              say(x.message);
            }
          },
        },
        field("Message to the run", message),
        h("button", { type: "submit" }, "Send"),
      ),
    );
  };
  const liveControls = controls();

  async function cancel(mode) {
    try {
      const answer = await rpc("CancelRun", { runId, mode });
      say(answer.canceled ? "Canceled." : "The run had already ended.");
    } catch (x) {
      say(x.message);
    }
  }

  const apply = (event) => {
    const kind = Object.keys(event).find((k) => !["runId", "seq"].includes(k));
    const e = event[kind];
    track(kind, e);
    if (following.checked && kind !== "runFinished") queueMicrotask(() => window.scrollTo(0, document.body.scrollHeight));
    switch (kind) {
      case "runStarted":
        state.textContent = `Model ${e.model} · tools: ${e.normalTools.join(", ") || "none"}${e.threadId ? ` · thread ${e.threadId}` : ""}`;
        if (e.threadId) state.append(" ", h("a", { href: `#/threads/${encodeURIComponent(e.threadId)}` }, "open the thread"));
        state.after(liveControls);
        break;
      case "textDelta":
        turnBox(e.turn).text.append(e.text);
        break;
      case "reasoningDelta": {
        const t = turnBox(e.turn);
        t.reasoning.hidden = false;
        t.reasoningText.append(e.text);
        break;
      }
      case "toolCallStarted":
      case "approvalRequested":
      case "toolInputRequested":
        callBox(e, kind);
        break;
      case "toolCallFinished":
        callFinished(e);
        break;
      case "callDecided":
        callDecided(e);
        break;
      case "toolCallProgress":
        calls.get(e.callId)?.progress.replaceChildren(`${e.message || "working"}${e.total ? ` (${e.progress}/${e.total})` : ""}`);
        break;
      case "signal":
        turnBox(e.turn ?? 0).box.append(h("p", {}, `Signal ${e.toolName}`, h("pre", {}, pretty(e.argumentsJson))));
        break;
      case "turnRestarted":
        turnBox(e.turn).box.append(h("p", { class: "restart" }, `Turn ${e.turn} starts again (attempt ${e.attempt}): ${e.reason}. Its text above is void.`));
        turnBox(e.turn).text.replaceChildren();
        break;
      case "messageAdded":
        turnBox(e.turn).box.prepend(h("p", { class: "muted" }, `A message joins turn ${e.turn}: ${e.message?.content ?? ""}`));
        break;
      case "turnFinished":
        turnBox(e.turn).box.append(h("p", { class: "muted" }, `Turn ${e.turn} finished · ${e.usage?.promptTokens ?? 0} prompt + ${e.usage?.completionTokens ?? 0} completion tokens`));
        break;
      case "runFinished":
        finished(e.result);
        break;
    }
  };

  const callBox = (e, kind) => {
    let call = calls.get(e.callId);
    if (!call) {
      const result = h("div", { class: "result" });
      const progress = h("p", { class: "muted" });
      const waiting = h("div");
      const box = h(
        "div",
        { class: "call", role: "group", "aria-label": `Tool call ${e.name} ${e.callId}` },
        h("p", {}, h("strong", {}, e.name), ` `, h("span", { class: "muted" }, `[${e.callId}]`)),
        h("pre", {}, pretty(e.argumentsJson ?? "{}")),
        waiting,
        progress,
        result,
      );
      call = { box, result, progress, waiting };
      calls.set(e.callId, call);
      turnBox(e.turn).box.append(box);
    }
    if (kind === "approvalRequested") call.waiting.replaceChildren(decisionBox(runId, { callId: e.callId, name: e.name, argumentsJson: e.argumentsJson, inDoubt: e.inDoubt }));
    if (kind === "toolInputRequested") call.waiting.replaceChildren(questionsBox(runId, { callId: e.callId, name: e.name, inputRequests: e.requests, inputRound: e.round }));
    if (kind === "toolCallStarted") call.waiting.replaceChildren();
  };

  // Who decided a call, when, after how long, and what: kept in the call's box.
  const callDecided = (e) => {
    const call = calls.get(e.callId) ?? (callBox({ ...e, argumentsJson: "{}" }, "toolCallStarted"), calls.get(e.callId));
    const d = e.decision ?? {};
    const who = d.principal || "the anonymous caller";
    const after = `after ${Math.round(Number(e.waitedMs ?? 0) / 1000)} s`;
    const what = {
      APPROVAL_OUTCOME_APPROVED: `Approved by ${who} ${after}`,
      APPROVAL_OUTCOME_EDITED: `Approved with edited arguments by ${who} ${after}`,
      APPROVAL_OUTCOME_REJECTED: `Rejected by ${who} ${after}: ${d.message ?? ""}`,
      APPROVAL_OUTCOME_TIMED_OUT: `Not decided in time (${after}): ${d.message ?? ""}`,
      APPROVAL_OUTCOME_ANSWERED: `Answered by ${who} ${after}`,
    }[d.outcome] ?? `Decided by ${who} ${after}`;
    call.waiting.replaceChildren();
    call.box.insertBefore(
      h("p", { class: "decision" }, `${what} · `, when(d.decidedAtUnixMs), d.editedArgumentsJson ? h("pre", {}, pretty(d.editedArgumentsJson)) : ""),
      call.progress,
    );
  };

  const callFinished = (e) => {
    const call = calls.get(e.callId) ?? (callBox({ ...e, turn: 0, argumentsJson: "{}" }, "toolCallStarted"), calls.get(e.callId));
    call.waiting.replaceChildren();
    call.progress.replaceChildren();
    call.result.replaceChildren(
      e.ok
        ? h("p", {}, h("span", { class: "ok" }, `ok · ${e.durationMs} ms`))
        : h("p", {}, h("span", { class: "failed" }, `failed · ${e.durationMs} ms · ${e.error?.code}: ${e.error?.message}`)),
      e.ok ? h("pre", {}, pretty(e.contentJson)) : "",
    );
  };

  // The live line: the turn under way and the calls in flight, with how long they have run.
  const track = (kind, e) => {
    if (e?.turn) turnNow = e.turn;
    if (kind === "toolCallStarted") running.set(e.callId, { name: e.name, since: Date.now() });
    if (kind === "toolCallFinished" || kind === "callDecided") running.delete(e.callId);
    if (kind === "approvalRequested" || kind === "toolInputRequested") {
      running.delete(e.callId);
      live.textContent = `Waiting for a person: ${e.name} [${e.callId}]`;
      return;
    }
    if (kind !== "runFinished") tell();
  };

  const finished = (result) => {
    stopped = true;
    clearInterval(ticking);
    running.clear();
    live.textContent = `Ended ${statusName(result.status)}`;
    source?.close();
    liveControls.remove();
    const status = statusName(result.status);
    final.replaceChildren(
      h("h2", {}, "Result"),
      h("p", {}, h("span", { class: `status ${status}` }, status), ` · ${result.turns} turn(s) · ${result.toolCalls?.length ?? 0} tool call(s)`),
      result.failureDetail ? h("p", { class: "error" }, result.failureDetail) : "",
      h("p", { class: "text" }, result.text),
      result.signals?.length ? h("ul", { "aria-label": "Signals" }, result.signals.map((s) => h("li", {}, `${s.toolName}: `, h("pre", {}, pretty(s.argumentsJson))))) : "",
    );
  };

  const follow = () => {
    // The browser attaches again by itself when the stream breaks (a replica stops or dies):
    // from the Last-Event-ID it saw, on whichever replica answers.
    source = new EventSource(`/api/runs/${encodeURIComponent(runId)}/events?after=0`);
    source.addEventListener("run", (message) => apply(JSON.parse(message.data)));
    source.addEventListener("error", () => {
      if (!stopped && source.readyState === EventSource.CLOSED) setTimeout(() => !stopped && check(), 2000);
    });
  };

  // The run first (a refusal says "not found" in the page, once a run just started has had a
  // few seconds to be found), then its events.
  let looked = 0;
  const check = async () => {
    try {
      const run = await rpc("GetRun", { runId });
      if (run.agent && !heading.nextElementSibling?.classList.contains("agent")) {
        heading.after(h("p", { class: "agent" }, `Agent ${run.agent} · version ${run.agentVersion}`));
      }
      if (run.prompt && !main.querySelector("blockquote.asked")) {
        heading.after(h("blockquote", { class: "asked text", "aria-label": "What the run was asked" }, run.prompt));
      }
      if (!source || source.readyState === EventSource.CLOSED) follow();
    } catch (x) {
      if (x.status === 404 && ++looked < 5 && !stopped) {
        setTimeout(check, 1000);
      } else if (x.status === 404) {
        stopped = true;
        main.replaceChildren(h("h1", {}, "Not found"), h("p", { role: "alert" }, `No run ${runId} that you may see: ${x.message}`));
      } else say(x.message);
    }
  };
  check();
  return () => {
    stopped = true;
    clearInterval(ticking);
    source?.close();
  };
}

// ── what waits for a person ───────────────────────────────────────────────

/** Approve / reject a call waiting for approval; for a call in doubt (it ran, and its
 * tool-runner went away before its outcome was kept), run it again or leave it in doubt. */
function decisionBox(runId, pending) {
  const reason = h("input", { name: "reason" });
  const edited = h("textarea", { name: "arguments", rows: 3, cols: 50 }, pretty(pending.argumentsJson ?? "{}"));
  const out = h("p", { role: "status" });
  const decide = async (kind) => {
    try {
      const decision = { callId: pending.callId, kind, message: reason.value };
      if (kind === "DECISION_KIND_APPROVE_EDITED") decision.argumentsJson = edited.value;
      await rpc("DecideToolCalls", { runId, decisions: [decision] });
      const done = pending.inDoubt ? ["Running it again.", "Left in doubt."] : ["Approved.", "Rejected."];
      out.textContent = kind === "DECISION_KIND_REJECT" ? done[1] : kind === "DECISION_KIND_APPROVE_EDITED" ? "Approved with your arguments." : done[0];
      // The keyboard goes on from the answer, not from a button that is gone.
      out.tabIndex = -1;
      out.focus();
    } catch (x) {
      out.textContent = x.message;
      out.className = "error";
    }
  };
  return h(
    "div",
    { class: "waiting", role: "group", "aria-label": `Approval of ${pending.name} ${pending.callId}` },
    pending.inDoubt
      ? h("p", { class: "error" }, `${pending.name} ran and is in doubt: its tool-runner went away before its outcome was kept, so it may or may not have taken effect. Run it again only if it did not.`)
      : h("p", {}, `${pending.name} waits for approval`),
    h("div", { class: "controls" },
      h("button", { type: "button", onclick: () => decide("DECISION_KIND_APPROVE") }, pending.inDoubt ? "Run again" : "Approve"),
      field(pending.inDoubt ? "Reason (for leaving it)" : "Reason (for a rejection)", reason),
      h("button", { type: "button", onclick: () => decide("DECISION_KIND_REJECT") }, pending.inDoubt ? "Leave in doubt" : "Reject"),
    ),
    pending.inDoubt
      ? ""
      : h("details", {}, h("summary", {}, "Approve with edited arguments"),
          h("div", { class: "controls" },
            field("Arguments (a JSON object)", edited),
            h("button", { type: "button", onclick: () => decide("DECISION_KIND_APPROVE_EDITED") }, "Approve with these arguments"))),
    out,
  );
}

/** A form per question a tool asks: fields from its JSON schema, or a link for a URL. */
function questionsBox(runId, pending) {
  const out = h("p", { role: "status" });
  const answers = new Map();
  const parts = (pending.inputRequests ?? []).map((q) => {
    if (q.mode === "url") {
      answers.set(q.key, () => ({ key: q.key, action: "INPUT_ACTION_ACCEPT", contentJson: "" }));
      return h("div", {}, h("p", {}, q.message), h("p", {}, h("a", { href: q.url, target: "_blank", rel: "noopener noreferrer" }, `Open ${q.url}`), " (then say you did)"));
    }
    let schema = {};
    try {
      schema = JSON.parse(q.schemaJson || "{}");
    } catch {}
    const controls = Object.entries(schema.properties ?? {}).map(([name, spec]) => [name, spec, control(name, spec, (schema.required ?? []).includes(name))]);
    answers.set(q.key, () => {
      const content = {};
      for (const [name, spec, c] of controls) {
        const value = spec.type === "boolean" ? c.checked : c.value;
        if (value === "" && spec.type !== "boolean") continue;
        content[name] = spec.type === "integer" || spec.type === "number" ? Number(value) : value;
      }
      return { key: q.key, action: "INPUT_ACTION_ACCEPT", contentJson: JSON.stringify(content) };
    });
    return h("fieldset", {}, h("legend", {}, q.message || q.key), controls.map(([name, spec, c]) => spec.type === "boolean" ? labelCheck(spec.title || name, c) : field(spec.title || name, c)));
  });
  const send = async (action) => {
    const given = [...answers.entries()].map(([key, answer]) => (action === "INPUT_ACTION_ACCEPT" ? answer() : { key, action, contentJson: "" }));
    try {
      await rpc("AnswerToolInput", { runId, callId: pending.callId, answers: given, round: pending.inputRound ?? "" });
      out.className = "";
      out.textContent = action === "INPUT_ACTION_ACCEPT" ? "Answered." : "Declined.";
    } catch (x) {
      out.className = "error";
      out.textContent = x.message;
    }
  };
  return h(
    "form",
    { class: "waiting", "aria-label": `Questions of ${pending.name} ${pending.callId}`, onsubmit: (e) => { e.preventDefault(); send("INPUT_ACTION_ACCEPT"); } },
    h("p", {}, `${pending.name} asks`),
    parts,
    h("div", { class: "controls" },
      h("button", { type: "submit" }, "Answer"),
      h("button", { type: "button", onclick: () => send("INPUT_ACTION_DECLINE") }, "Decline"),
    ),
    out,
  );
}

/** An input for one property of a form's schema (the server checks the answer against it). */
function control(name, spec, required) {
  if (spec.type === "boolean") return h("input", { type: "checkbox", name });
  if (Array.isArray(spec.enum)) return h("select", { name, required }, h("option", { value: "" }, "—"), spec.enum.map((v) => h("option", { value: v }, v)));
  const numeric = spec.type === "integer" || spec.type === "number";
  return h("input", {
    name,
    required,
    // The browser's own checks are left out (novalidate-like): the schema's verdict is the
    // server's, shown as it says it.
    type: "text",
    inputmode: numeric ? "decimal" : undefined,
    placeholder: spec.description ?? "",
  });
}

function labelCheck(text, input) {
  input.id ||= `field-${++ids}`;
  return h("label", { class: "check", for: input.id }, input, text);
}

function waitingView() {
  const list = h("div", { "aria-live": "polite" });
  const drawn = new Map();
  main.replaceChildren(h("h1", {}, "Waiting for a person"), list);
  return every(2000, async () => {
    const answer = await rpc("ListPendingApprovals", { runId: "", limit: 100 });
    const seen = new Set();
    for (const p of answer.approvals) {
      const key = `${p.runId}/${p.callId}${p.inDoubt ? "/in-doubt" : ""}`;
      seen.add(key);
      if (drawn.has(key)) continue;
      const asks = p.inputRequests?.length;
      // What the run is about, to decide on: what it was asked, its labels, and what the model
      // said before the call (kept with the call: no read of the run).
      const labels = Object.entries(p.labels ?? {}).map(([k, v]) => `${k}=${v}`).join(", ");
      const context = h(
        "div",
        { class: "context" },
        p.prompt ? h("p", {}, h("strong", {}, "Asked: "), h("span", { class: "text" }, p.prompt)) : "",
        labels ? h("p", {}, `Labels: ${labels}`) : "",
        p.saidBefore ? h("blockquote", { class: "text", "aria-label": "What the model said before the call" }, p.saidBefore) : "",
      );
      const box = h(
        "article",
        { "aria-label": `${p.name} in run ${p.runId}${p.inDoubt ? ", in doubt" : ""}` },
        h("h2", {}, `${p.name} · run `, h("a", { href: `#/runs/${encodeURIComponent(p.runId)}` }, p.runId)),
        h("p", { class: "muted" }, `turn ${p.turn} · ${p.principal ? `owner ${p.principal} · ` : ""}expires `, when(p.expiresAtUnixMs)),
        context,
        h("pre", {}, pretty(p.argumentsJson)),
        asks ? questionsBox(p.runId, p) : decisionBox(p.runId, p),
      );
      drawn.set(key, box);
      list.append(box);
    }
    for (const [key, box] of drawn) {
      if (!seen.has(key)) {
        box.remove();
        drawn.delete(key);
      }
    }
    if (!drawn.size) list.replaceChildren(h("p", { class: "muted" }, "Nothing waits for you."));
    else list.querySelector("p.muted:only-child")?.remove();
  });
}

// ── a thread, usage ─────────────────────────────────────────────────────────

async function threadView(threadId) {
  main.replaceChildren(h("h1", {}, `Thread ${threadId}`));
  try {
    const t = await rpc("GetThread", { threadId });
    main.append(
      h("p", {}, `${t.runs.length} run(s) · ${t.messages.length} message(s) · ${t.bytes} bytes${t.liveRunId ? ` · held by ${t.liveRunId}` : ""}`),
      h("h2", {}, "Runs"),
      h("ul", {}, t.runs.map((r) => h("li", {}, h("a", { href: `#/runs/${encodeURIComponent(r.runId)}` }, r.runId), ` · ${statusName(r.status)} · ${r.messages} message(s)`))),
      h("h2", {}, "Messages"),
      h("ol", { class: "messages" }, t.messages.map((m) => h("li", {}, h("strong", {}, `${m.role}: `), h("span", { class: "text" }, m.content), (m.toolCalls ?? []).map((c) => h("pre", {}, `calls ${c.name} ${c.argumentsJson}`))))),
    );
  } catch (x) {
    main.append(h("p", { role: "alert" }, x.status === 404 ? `Not found: ${x.message}` : x.message));
  }
  return () => {};
}

function usageView() {
  const principal = h("input", { name: "principal" });
  const hours = h("select", { name: "since" }, [24, 72, 168].map((n) => h("option", { value: n }, `${n} hours`)));
  const table = h("tbody");
  const draw = async () => {
    const to = Date.now();
    const u = await rpc("GetUsage", { principal: principal.value.trim(), fromMs: String(to - Number(hours.value) * 3600_000), toMs: String(to) });
    const row = (label, w) =>
      h("tr", {}, h("th", { scope: "row" }, label), ["promptTokens", "cachedPromptTokens", "completionTokens", "runs", "toolCalls"].map((k) => h("td", { class: "number" }, w?.[k] ?? 0)), h("td", { class: "number" }, `${Math.round(Number(w?.runMs ?? 0) / 1000)} s`));
    table.replaceChildren(...u.windows.map((w) => row(time(w.startMs), w)), row(`total (${u.principal || "you"})`, u.total));
  };
  main.replaceChildren(
    h("h1", {}, "Usage"),
    h("form", { class: "filters", onsubmit: (e) => { e.preventDefault(); draw().catch((x) => say(x.message)); } },
      isOperator() ? field("Principal", principal) : "",
      field("Over the last", hours),
      h("button", { type: "submit" }, "Show")),
    h("table", { "aria-label": "Usage" },
      h("thead", {}, h("tr", {}, ["Hour", "Prompt", "Cached", "Completion", "Runs", "Tool calls", "Run time"].map((c, i) => h("th", { scope: "col", class: i ? "number" : "" }, c)))),
      table),
  );
  draw().catch((x) => say(x.message));
  return () => {};
}

// ── webhooks ───────────────────────────────────────────────────────────────

function webhooksView(webhookId) {
  const list = h("tbody");
  const deliveries = h("tbody");
  const shown = h("p", { class: "muted" });
  const stateName = (s) => String(s ?? "").replace("WEBHOOK_DELIVERY_STATE_", "").toLowerCase();
  const draw = async () => {
    const hooks = await rpc("ListWebhooks", {});
    list.replaceChildren(...hooks.webhooks.map((w) =>
      h("tr", {},
        h("td", {}, h("a", { href: `#/webhooks/${encodeURIComponent(w.id)}`, "aria-current": w.id === webhookId ? "page" : "false" }, w.id)),
        h("td", { class: "text" }, w.url),
        h("td", {}, (w.events ?? []).join(", ") || "all"),
        h("td", {}, w.runId ? `run ${w.runId}` : w.threadId ? `thread ${w.threadId}` : "all runs"),
        h("td", {}, when(w.createdAtUnixMs)))));
    if (!hooks.webhooks.length) list.replaceChildren(h("tr", {}, h("td", { colspan: 5, class: "muted" }, "No webhooks (orchestrator webhooks add URL registers one).")));
    const d = await rpc("ListWebhookDeliveries", { webhookId: webhookId ?? "", limit: 100 });
    shown.textContent = webhookId ? `Deliveries of ${webhookId}, newest first.` : "Deliveries of every webhook, newest first.";
    deliveries.replaceChildren(...d.deliveries.map((x) =>
      h("tr", { class: stateName(x.state) },
        h("td", {}, x.id),
        h("td", {}, x.event),
        h("td", {}, h("a", { href: `#/runs/${encodeURIComponent(x.runId)}` }, x.runId)),
        h("td", {}, stateName(x.state)),
        h("td", { class: "number" }, x.attempts ?? 0),
        h("td", { class: "text" }, x.lastError || (x.lastStatus ? String(x.lastStatus) : "–")),
        h("td", {}, when(x.lastAttemptUnixMs)))));
    if (!d.deliveries.length) deliveries.replaceChildren(h("tr", {}, h("td", { colspan: 7, class: "muted" }, "No deliveries.")));
  };
  main.replaceChildren(
    h("h1", {}, "Webhooks"),
    h("table", { "aria-label": "Webhooks" },
      h("thead", {}, h("tr", {}, ["Webhook", "URL", "Events", "Runs", "Created"].map((c) => h("th", { scope: "col" }, c)))),
      list),
    h("h2", {}, "Deliveries"),
    shown,
    h("table", { "aria-label": "Deliveries" },
      h("thead", {}, h("tr", {}, ["Delivery", "Event", "Run", "State", "Attempts", "Last answer", "Last attempt"].map((c, i) => h("th", { scope: "col", class: i === 4 ? "number" : "" }, c)))),
      deliveries),
  );
  draw().catch((x) => say(x.message));
  const timer = setInterval(() => draw().catch(() => {}), 3000);
  return () => clearInterval(timer);
}

// ── routing ────────────────────────────────────────────────────────────────

async function route() {
  stopView();
  if (!session) return;
  const [path, query] = location.hash.slice(1).split("?");
  const parts = (path || "/runs").split("/").filter(Boolean).map(decodeURIComponent);
  const params = new URLSearchParams(query ?? "");
  const views = {
    runs: () => (parts[1] ? runView(parts[1]) : runsView(params)),
    waiting: waitingView,
    threads: () => threadView(parts[1] ?? ""),
    usage: usageView,
    webhooks: () => webhooksView(parts[1]),
  };
  const view = views[parts[0]] ?? views.runs;
  const stop = await view();
  stopView = typeof stop === "function" ? stop : () => {};
  main.focus();
}

window.addEventListener("hashchange", route);

(async () => {
  const answer = await fetch("/api/session", { credentials: "same-origin" });
  const body = await answer.json().catch(() => ({}));
  if (answer.ok) signedIn(body);
  else showSignIn(body.message);
})();
