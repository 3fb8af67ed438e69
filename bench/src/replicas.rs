//! `bench --soak N --soak-replica-faults`: the soak's system under test as a fleet of orchestrator
//! replicas sharing the NATS store, each on a fixed address (as behind a Kubernetes Service) and
//! reaching NATS through a proxy of its own that can cut it off, and the replica faults: every
//! `--soak-replica-faults` one replica in turn is SIGKILLed, drained (SIGTERM), cut off from NATS
//! while it keeps serving (a partition), or paused (SIGSTOP), in that order; a killed or drained
//! one is replaced by a new one on its address, a cut-off or paused one comes back after
//! [`OUTAGE`], past its lease. The soak's runs go on meanwhile; their callers follow them across
//! replicas.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use mock_llm::{MockLlm, Scenarios};
use proto::orchestrator::v1 as pb;
use tonic::transport::Channel;

use crate::stack::{self, Launch, Process};

/// Flags of every replica: a short lease, so a killed replica's runs move within seconds.
pub(crate) const FLAGS: &[&str] = &["--run-store-lease", "2s", "--hand-over-grace", "5s"];

/// How long a drained replica may take to exit.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// How long a replica stays cut off from NATS or paused: a lease and a half (see [`FLAGS`]), so
/// its runs are taken over meanwhile and it must stop acting for them on its own.
pub(crate) const OUTAGE: Duration = Duration::from_secs(3);

/// What one replica fault does, in the order they come.
#[derive(Debug, Clone, Copy)]
enum Fault {
    Kill,
    Drain,
    CutOff,
    Pause,
}

impl Fault {
    const CYCLE: [Self; 4] = [Self::Kill, Self::Drain, Self::CutOff, Self::Pause];
}

/// The replicas.
pub(crate) struct Replicas {
    _mock: MockLlm,
    /// Each slot's launch (its own NATS proxy in its flags).
    launches: Vec<Launch>,
    /// Each slot's way to NATS.
    proxies: Vec<testkit::proxy::CutProxy>,
    /// One process per address; a slot is empty while its replica is replaced.
    slots: Vec<tokio::sync::Mutex<Option<Process>>>,
    addresses: Vec<String>,
    channels: Vec<Channel>,
    pub kills: AtomicU64,
    pub drains: AtomicU64,
    pub partitions: AtomicU64,
    pub pauses: AtomicU64,
}

