//! The relay's floor as the paced measurement calls it: the `relay_floor` binary (built beside
//! `bench`) started against the stand-in model, its address read from its first line.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tonic::transport::Channel;

use crate::stack::Target;

/// A `relay_floor` process serving.
pub(crate) struct Floor {
    child: Child,
    pid: u32,
    address: String,
    channels: Vec<Channel>,
}

impl Floor {
    /// Starts `relay_floor` (beside this binary) against the model at `model_url`, with
    /// `channels` client channels to it.
    pub(crate) async fn start(model_url: &str, channels: usize) -> anyhow::Result<Self> {
        let bin = std::env::current_exe()?.with_file_name("relay_floor");
        anyhow::ensure!(
            bin.exists(),
            "{} is not built: cargo build --release -p bench --bins",
            bin.display()
        );
        let mut child = Command::new(&bin)
            .args(["--listen", "127.0.0.1:0", "--model-url", model_url])
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let pid = child
            .id()
            .ok_or_else(|| anyhow::anyhow!("relay_floor exited at once"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("relay_floor has no stdout"))?;
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .map_err(|_| anyhow::anyhow!("relay_floor did not say where it listens within 30 s"))??
            .ok_or_else(|| anyhow::anyhow!("relay_floor exited before it listened"))?;
        let address = first
            .strip_prefix("listening on ")
            .ok_or_else(|| anyhow::anyhow!("relay_floor said {first:?}"))?
            .to_owned();
        let channels = (0..channels.max(1))
            .map(|_| crate::stack::channel(std::slice::from_ref(&address)))
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            child,
            pid,
            address,
            channels,
        })
    }

    /// The floor as a measurement calls it.
    pub(crate) fn target(&self) -> Target<'_> {
        Target {
            pid: self.pid,
            address: &self.address,
            channels: &self.channels,
        }
    }

    /// Stops the floor.
    pub(crate) async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}
