//! Waiting for the process's stop signals, for the graceful drain both services perform.

use std::future::Future;

/// Installs SIGTERM (Kubernetes stopping a pod) and SIGINT (Ctrl-C) handlers and returns a future
/// that resolves with the name of the first one received. Installing happens now, so a failure is
/// a startup error rather than a service that cannot drain.
pub fn stop_signal() -> std::io::Result<impl Future<Output = &'static str> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    })
}
