//! The watchdog ends a hung test binary with a clear message instead of letting it hold the suite.

use std::process::Command;
use std::time::{Duration, Instant};

/// Set on the child run of this binary: the test below then plays the hung test.
const PROBE: &str = "TESTKIT_WATCHDOG_PROBE";

#[test]
fn a_binary_past_its_limit_is_ended_with_a_message() -> anyhow::Result<()> {
    if std::env::var_os(PROBE).is_some() {
        testkit::arm_watchdog();
        // Stays: the probe must outlive the watchdog's limit, which is what is under test.
        std::thread::sleep(Duration::from_secs(60));
        return Ok(());
    }
    let started = Instant::now();
    let output = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "a_binary_past_its_limit_is_ended_with_a_message",
            "--nocapture",
        ])
        .env(PROBE, "1")
        .env("TESTKIT_BINARY_LIMIT_SECS", "1")
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(124), "{stderr}");
    assert!(stderr.contains("past its limit: a test is hung"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "ended by the watchdog, not the sleep"
    );
    Ok(())
}
