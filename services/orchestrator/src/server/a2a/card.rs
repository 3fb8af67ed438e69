//! Agent cards: what a caller learns of an A2A endpoint before it calls it. The server's own card
//! (runs as the request spells them) and one per named agent (its name, description, version and
//! tools as a skill); each names its endpoint, the JSON-RPC binding of A2A 1.0, streaming, and
//! the credentials the server takes (a bearer token when it authenticates).

use proto::lf::a2a::v1 as a2a;
use serde_json::Value;
use shared::auth::Principal;

use super::A2a;
use crate::agents::Agent;

/// The protocol version this server speaks.
pub(super) const PROTOCOL_VERSION: &str = "1.0";

/// The card of the server's endpoint (`/`).
pub(super) fn of_server(server: &A2a) -> Value {
    let skill = a2a::AgentSkill {
        id: "tool-loop".into(),
        name: "Tool loop".into(),
        description: "Runs the request's conversation on the model with the server's tools until it answers".into(),
        tags: vec!["tools".into(), "llm".into()],
        ..Default::default()
    };
    let card = card(
        server,
        "orchestrator",
        "Runs LLM tool loops: the model calls the server's tools, concurrently, until it answers",
        env!("CARGO_PKG_VERSION"),
        String::new(),
        skill,
    );
    as_json(&card)
}

/// The card of named agent `name`, when `reader` may use it (`None`: a caller without
/// credentials, shown agents open to every caller only).
pub(super) fn of_agent(server: &A2a, name: &str, reader: Option<&Principal>) -> Option<Value> {
    let agents = &server.core.agents;
    let agent: std::sync::Arc<Agent> = match reader {
        Some(reader) => agents.for_caller(name, reader)?,
        None => agents
            .for_caller(name, &Principal::anonymous())
            .filter(|a| a.definition.principals.is_none())?,
    };
    let definition = &agent.definition;
    let skill = a2a::AgentSkill {
        id: definition.name.clone(),
        name: definition.name.clone(),
        description: match definition.description.as_str() {
            "" => format!("The agent {}", definition.name),
            text => text.to_owned(),
        },
        tags: definition.tools.clone().unwrap_or_default(),
        ..Default::default()
    };
    let card = card(
        server,
        &definition.name,
        &skill.description.clone(),
        &agent.version,
        format!("/agents/{}", definition.name),
        skill,
    );
    Some(as_json(&card))
}

fn card(
    server: &A2a,
    name: &str,
    description: &str,
    version: &str,
    path: String,
    skill: a2a::AgentSkill,
) -> a2a::AgentCard {
    let tenant = path.strip_prefix("/agents/").unwrap_or_default();
    let mut card = a2a::AgentCard {
        name: name.into(),
        description: description.into(),
        supported_interfaces: vec![
            a2a::AgentInterface {
                url: format!("{}{path}", server.base_url),
                protocol_binding: "JSONRPC".into(),
                protocol_version: PROTOCOL_VERSION.into(),
                ..Default::default()
            },
            // The gRPC binding, on the same port, names a named agent by its tenant.
            a2a::AgentInterface {
                url: server.base_url.clone(),
                protocol_binding: "GRPC".into(),
                protocol_version: PROTOCOL_VERSION.into(),
                tenant: tenant.to_owned(),
            },
        ],
        version: version.into(),
        capabilities: Some(a2a::AgentCapabilities {
            streaming: Some(true),
            push_notifications: Some(true),
            extended_agent_card: Some(false),
            ..Default::default()
        }),
        default_input_modes: vec!["text/plain".into(), "application/json".into()],
        default_output_modes: vec!["text/plain".into()],
        skills: vec![skill],
        ..Default::default()
    };
    if server.auth.is_some() {
        let bearer = a2a::SecurityScheme {
            scheme: Some(a2a::security_scheme::Scheme::HttpAuthSecurityScheme(
                a2a::HttpAuthSecurityScheme {
                    description: "A token of the server's tokens file, as `Authorization: Bearer <token>`".into(),
                    scheme: "Bearer".into(),
                    ..Default::default()
                },
            )),
        };
        card.security_schemes.insert("bearer".into(), bearer);
        card.security_requirements.push(a2a::SecurityRequirement {
            schemes: [("bearer".to_owned(), a2a::StringList::default())].into(),
        });
    }
    card
}

fn as_json(card: &a2a::AgentCard) -> Value {
    crate::wire::json::to_sparse_json(card, "lf.a2a.v1.AgentCard").unwrap_or_else(|e| serde_json::json!({ "error": e }))
}
