//! Reading a process's CPU time and memory from `/proc` (Linux).

use std::time::Duration;

/// User + system CPU time of `pid` so far.
pub(crate) fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the file, 12 and 13 after the name.
    let ticks: u64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    let per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100)
        .max(1) as u64;
    Ok(Duration::from_nanos(ticks.saturating_mul(1_000_000_000) / per_second))
}

/// Resident memory of `pid` now, in bytes.
pub(crate) fn rss(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Ok(kib * 1024)
}

/// Samples `rss(pid)` every 20 ms until stopped; returns the peak.
pub(crate) struct PeakRss {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<u64>,
}

impl PeakRss {
    /// Starts sampling.
    pub(crate) fn start(pid: u32) -> Self {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut peak = 0;
            loop {
                peak = peak.max(rss(pid).unwrap_or(0));
                tokio::select! {
                    _ = &mut stopped => return peak,
                    () = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
            }
        });
        Self { stop, task }
    }

    /// Stops and returns the peak.
    pub(crate) async fn finish(self) -> u64 {
        let _ = self.stop.send(());
        self.task.await.unwrap_or(0)
    }
}

/// CPU time `pid`'s live threads have been scheduled for, in nanoseconds from
/// `/proc/<pid>/task/*/schedstat`: precise where [`cpu_time`] counts 10 ms ticks. Threads that
/// have exited are not counted, so compare two readings over a stretch where the process keeps its
/// threads (a tokio runtime's workers do).
pub(crate) fn scheduled_time(pid: u32) -> anyhow::Result<Duration> {
    let mut total = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = task?.path().join("schedstat");
        // A thread that ends between the listing and the read is simply not counted.
        let Ok(stat) = std::fs::read_to_string(path) else {
            continue;
        };
        total += stat
            .split_whitespace()
            .next()
            .and_then(|ns| ns.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Ok(Duration::from_nanos(total))
}

/// Times `pid`'s live threads were switched in, from `/proc/<pid>/task/*/schedstat` (its third
/// field: timeslices run): a wake-up each, so a relay's cost in wake-ups. As with
/// [`scheduled_time`], compare two readings over a stretch where the process keeps its threads.
pub(crate) fn switches(pid: u32) -> anyhow::Result<u64> {
    let mut total = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Ok(stat) = std::fs::read_to_string(task?.path().join("schedstat")) else {
            continue;
        };
        total += stat
            .split_whitespace()
            .nth(2)
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Ok(total)
}
