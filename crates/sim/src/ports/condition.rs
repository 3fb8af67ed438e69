//! What a fault does to one process: a replica (or a tool-runner) is up, paused (SIGSTOP: it
//! sends and hears nothing until it resumes, while time runs), cut off from the store (its store
//! requests fail after their timeout; the model and the runners still answer), or dead
//! (SIGKILL: it never sends or hears anything again).
//!
//! A replica's condition also holds its [`Process`]: while it is paused none of its tasks is polled
//! (its timers fire together when it resumes), and once it is dead its tasks are dropped.

use std::sync::Arc;

use shared::tasks::{Process, ProcessState};
use tokio::sync::watch;

/// One process's state, as the fault plan sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Running.
    Up,
    /// Paused: every request it would send or answer it would hear waits.
    Paused,
    /// Cut off from the store (a network partition): store requests fail.
    CutOff,
    /// Killed: nothing it does reaches anyone, ever.
    Dead,
}

/// A process's condition: its requests pass, wait or fail according to its [`Mode`].
#[derive(Clone)]
pub struct Condition(Arc<watch::Sender<Mode>>, Process);

impl Default for Condition {
    fn default() -> Self {
        Self(Arc::new(watch::Sender::new(Mode::Up)), Process::default())
    }
}

impl Condition {
    /// Sets the process's mode (a dead process stays dead).
    pub fn set(&self, mode: Mode) {
        self.0.send_if_modified(|now| {
            let change = *now != Dead && *now != mode;
            if change {
                *now = mode;
            }
            change
        });
        self.1.set(match self.mode() {
            Mode::Up | Mode::CutOff => ProcessState::Running,
            Mode::Paused => ProcessState::Stopped,
            Mode::Dead => ProcessState::Killed,
        });
    }

    /// The process whose tasks stop and die with this condition.
    pub fn process(&self) -> Process {
        self.1.clone()
    }

    /// The mode now.
    pub fn mode(&self) -> Mode {
        *self.0.borrow()
    }

    /// Waits while the process is paused (forever once it is dead); whether it reaches the
    /// store now.
    pub async fn pass(&self) -> bool {
        let mut rx = self.0.subscribe();
        loop {
            match *rx.borrow_and_update() {
                Mode::Up => return true,
                Mode::CutOff => return false,
                Mode::Paused | Mode::Dead => {}
            }
            if rx.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Waits while the process is paused or dead (the model and the runners answer one that
    /// is cut off from the store).
    pub async fn running(&self) {
        let mut rx = self.0.subscribe();
        loop {
            if matches!(*rx.borrow_and_update(), Mode::Up | Mode::CutOff) {
                return;
            }
            if rx.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

use Mode::Dead;
