//! [`RunRequest`]: an `OrchestrateRequest`, built step by step.

use std::time::Duration;

use proto::orchestrator::v1 as pb;

/// What a run is asked to do. Unset limits and parameters take the server's defaults.
///
/// ```
/// use std::time::Duration;
/// use orchestrator_client::RunRequest;
///
/// let request = RunRequest::prompt("Summarise the open tickets")
///     .system("You are terse.")
///     .run_id("tickets-2026-11-22")
///     .tool("search_tickets")
///     .exit_tool("submit_report", "File the summary")
///     .metadata("tenant", "acme")
///     .max_turns(6)
///     .run_timeout(Duration::from_secs(120))
///     .temperature(0.2)
///     .affinity_key("conversation-42");
/// let proto = request.into_proto();
/// assert_eq!(proto.messages[0].role, "user");
/// assert_eq!(proto.limits.and_then(|l| l.max_turns), Some(6));
/// assert_eq!(proto.affinity_key, "conversation-42");
/// ```
#[derive(Clone, Debug, Default)]
pub struct RunRequest {
    request: pb::OrchestrateRequest,
}

impl RunRequest {
    /// A run on one user message.
    pub fn prompt(text: impl Into<String>) -> Self {
        Self::default().message("user", text)
    }

    /// A run on a conversation so far (it must hold a `user` message).
    pub fn conversation(messages: Vec<pb::ChatMessage>) -> Self {
        let mut request = Self::default();
        request.request.messages = messages;
        request
    }

    /// Adds a message (`system`, `user`, `assistant` or `tool`) at the end of the conversation.
    pub fn message(mut self, role: &str, content: impl Into<String>) -> Self {
        self.request.messages.push(pb::ChatMessage {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        });
        self
    }

    /// The caller's system message.
    pub fn system(mut self, text: impl Into<String>) -> Self {
        self.request.system = text.into();
        self
    }

    /// The idempotency key: a run id that is live already is refused, a finished one replays.
    pub fn run_id(mut self, id: impl Into<String>) -> Self {
        self.request.run_id = id.into();
        self
    }

    /// What keeps the run's turns on one model endpoint, whose prefix cache holds its
    /// transcript (default: the run id); runs that share a prefix, a conversation's say, may
    /// share one.
    pub fn affinity_key(mut self, key: impl Into<String>) -> Self {
        self.request.affinity_key = key.into();
        self
    }

    /// Whether a tool call starts as soon as it is complete in the model's stream (default: the
    /// server's setting, on unless turned off).
    pub fn eager_tool_dispatch(mut self, eager: bool) -> Self {
        self.request.eager_tool_dispatch = Some(eager);
        self
    }

    /// Continues thread `id`: the model sees the thread's earlier runs before this request's
    /// messages, and this run's messages join the thread when it ends (a new id starts one).
    pub fn thread(mut self, id: impl Into<String>) -> Self {
        self.request.thread_id = id.into();
        self
    }

    /// What the run does when another run holds its thread (default: refused, `ABORTED`).
    pub fn on_busy(mut self, policy: pb::ThreadBusyPolicy) -> Self {
        self.request.on_busy = policy.into();
        self
    }

    /// The most turns of the thread the model sees, the newest (default: all it keeps).
    pub fn thread_history(mut self, turns: u32) -> Self {
        self.request.thread_history = Some(turns);
        self
    }

    /// The model to ask (default: the server's).
    pub fn model(mut self, name: impl Into<String>) -> Self {
        self.request.model = name.into();
        self
    }

    /// Allows this normal tool (with none named, every tool the runners offer).
    pub fn tool(mut self, name: impl Into<String>) -> Self {
        self.selection().normal.push(name.into());
        self
    }

    /// Offers an exit tool (a one-way signal) taking any JSON object.
    pub fn exit_tool(self, name: impl Into<String>, description: impl Into<String>) -> Self {
        self.exit_tool_with_schema(name, description, "")
    }

    /// Offers an exit tool whose arguments follow `schema_json` (a JSON Schema of an object).
    pub fn exit_tool_with_schema(
        mut self,
        name: impl Into<String>,
        description: impl Into<String>,
        schema_json: impl Into<String>,
    ) -> Self {
        self.selection().exit.push(pb::ExitToolSpec {
            name: name.into(),
            description: description.into(),
            parameters_json_schema: schema_json.into(),
        });
        self
    }