impl Replicas {
    /// Starts the model, a tool-runner and `count` replicas with `extra` flags, each with the
    /// NATS store at `nats` (`host:port`) through a proxy of its own; callers' streams are spread
    /// over `channels` channels to all of them.
    pub(crate) async fn start(
        bin: &std::path::Path,
        scenarios: Scenarios,
        count: usize,
        channels: usize,
        extra: &[String],
        nats: std::net::SocketAddr,
    ) -> anyhow::Result<Self> {
        let (mock, runner) = stack::model_and_runner(scenarios, Some(format!("nats://{nats}"))).await?;
        let mut slots = Vec::with_capacity(count);
        let mut addresses = Vec::with_capacity(count);
        let (mut launches, mut proxies) = (Vec::with_capacity(count), Vec::with_capacity(count));
        for _ in 0..count {
            let proxy = testkit::proxy::CutProxy::start(nats).await?;
            let launch = Launch {
                bin: bin.to_owned(),
                model_url: mock.base_url(),
                runner: runner.clone(),
                otlp: None,
                rust_log: "info".to_owned(),
                extra: extra
                    .iter()
                    .cloned()
                    .chain(FLAGS.iter().map(|f| (*f).to_owned()))
                    .chain(["--run-store".to_owned(), format!("nats://{}", proxy.addr())])
                    .collect(),
                env: Vec::new(),
            };
            let process = stack::spawn(&launch, "127.0.0.1:0").await?;
            addresses.push(process.address.clone());
            slots.push(tokio::sync::Mutex::new(Some(process)));
            launches.push(launch);
            proxies.push(proxy);
        }
        let channels = (0..channels.max(1))
            .map(|_| stack::channel(&addresses))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self {
            _mock: mock,
            launches,
            proxies,
            slots,
            addresses,
            channels,
            kills: AtomicU64::new(0),
            drains: AtomicU64::new(0),
            partitions: AtomicU64::new(0),
            pauses: AtomicU64::new(0),
        })
    }

    /// A client on the `i`-th channel (round robin); each reaches every replica serving.
    pub(crate) fn client(&self, i: usize) -> pb::orchestrator_client::OrchestratorClient<Channel> {
        pb::orchestrator_client::OrchestratorClient::new(self.channels[i % self.channels.len()].clone())
    }

    /// The `/metrics` addresses of the replicas serving now.
    pub(crate) async fn metrics(&self) -> Vec<String> {
        let mut all = Vec::new();
        for slot in &self.slots {
            if let Some(metrics) = slot.lock().await.as_ref().and_then(|p| p.metrics.clone()) {
                all.push(metrics);
            }
        }
        all
    }

    /// Injects replica faults until `done` resolves: every `every`, the next replica goes
    /// through the next fault of [`Fault::CYCLE`].
    pub(crate) async fn inject_faults(&self, every: Duration, done: impl Future<Output = ()>) -> anyhow::Result<()> {
        tokio::pin!(done);
        for fault in 0.. {
            tokio::select! {
                () = &mut done => return Ok(()),
                () = tokio::time::sleep(every) => {}
            }
            let slot = fault % self.slots.len();
            match Fault::CYCLE[fault % Fault::CYCLE.len()] {
                Fault::Kill => self.replace(slot, true).await?,
                Fault::Drain => self.replace(slot, false).await?,
                Fault::CutOff => self.cut_off(slot).await,
                Fault::Pause => self.pause(slot).await?,
            }
        }
        Ok(())
    }

    /// Cuts replica `slot` off from NATS for [`OUTAGE`] while it keeps serving its callers.
    async fn cut_off(&self, slot: usize) {
        eprintln!("soak: replica {slot} cut off from NATS for {OUTAGE:?}");
        self.proxies[slot].cut();
        tokio::time::sleep(OUTAGE).await;
        self.proxies[slot].heal();
        self.partitions.fetch_add(1, Ordering::Relaxed);
    }

    /// Pauses replica `slot` (SIGSTOP) for [`OUTAGE`], then lets it go on (SIGCONT).
    async fn pause(&self, slot: usize) -> anyhow::Result<()> {
        use nix::sys::signal::{Signal, kill};
        let held = self.slots[slot].lock().await;
        let Some(pid) = held.as_ref().and_then(|p| i32::try_from(p.pid).ok()) else {
            return Ok(());
        };
        let pid = nix::unistd::Pid::from_raw(pid);
        eprintln!("soak: replica {slot} paused for {OUTAGE:?}");
        kill(pid, Signal::SIGSTOP)?;
        tokio::time::sleep(OUTAGE).await;
        kill(pid, Signal::SIGCONT)?;
        self.pauses.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Kills (or drains) replica `slot` and starts a new one on its address.
    async fn replace(&self, slot: usize, kill: bool) -> anyhow::Result<()> {
        let mut held = self.slots[slot].lock().await;
        if let Some(mut process) = held.take() {
            if kill {
                process.child.kill().await?;
                self.kills.fetch_add(1, Ordering::Relaxed);
            } else {
                let Some(status) = drain(&mut process).await? else {
                    let logs: Vec<String> = shared::sync::lock(&process.logs).iter().cloned().collect();
                    anyhow::bail!(
                        "replica {slot} did not exit within {DRAIN_LIMIT:?} of SIGTERM; its last log lines:\n{}",
                        logs.join("\n")
                    );
                };
                anyhow::ensure!(status.success(), "a drained replica exited with {status}");
                self.drains.fetch_add(1, Ordering::Relaxed);
            }
        }
        eprintln!(
            "soak: replica {slot} {}; starting a new one",
            if kill { "killed" } else { "drained" }
        );
        *held = Some(self.respawn(slot).await?);
        Ok(())
    }

    /// A new replica on `slot`'s address; tried a few times (the address may take a moment to
    /// be free again).
    async fn respawn(&self, slot: usize) -> anyhow::Result<Process> {
        let mut attempt = 0;
        loop {
            match stack::spawn(&self.launches[slot], &self.addresses[slot]).await {
                Ok(process) => return Ok(process),
                Err(e) if attempt < 5 => {
                    attempt += 1;
                    eprintln!("soak: replica {slot} did not start ({e}); trying again");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => return Err(e.context(format!("replica {slot} on {}", self.addresses[slot]))),
            }
        }
    }

    /// Drains every replica.
    pub(crate) async fn stop(&self) {
        for slot in &self.slots {
            if let Some(mut process) = slot.lock().await.take()
                && !matches!(drain(&mut process).await, Ok(Some(_)))
            {
                let _ = process.child.kill().await;
            }
        }
    }
}

/// SIGTERM, then its exit status; `None` when it did not exit within [`DRAIN_LIMIT`].
async fn drain(process: &mut Process) -> std::io::Result<Option<std::process::ExitStatus>> {
    if let Ok(pid) = i32::try_from(process.pid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
    }
    match tokio::time::timeout(DRAIN_LIMIT, process.child.wait()).await {
        Ok(status) => status.map(Some),
        Err(_) => Ok(None),
    }
}
