//! The gRPC adapter of `orchestrator.v1.Orchestrator`: the handlers ([`service`]) turn requests
//! into domain values ([`convert`]: `TryFrom`, `INVALID_ARGUMENT` naming the field), call the
//! server's operations (`crate::server::Core`), and turn the domain's answers and events back
//! into proto messages. A new RPC is a handler here, a conversion in `convert/`, and an
//! operation on `Core`.

pub(crate) mod convert;
mod service;

pub(crate) use service::OrchestratorService;
