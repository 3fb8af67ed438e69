//! Spawning a service's tasks so that a simulation can stop and kill them as the kernel would.
//!
//! In a deployment a task is a task: [`spawn`] is `tokio::spawn`. Where a simulation runs several
//! replicas in one runtime, each replica is a [`Process`], and every task it spawns through
//! [`spawn`] (and whatever the simulation runs [`within`] it) belongs to it: while the process is
//! stopped (SIGSTOP) none of its tasks is polled — its timers pass unheard and fire together when
//! it continues, as they do after `SIGCONT` — and once it is killed (SIGKILL) each of its tasks
//! is dropped the next time it is woken, without running another line.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};

/// What a [`Process`] is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    /// Its tasks run.
    Running,
    /// Stopped (SIGSTOP): its tasks wait, unpolled, until it continues.
    Stopped,
    /// Killed (SIGKILL): its tasks never run again; it never comes back.
    Killed,
}

/// A simulated process: the switch its tasks pass before each poll.
#[derive(Clone)]
pub struct Process(Arc<Mutex<Inner>>);

struct Inner {
    state: ProcessState,
    /// Where each live task of the process last left its waker: every one is woken when the
    /// process changes state (to run again, or to be dropped once killed).
    tasks: Vec<Weak<Slot>>,
    /// How many tasks were live when `tasks` was last swept of ended ones.
    swept: usize,
}

/// A task's last waker.
#[derive(Default)]
struct Slot(Mutex<Option<Waker>>);

impl Slot {
    fn keep(&self, waker: &Waker) {
        let mut slot = crate::sync::lock(&self.0);
        if !slot.as_ref().is_some_and(|kept| kept.will_wake(waker)) {
            *slot = Some(waker.clone());
        }
    }

    fn wake(&self) {
        if let Some(waker) = crate::sync::lock(&self.0).take() {
            waker.wake();
        }
    }
}

impl Default for Process {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Inner {
            state: ProcessState::Running,
            tasks: Vec::new(),
            swept: 0,
        })))
    }
}

impl Process {
    /// Sets what the process does (a killed process stays killed); its tasks are woken to see.
    pub fn set(&self, state: ProcessState) {
        let tasks: Vec<Arc<Slot>> = {
            let mut inner = crate::sync::lock(&self.0);
            if inner.state == ProcessState::Killed || inner.state == state {
                return;
            }
            inner.state = state;
            inner.tasks.iter().filter_map(Weak::upgrade).collect()
        };
        tasks.iter().for_each(|task| task.wake());
    }

    /// What the process is doing now.
    pub fn state(&self) -> ProcessState {
        crate::sync::lock(&self.0).state
    }

    /// A new task's slot, kept (weakly) for the wake-ups of state changes.
    fn enroll(&self) -> Arc<Slot> {
        let slot = Arc::new(Slot::default());
        let mut inner = crate::sync::lock(&self.0);
        if inner.tasks.len() >= 2 * inner.swept.max(16) {
            inner.tasks.retain(|task| task.strong_count() > 0);
            inner.swept = inner.tasks.len();
        }
        inner.tasks.push(Arc::downgrade(&slot));
        slot
    }
}

tokio::task_local! {
    /// The process the task being polled belongs to (only ever set by a simulation).
    static PROCESS: Process;
}

/// Spawns `task` on the current runtime: in the process the caller's task belongs to, if any.
///
/// # Panics
/// Outside a Tokio runtime, as `tokio::spawn` does.
pub fn spawn<F>(task: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    match PROCESS.try_with(Process::clone) {
        Ok(process) => tokio::spawn(async move {
            match within(process, task).await {
                Some(output) => output,
                // Killed: the task is gone, and whoever awaits it belongs to the dead process.
                None => std::future::pending().await,
            }
        }),
        Err(_) => tokio::spawn(task),
    }
}

/// Runs `work` as part of `process`: polled only while it runs, and what it spawns through
/// [`spawn`] belongs to it too. `None` once the process is killed (`work` is dropped then).
pub async fn within<F: Future>(process: Process, work: F) -> Option<F::Output> {
    let held = Held {
        slot: process.enroll(),
        process: process.clone(),
        work: Some(Box::pin(work)),
    };
    PROCESS.scope(process, held).await
}

