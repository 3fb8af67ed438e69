//! A `nats-server -js` for the tests that need one (`./scripts/test` installs the server when
//! missing): on a loopback port with its own store directory, stopped and started again at will.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

/// A `nats-server -js` on a loopback port with its own store directory.
pub struct Nats {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    /// `--user` and `--pass` the server requires, if any.
    user: Option<(String, String)>,
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
    /// A server without authentication, JetStream on, in a fresh store directory.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(None).await
    }

    /// A server that requires this user and password (in [`Nats::url`]).
    pub async fn start_authenticated(user: &str, password: &str) -> anyhow::Result<Self> {
        Self::start_with(Some((user.to_owned(), password.to_owned()))).await
    }

    /// The port is one the system had free a moment before; another process may take it in
    /// between (many tests start servers at once), so a server that could not listen on it is
    /// started again on another, a few times.
    async fn start_with(user: Option<(String, String)>) -> anyhow::Result<Self> {
        const ATTEMPTS: usize = 3;
        crate::arm_watchdog();
        let tmp = tempfile::tempdir()?;
        let mut nats = Self {
            child: None,
            port: 0,
            dir: tmp.path().to_owned(),
            user,
            _tmp: Some(tmp),
        };
        for attempt in 1..=ATTEMPTS {
            nats.port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            match nats.restart().await {
                Ok(()) => return Ok(nats),
                Err(e) if attempt < ATTEMPTS && nats.exited() => {
                    eprintln!("nats-server exited on port {} ({e}); trying another port", nats.port);
                }
                Err(e) => return Err(e),
            }
        }
        anyhow::bail!("nats-server did not start in {ATTEMPTS} attempts")
    }

    /// Whether the server's process has ended.
    fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|child| matches!(child.try_wait(), Ok(Some(_))))
    }

    /// The server's process id, while it runs (to read its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// `nats://127.0.0.1:port`, with `user:password@` when the server requires them.
    pub fn url(&self) -> String {
        match &self.user {
            Some((user, password)) => format!("nats://{user}:{password}@127.0.0.1:{}", self.port),
            None => format!("nats://127.0.0.1:{}", self.port),
        }
    }

    /// (Re)starts the server on the same port and store.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        let child = Command::new(nats_server_bin()?)
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string(), "-sd"])
            .arg(&self.dir)
            .args(
                self.user
                    .iter()
                    .flat_map(|(user, password)| ["--user", user, "--pass", password]),
            )
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.dir.join("nats-server.log"))?)
            .kill_on_drop(true)
            .spawn()?;
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if self.exited() {
                let log = std::fs::read_to_string(self.dir.join("nats-server.log")).unwrap_or_default();
                anyhow::bail!("nats-server exited at its start: {}", log.trim());
            }
            // The server listens for clients only once JetStream is up.
            // async-nats takes no credentials from a URL: they are options.
            let options = match &self.user {
                Some((user, password)) => {
                    async_nats::ConnectOptions::with_user_and_password(user.clone(), password.clone())
                }
                None => async_nats::ConnectOptions::new(),
            };
            let address = format!("nats://127.0.0.1:{}", self.port);
            let last_error = match options.connect(address).await {
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

    /// Stops the server (its store directory stays, so it can start again with its data).
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().await?;
            child.wait().await?;
        }
        Ok(())
    }
}
