//! The orchestrator's error type, and how each error becomes a gRPC status.

use std::net::SocketAddr;

/// Everything that stops the orchestrator from starting, or a request from being served.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A flag, environment value or file is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A limit is outside its allowed range.
    #[error("invalid configuration: {0}")]
    Limit(#[from] shared::config::ConfigError),
    /// The request is malformed; the message says how to fix it.
    #[error("{0}")]
    InvalidArgument(String),
    /// A live run already has this id (here or on another replica).
    #[error(
        "run_id {0:?} is already running; use another id, or follow this one (`orchestrator get` / `cancel`, GetRun / CancelRun)"
    )]
    AlreadyRunning(String),
    /// No tool-runner answers, so the run would have no tools; retryable.
    #[error("no tool-runner answers ({0}); retry later")]
    NoToolRunner(String),
    /// The caller may not do this (a tool outside its allowlist).
    #[error("{0}")]
    PermissionDenied(String),
    /// The caller has as many runs in flight as it may.
    #[error("principal {principal:?} already has its limit of {limit} runs in flight; retry later")]
    CallerBusy {
        /// The caller.
        principal: String,
        /// Its `max_runs`.
        limit: usize,
    },
    /// TLS, the tokens file or the health address cannot be set up.
    #[error(transparent)]
    Security(#[from] shared::serving::SecurityError),
    /// Every run slot is taken.
    #[error("all {0} run slots are busy; retry later")]
    Busy(usize),
    /// As many callers as allowed are attached to runs.
    #[error("{0} callers are attached to runs already (--max-attached); retry later")]
    AttachBusy(usize),
    /// No such run (or its result expired).
    #[error("{0}")]
    NotFound(String),
    /// The orchestrator is shutting down.
    #[error("the orchestrator is draining (shutting down); retry on another replica")]
    Draining,
    /// A run live on another replica could not be reached there (it is moving between replicas).
    #[error("run {0} is live on another replica that did not answer (it may be moving between replicas); try again")]
    RunElsewhere(String),
    /// A caller's stream ended before `run_finished`: the run moved to another replica.
    #[error(
        "run {run_id:?} moved to another orchestrator replica (or its event log could not keep its events); attach to it again after seq {after_seq}"
    )]
    Moved {
        /// The run.
        run_id: String,
        /// The last seq the caller was sent.
        after_seq: u64,
    },
    /// An attached caller's stream ended: this replica drains, or stopped acting for the run.
    #[error(
        "this orchestrator replica is draining, or stopped acting for the run; attach to run {run_id:?} again after seq {after_seq}"
    )]
    LeftReplica {
        /// The run.
        run_id: String,
        /// The last seq the caller was sent.
        after_seq: u64,
    },
    /// A command of the command line (`call`, `approvals`, `decide`) was refused by the
    /// orchestrator it called, or lost its stream.
    #[error("{0}")]
    Call(String),
    /// A service the orchestrator depends on (e.g. NATS) cannot be used.
    #[error("{0}")]
    Dependency(String),
    /// The result store cannot be opened or read.
    #[error("the result store: {0}")]
    Store(#[from] crate::domain::ports::StoreError),
    /// A run's event log cannot serve a re-attaching caller.
    #[error(transparent)]
    Log(#[from] crate::domain::ports::LogError),
    /// The signal topic cannot be opened.
    #[error(transparent)]
    Topic(#[from] crate::signals::TopicError),
    /// The listen address cannot be bound.
    #[error("cannot listen on {address} ({flag}): {source}")]
    Listen {
        /// The address.
        address: SocketAddr,
        /// The flag that sets it, and what to do.
        flag: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// A proto enum holds a value this build has no meaning for (a stored result written by
    /// another version, or `UNSPECIFIED` where a value is required).
    #[error("{field} {value} is not a value this orchestrator knows")]
    Contract {
        /// The proto enum.
        field: &'static str,
        /// The number on the wire.
        value: i32,
    },
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// The run cannot take what was sent now (it ended, or has no turn boundary left).
    #[error("{0}")]
    NotNow(String),
    /// The run was sent as many messages as it may be.
    #[error("run {run_id:?} was sent its limit of {max} messages (--max-steering-messages)")]
    InboxFull {
        /// The run.
        run_id: String,
        /// Its bound.
        max: u32,
    },
    /// Another run holds the thread and the request's policy is to refuse.
    #[error(
        "thread {thread_id:?} is busy: run {live:?} holds it; wait for it to end, or ask for on_busy enqueue, interrupt or rollback"
    )]
    ThreadBusy {
        /// The thread.
        thread_id: String,
        /// The run holding it.
        live: String,
    },
    /// As many runs wait for the thread as may.
    #[error("{max} runs wait for thread {thread_id:?} already (--thread-queue); retry later")]
    ThreadQueueFull {
        /// The thread.
        thread_id: String,
        /// Its bound.
        max: usize,
    },
    /// No slot was free and the run may not wait for one.
    #[error("no run slot is free for principal {principal:?} and it may not wait: {full}; retry later")]
    QueueFull {
        /// The caller.
        principal: String,
        /// Which queue is full.
        full: crate::domain::share::QueueFull,
    },
    /// The caller's tokens this hour are spent.
    #[error(
        "principal {principal:?} spent {spent} tokens this hour, its tokens_per_hour of {budget}; its budget resets at {resets}"
    )]
    HourSpent {
        /// The caller.
        principal: String,
        /// Its tokens this hour.
        spent: u64,
        /// Its tokens_per_hour.
        budget: u64,
        /// When the next hour begins (RFC 3339).
        resets: String,
    },
    /// The run's deadline passed while it waited for a slot.
    #[error("the run waited {} for a run slot until its deadline; it did not start", humantime::format_duration(*.0))]
    SlotWait(std::time::Duration),
    /// The caller's deadline passed while its run waited for the thread.
    #[error("the run waited for thread {0:?} until its deadline; it did not start")]
    ThreadWait(String),
    /// A run id was named again with another request than its run's.
    #[error(
        "run id {run_id:?} names a run started with another request (its {} differ): a retry repeats the request; choose a new run id for a new one",
        parts.join(", ")
    )]
    RunIdReused {
        /// The run.
        run_id: String,
        /// The parts of the request that differ.
        parts: Vec<String>,
    },
    /// The caller has as many webhooks as it may.
    #[error("principal {principal:?} has {max} webhooks, as many as it may (--max-webhooks); delete one first")]
    TooManyWebhooks {
        /// The caller.
        principal: String,
        /// Its bound.
        max: usize,
    },
    /// A decision on calls waiting for approval was refused.
    #[error(transparent)]
    Decide(#[from] crate::domain::approval::DecideError),
}