/// Runs `make` (a constructor that spawns the process's first tasks), every task it spawns
/// through [`spawn`] belonging to `process`.
pub fn owning<T>(process: Process, make: impl FnOnce() -> T) -> T {
    PROCESS.sync_scope(process, make)
}

/// Runs `work` (an asynchronous constructor) to its end whatever `process` does, every task it
/// spawns through [`spawn`] belonging to `process`.
pub async fn owning_async<F: Future>(process: Process, work: F) -> F::Output {
    PROCESS.scope(process, work).await
}

/// A future held by its process's state.
struct Held<F: Future> {
    process: Process,
    slot: Arc<Slot>,
    work: Option<Pin<Box<F>>>,
}

impl<F: Future> Future for Held<F> {
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Kept before the state is read: a change after the read wakes this task.
        self.slot.keep(cx.waker());
        let state = self.process.state();
        match (state, self.work.as_mut()) {
            (ProcessState::Stopped, Some(_)) => Poll::Pending,
            (ProcessState::Running, Some(work)) => work.as_mut().poll(cx).map(Some),
            (ProcessState::Killed, _) | (_, None) => {
                self.work = None;
                Poll::Ready(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    /// A task of `process` that counts its ticks every 10 ms.
    fn ticking(process: &Process, ticks: &Arc<AtomicUsize>) -> tokio::task::JoinHandle<()> {
        owning(process.clone(), || ticking_here(ticks))
    }

    #[tokio::test(start_paused = true)]
    async fn a_stopped_process_runs_nothing_and_its_timers_fire_once_it_continues() {
        let (process, ticks) = (Process::default(), Arc::new(AtomicUsize::new(0)));
        let _task = ticking(&process, &ticks);
        tokio::time::sleep(Duration::from_millis(55)).await;
        assert_eq!(ticks.load(Ordering::SeqCst), 5);
        process.set(ProcessState::Stopped);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(ticks.load(Ordering::SeqCst), 5, "a stopped process's timers do not run");
        process.set(ProcessState::Running);
        tokio::time::sleep(Duration::from_millis(1)).await;
        // The sleep due during the stop fires at once: one more tick, then on every 10 ms.
        assert_eq!(ticks.load(Ordering::SeqCst), 6);
    }

    #[tokio::test(start_paused = true)]
    async fn a_killed_process_drops_its_tasks_and_what_they_spawn() {
        let (process, ticks) = (Process::default(), Arc::new(AtomicUsize::new(0)));
        let dropped = Arc::new(AtomicUsize::new(0));
        struct Dropped(Arc<AtomicUsize>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let guard = Dropped(Arc::clone(&dropped));
        let outer_ticks = Arc::clone(&ticks);
        let _task = owning(process.clone(), || {
            spawn(async move {
                let _guard = guard;
                // A task spawned by a task of the process belongs to it too.
                let _inner = ticking_here(&outer_ticks);
                std::future::pending::<()>().await;
            })
        });
        tokio::time::sleep(Duration::from_millis(35)).await;
        assert_eq!(ticks.load(Ordering::SeqCst), 3);
        process.set(ProcessState::Killed);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            ticks.load(Ordering::SeqCst),
            3,
            "a killed process's tasks never run again"
        );
        process.set(ProcessState::Running);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(ticks.load(Ordering::SeqCst), 3, "a killed process stays killed");
        assert_eq!(within(process, async { 1 }).await, None);
        assert_eq!(dropped.load(Ordering::SeqCst), 1, "the killed task was dropped");
    }

    fn ticking_here(ticks: &Arc<AtomicUsize>) -> tokio::task::JoinHandle<()> {
        let ticks = Arc::clone(ticks);
        spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
                ticks.fetch_add(1, Ordering::SeqCst);
            }
        })
    }

    #[tokio::test]
    async fn outside_a_process_a_task_is_a_plain_task() {
        assert_eq!(spawn(async { 7 }).await.ok(), Some(7));
    }
}
