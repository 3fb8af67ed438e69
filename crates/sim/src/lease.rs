//! A replica's hold on a run as the simulation keeps it: the rules of
//! `orchestrator::domain::Ownership` on the simulation's clock (virtual milliseconds). The owner
//! acts until its last confirmed write's send time plus the lease less the margin; once stopped it
//! stays stopped; a run that ended here may still log. A test holds this against the real
//! `Ownership` on tokio's paused clock.

/// See the module docs.
#[derive(Debug, Clone)]
pub struct Lease {
    length: u64,
    margin: u64,
    /// When the write the store confirmed last was sent.
    confirmed: u64,
    stopped: bool,
    ended: bool,
    /// The claim's number.
    pub epoch: u64,
    /// No tool call leaves before then (a takeover's fence grace).
    pub calls_from: u64,
}

impl Lease {
    /// A lease of `length` less `margin`, running from `since` (the claim's send), in `epoch`.
    pub fn new(length: u64, margin: u64, since: u64, epoch: u64) -> Self {
        Self {
            length,
            margin,
            confirmed: since,
            stopped: false,
            ended: false,
            epoch,
            calls_from: 0,
        }
    }

    /// The store confirmed a write sent at `sent` (never backwards).
    pub fn confirmed(&mut self, sent: u64) {
        self.confirmed = self.confirmed.max(sent);
    }

    /// Whether the owner may act at `now`; a lease found run out stops it.
    pub fn holds(&mut self, now: u64) -> bool {
        if !self.stopped && now >= self.confirmed + self.length - self.margin {
            self.stopped = true;
        }
        !self.stopped
    }

    /// Whether the run's events may still leave: it acts, or it ended here.
    pub fn may_log(&mut self, now: u64) -> bool {
        self.ended || self.holds(now)
    }

    /// Stops acting for the run (for good).
    pub fn stop(&mut self) {
        self.stopped = true;
    }

    /// The run's end is stored: its last events may still leave.
    pub fn end(&mut self) {
        self.ended = true;
    }

    /// Whether the run's end is stored.
    pub fn ended(&self) -> bool {
        self.ended
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use orchestrator::domain::{LeaseTerms, Ownership};

    use super::Lease;

    /// The simulation's lease stops exactly when the services' `Ownership` does, whatever the
    /// confirmations (in order or not) and however long a pause, on tokio's paused clock.
    #[tokio::test(start_paused = true)]
    async fn the_simulated_lease_stops_when_the_real_ownership_does() {
        let (length, margin) = (3000u64, 1000u64);
        let terms = LeaseTerms {
            length: Duration::from_millis(length),
            margin: Duration::from_millis(margin),
            fence_grace: Duration::ZERO,
        };
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..200 {
            let start = tokio::time::Instant::now();
            let real = Ownership::new(Some(terms), start);
            let mut simulated = Lease::new(length, margin, 0, 1);
            let mut now = 0u64;
            loop {
                let step = rng.u64(0..1500);
                tokio::time::advance(Duration::from_millis(step)).await;
                now += step;
                if rng.bool() {
                    let sent = now.saturating_sub(rng.u64(0..800));
                    real.confirmed(start + Duration::from_millis(sent));
                    simulated.confirmed(sent);
                }
                let (a, b) = (real.holds(), simulated.holds(now));
                assert_eq!(a, b, "at {now} ms");
                if !a {
                    break;
                }
            }
        }
    }
}