impl From<Error> for tonic::Status {
    fn from(error: Error) -> Self {
        use crate::domain::ports::LogError;
        let message = error.to_string();
        match error {
            Error::InvalidArgument(_) | Error::RunIdReused { .. } => Self::invalid_argument(message),
            Error::AlreadyRunning(_) => Self::already_exists(message),
            Error::Busy(_) | Error::CallerBusy { .. } | Error::AttachBusy(_) | Error::InboxFull { .. } => {
                Self::resource_exhausted(message)
            }
            Error::NotNow(_) => Self::failed_precondition(message),
            Error::ThreadBusy { .. } => Self::aborted(message),
            Error::ThreadQueueFull { .. } | Error::TooManyWebhooks { .. } => Self::resource_exhausted(message),
            Error::ThreadWait(_) | Error::SlotWait(_) => Self::deadline_exceeded(message),
            Error::QueueFull { .. } | Error::HourSpent { .. } => Self::resource_exhausted(message),
            Error::PermissionDenied(_) => Self::permission_denied(message),
            Error::NotFound(_) => Self::not_found(message),
            Error::Draining
            | Error::Moved { .. }
            | Error::LeftReplica { .. }
            | Error::Call(_)
            | Error::RunElsewhere(_)
            | Error::NoToolRunner(_)
            | Error::Serve(_)
            | Error::Listen { .. }
            | Error::Dependency(_)
            | Error::Store(_)
            | Error::Topic(_)
            | Error::Security(_) => Self::unavailable(message),
            Error::Log(LogError::Trimmed { .. }) => Self::out_of_range(message),
            Error::Log(LogError::Lost { .. }) => Self::data_loss(message),
            Error::Log(LogError::Unavailable { .. }) => Self::unavailable(message),
            Error::Config(_) | Error::Limit(_) => Self::failed_precondition(message),
            Error::Contract { .. } => Self::internal(message),
            Error::Decide(e) => decide_status(&e, message),
        }
    }
}

/// A refused decision's code: who may not decide, what does not wait, what was decided already.
fn decide_status(error: &crate::domain::approval::DecideError, message: String) -> tonic::Status {
    use crate::domain::approval::DecideError as D;
    match error {
        D::NotFound(_) => tonic::Status::not_found(message),
        D::NotAllowed { .. } => tonic::Status::permission_denied(message),
        D::AlreadyDecided { .. } | D::NotPending { .. } | D::Expired { .. } | D::OtherRound { .. } => {
            tonic::Status::failed_precondition(message)
        }
        D::Invalid(_) => tonic::Status::invalid_argument(message),
        D::Unavailable(_) => tonic::Status::unavailable(message),
    }
}

impl shared::runtime::Failure for Error {
    fn is_usage(&self) -> bool {
        use shared::serving::SecurityError;
        matches!(
            self,
            Error::Config(_) | Error::Limit(_) | Error::Security(SecurityError::Tls(_) | SecurityError::Tokens(_))
        )
    }
}

impl From<shared::telemetry::TelemetryError> for Error {
    fn from(error: shared::telemetry::TelemetryError) -> Self {
        Error::Config(error.to_string())
    }
}

impl From<shared::shutdown::StartupError> for Error {
    fn from(error: shared::shutdown::StartupError) -> Self {
        match error {
            shared::shutdown::StartupError::Signals(_) => Error::Config(error.to_string()),
            shared::shutdown::StartupError::Listen { address, flag, source } => Error::Listen { address, flag, source },
        }
    }
}
