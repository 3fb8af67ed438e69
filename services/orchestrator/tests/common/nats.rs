//! A `nats-server -js` for the tests that need one (`./scripts/test` installs the server when
//! missing): on a loopback port with its own store directory, stopped and started again at will.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

/// A `nats-server -js` on a loopback port with its own store directory.
pub(crate) struct Nats {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

fn nats_server_bin() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("nats-server"))
        .find(|p| p.exists())
        .ok_or_else(|| anyhow::anyhow!("nats-server is not installed: run ./scripts/test, which installs it"))
}

impl Nats {
    pub(crate) async fn start() -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let tmp = tempfile::tempdir()?;
        let mut nats = Self {
            child: None,
            port,
            dir: tmp.path().to_owned(),
            _tmp: Some(tmp),
        };
        nats.restart().await?;
        Ok(nats)
    }

    pub(crate) fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the server on the same port and store.
    pub(crate) async fn restart(&mut self) -> anyhow::Result<()> {
        let child = Command::new(nats_server_bin()?)
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            // The server listens for clients only once JetStream is up.
            let last_error = match async_nats::connect(self.url()).await {
                Ok(client) => match client.flush().await {
                    Ok(()) => return Ok(()),
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "nats-server did not start: {last_error}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(crate) async fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().await?;
            child.wait().await?;
        }
        Ok(())
    }
}
