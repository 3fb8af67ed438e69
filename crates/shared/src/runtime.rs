//! The Tokio runtime both binaries run on. Its one environment knob, `TOKIO_WORKER_THREADS`, is
//! checked here first: Tokio itself panics on a bad value, the binaries refuse it with a message
//! and exit code 2 like any other bad setting.

use std::ffi::OsStr;
use std::future::Future;
use std::process::ExitCode;

/// The environment variable Tokio reads for its number of worker threads.
pub const WORKER_THREADS_ENV: &str = "TOKIO_WORKER_THREADS";

/// The most worker threads accepted.
pub const WORKER_THREADS_CAP: usize = 1024;

/// Builds the multi-threaded runtime: one worker per CPU the process may use, or
/// `TOKIO_WORKER_THREADS`.
pub fn build() -> Result<tokio::runtime::Runtime, String> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = worker_threads(std::env::var_os(WORKER_THREADS_ENV).as_deref())? {
        builder.worker_threads(threads);
    }
    builder
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))
}

/// Runs a binary's `main` on the runtime; a runtime that cannot be built is reported as
/// `{binary}: …` with exit code 2.
pub fn block_on(binary: &str, main: impl Future<Output = ExitCode>) -> ExitCode {
    match build() {
        Ok(runtime) => runtime.block_on(main),
        Err(e) => {
            eprintln!("{binary}: {e}");
            ExitCode::from(2)
        }
    }
}

/// A background task that ends with its owner: aborted when this handle is dropped.
pub struct AbortOnDrop(pub tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What kind of failure ends a binary, for its exit code.
pub trait Failure: std::fmt::Display {
    /// Whether the user gave something unusable (a flag, a setting, a file): exit code 2, as
    /// for a bad flag; any other failure exits 1.
    fn is_usage(&self) -> bool;
}

/// The exit code of a binary's command, printing a failure as `{binary}: {error}`: 0 when the
/// command succeeded, 1 when it ran but did not succeed (`Ok(false)`) or failed at run time, 2
/// when it was given something unusable.
pub fn exit_code<E: Failure>(binary: &str, outcome: Result<bool, E>) -> ExitCode {
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("{binary}: {e}");
            if e.is_usage() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// The worker-thread count `value` asks for (`None`: unset, Tokio's default).
pub fn worker_threads(value: Option<&OsStr>) -> Result<Option<usize>, String> {
    let Some(value) = value else {
        return Ok(None);
    };
    let text = value.to_string_lossy();
    match text.trim().parse::<usize>() {
        Ok(n) if (1..=WORKER_THREADS_CAP).contains(&n) => Ok(Some(n)),
        _ => Err(format!(
            "{WORKER_THREADS_ENV}={text:?} must be a whole number from 1 to {WORKER_THREADS_CAP}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_threads_from_one_to_the_cap() {
        let parse = |v: &str| worker_threads(Some(OsStr::new(v)));
        assert_eq!(worker_threads(None), Ok(None));
        assert_eq!(parse("1"), Ok(Some(1)));
        assert_eq!(parse(" 4 "), Ok(Some(4)));
        assert_eq!(parse("1024"), Ok(Some(WORKER_THREADS_CAP)));
        for bad in ["0", "1025", "-1", "two", ""] {
            let error = parse(bad).expect_err(bad);
            assert!(error.contains("from 1 to 1024"), "{error}");
        }
    }
}