    /// A key/value passed to the tool-runners, spans and signals.
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.request.metadata.insert(key.into(), value.into());
        self
    }

    /// Adds a label: what `ListRuns` finds the run by (exact key=value).
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.request.labels.insert(key.into(), value.into());
        self
    }

    /// Runs as the named agent `name` (`ListAgents`): its definition fills what the request
    /// leaves out, and the request may set only what the agent lets it override.
    pub fn agent(mut self, name: impl Into<String>) -> Self {
        self.request.agent = name.into();
        self
    }

    /// The run goes on if the caller goes away (a dropped [`RunStream`](crate::RunStream) still
    /// cancels it).
    pub fn detached(mut self, detached: bool) -> Self {
        self.request.detached = detached;
        self
    }

    /// At most this many turns.
    pub fn max_turns(mut self, turns: u32) -> Self {
        self.limits().max_turns = Some(turns);
        self
    }

    /// At most this many normal tool calls.
    pub fn tool_call_budget(mut self, calls: u32) -> Self {
        self.limits().tool_call_budget = Some(calls);
        self
    }

    /// Turns with a failed tool call tolerated before the run fails.
    pub fn max_tool_failures(mut self, turns: u32) -> Self {
        self.limits().max_tool_failures = Some(turns);
        self
    }

    /// Timeout of each tool call.
    pub fn tool_timeout(mut self, timeout: Duration) -> Self {
        self.limits().tool_timeout_ms = Some(millis(timeout));
        self
    }

    /// Deadline of the whole run (on the server).
    pub fn run_timeout(mut self, timeout: Duration) -> Self {
        self.limits().run_timeout_ms = Some(millis(timeout));
        self
    }

    /// Calls of this normal tool wait for a person's decision before they run (besides the
    /// tools the runners and the server mark).
    pub fn needs_approval(mut self, tool: impl Into<String>) -> Self {
        self.approval().tools.push(tool.into());
        self
    }

    /// Every normal tool call of the run waits for a person's decision.
    pub fn approve_every_call(mut self) -> Self {
        self.approval().all_normal = true;
        self
    }

    /// How long a call may wait for its decision; with `fail_run`, an expired wait ends the run
    /// `APPROVAL_TIMEOUT` instead of rejecting the call.
    pub fn approval_timeout(mut self, timeout: Duration, fail_run: bool) -> Self {
        self.limits().approval_timeout_ms = Some(millis(timeout));
        self.approval().on_timeout = if fail_run {
            pb::ApprovalTimeoutAction::FailRun
        } else {
            pb::ApprovalTimeoutAction::Reject
        }
        .into();
        self
    }

    /// The run's deadline stops while it waits for decisions.
    pub fn pause_deadline_while_waiting(mut self) -> Self {
        self.approval().pause_deadline = true;
        self
    }

    /// Sampling temperature.
    pub fn temperature(mut self, temperature: f32) -> Self {
        self.params_mut().temperature = Some(temperature);
        self
    }

    /// Most tokens per turn.
    pub fn max_tokens(mut self, tokens: u32) -> Self {
        self.params_mut().max_tokens = Some(tokens);
        self
    }

    /// Every model parameter at once (unset fields: the server's defaults).
    pub fn params(mut self, params: pb::ModelParams) -> Self {
        self.request.params = Some(params);
        self
    }

    /// Tool calls the model cannot make as written are answered with an error so it can correct
    /// itself, instead of failing the run.
    pub fn feed_back_parse_errors(mut self) -> Self {
        self.request.parse_policy = pb::ParsePolicy::FeedBack.into();
        self
    }

    /// The request as the contract has it, for anything this builder does not cover.
    pub fn into_proto(self) -> pb::OrchestrateRequest {
        self.request
    }

    fn selection(&mut self) -> &mut pb::ToolSelection {
        self.request.tools.get_or_insert_with(Default::default)
    }

    fn approval(&mut self) -> &mut pb::ApprovalPolicy {
        self.selection().approval.get_or_insert_with(Default::default)
    }

    fn limits(&mut self) -> &mut pb::RunLimits {
        self.request.limits.get_or_insert_with(Default::default)
    }

    fn params_mut(&mut self) -> &mut pb::ModelParams {
        self.request.params.get_or_insert_with(Default::default)
    }
}

impl From<pb::OrchestrateRequest> for RunRequest {
    fn from(request: pb::OrchestrateRequest) -> Self {
        Self { request }
    }
}

/// `timeout` in whole milliseconds, at most `u32::MAX`.
fn millis(timeout: Duration) -> u32 {
    u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX)
}
