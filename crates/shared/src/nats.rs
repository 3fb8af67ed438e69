//! How both services open a NATS connection: the address's credentials (held apart from it, as
//! [`NatsUrl`] keeps them: the client logs its addresses), a credentials file, TLS. Each service
//! adds its own timeouts and connects to [`NatsUrl::seeds`].

use std::path::Path;

use crate::secrets::{NatsAuth, NatsUrl};

/// What reaches NATS besides the address (each service's `--nats-*` settings).
#[derive(Debug, Clone, Copy)]
pub struct Access<'a> {
    /// Require TLS.
    pub tls_required: bool,
    /// A credentials file (.creds).
    pub credentials: Option<&'a Path>,
    /// Extra root certificates (PEM).
    pub ca_file: Option<&'a Path>,
}

/// The connect options of client `name` for `url`; `Err` names the credentials file it could not
/// read.
pub async fn options(url: &NatsUrl, name: &str, access: Access<'_>) -> Result<async_nats::ConnectOptions, String> {
    let mut options = async_nats::ConnectOptions::new()
        .name(name)
        .require_tls(access.tls_required);
    options = match url.auth() {
        Some(NatsAuth::UserPassword(user, password)) => {
            options.user_and_password(user.clone(), password.expose().to_owned())
        }
        Some(NatsAuth::Token(token)) => options.token(token.expose().to_owned()),
        None => options,
    };
    if let Some(creds) = access.credentials {
        options = options
            .credentials_file(creds)
            .await
            .map_err(|e| format!("--nats-credentials {}: {e}", creds.display()))?;
    }
    if let Some(ca) = access.ca_file {
        options = options.add_root_certificates(ca.to_owned());
    }
    Ok(options)
}
