//! Resource limits of command tools, set in the child before the tool's program starts: the
//! child is `prlimit` (util-linux), which sets its own limits and then executes the program, so
//! the program and everything it starts inherit them. On top of the cleared environment, the
//! timeout and the process-group kill.
//!
//! In the manifest, `[defaults.limits]` and each `[tool.limits]`:
//!
//! | field | limit | default | range |
//! | --- | --- | --- | --- |
//! | `max_memory_bytes` | address space (`RLIMIT_AS`) | 2 GiB | 16 MiB ..= 1 TiB |
//! | `max_cpu_seconds` | CPU time (`RLIMIT_CPU`; SIGXCPU) | 60 | 1 ..= 86400 |
//! | `max_open_files` | file descriptors (`RLIMIT_NOFILE`) | 1024 | 16 ..= 1048576 |
//! | `max_processes` | processes and threads of the runner's user (`RLIMIT_NPROC`) | 512 | 1 ..= 1048576 |
//! | `max_file_bytes` | size of any file written (`RLIMIT_FSIZE`; SIGXFSZ) | 1 GiB | 1 ..= 1 TiB |
//!
//! `max_processes` counts every process of the user the runner runs as and is not enforced for
//! root (the kernel exempts it): run the runner as a non-root user, as the deployment does.

use serde::Deserialize;

const MIB: u64 = 1024 * 1024;
const GIB: u64 = 1024 * MIB;

/// The limits as a manifest table writes them; unset fields come from the defaults.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    max_memory_bytes: Option<u64>,
    max_cpu_seconds: Option<u64>,
    max_open_files: Option<u64>,
    max_processes: Option<u64>,
    max_file_bytes: Option<u64>,
}

/// The limits of one command tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourceLimits {
    /// Address space, bytes.
    pub memory_bytes: u64,
    /// CPU time, seconds.
    pub cpu_seconds: u64,
    /// Open file descriptors.
    pub open_files: u64,
    /// Processes (and threads) of the runner's user.
    pub processes: u64,
    /// Largest file written, bytes.
    pub file_bytes: u64,
}

impl Default for ResourceLimits {
    fn default() -> Self {
        Self {
            memory_bytes: 2 * GIB,
            cpu_seconds: 60,
            open_files: 1024,
            processes: 512,
            file_bytes: GIB,
        }
    }
}

fn pick(name: &'static str, value: Option<u64>, default: u64, min: u64, cap: u64) -> Result<u64, String> {
    let value = value.unwrap_or(default);
    shared::config::bound(name, value, min, cap)
        .check_as(|| format!("limits.{name}"))
        .map_err(|e| e.to_string())?;
    Ok(value)
}

impl ResourceLimits {
    /// `raw` over `defaults`, each value checked against its range.
    pub(super) fn resolve(raw: Option<&RawLimits>, defaults: &Self) -> Result<Self, String> {
        let raw = raw.cloned().unwrap_or_default();
        Ok(Self {
            memory_bytes: pick(
                "max_memory_bytes",
                raw.max_memory_bytes,
                defaults.memory_bytes,
                16 * MIB,
                1024 * GIB,
            )?,
            cpu_seconds: pick("max_cpu_seconds", raw.max_cpu_seconds, defaults.cpu_seconds, 1, 86_400)?,
            open_files: pick("max_open_files", raw.max_open_files, defaults.open_files, 16, 1 << 20)?,
            processes: pick("max_processes", raw.max_processes, defaults.processes, 1, 1 << 20)?,
            file_bytes: pick("max_file_bytes", raw.max_file_bytes, defaults.file_bytes, 1, 1024 * GIB)?,
        })
    }

    /// The arguments of `prlimit` that set them (soft and hard alike).
    pub(super) fn prlimit_args(&self) -> Vec<String> {
        vec![
            format!("--as={}", self.memory_bytes),
            // SIGXCPU at the limit, SIGKILL a second later for a program that ignores it.
            format!("--cpu={}:{}", self.cpu_seconds, self.cpu_seconds + 1),
            format!("--nofile={}", self.open_files),
            format!("--nproc={}", self.processes),
            format!("--fsize={}", self.file_bytes),
        ]
    }

    /// How a limited child starts (command tools and stdio MCP servers alike): `prlimit` with
    /// these limits executing `program`, with exactly `env`, in `cwd`, piped stdio, in a process
    /// group of its own (killed as a whole by [`super::command::GroupKiller`]), killed on drop.
    pub(super) fn command(
        &self,
        prlimit: &std::path::Path,
        program: &std::path::Path,
        args: &[String],
        env: &[(String, String)],
        cwd: &std::path::Path,
    ) -> tokio::process::Command {
        use std::process::Stdio;
        let mut command = tokio::process::Command::new(prlimit);
        command
            .args(self.prlimit_args())
            .arg("--")
            .arg(program)
            .args(args)
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        command
    }

    /// What a signal that ended a tool says about its limits.
    pub(super) fn signal_meaning(&self, signal: i32) -> Option<String> {
        match signal {
            24 => Some(format!(
                "it used up its {} CPU seconds (max_cpu_seconds)",
                self.cpu_seconds
            )),
            25 => Some(format!(
                "it wrote a file past {} bytes (max_file_bytes)",
                self.file_bytes
            )),
            9 => Some("SIGKILL: past its CPU limit, or the kernel's out-of-memory killer".to_owned()),
            _ => None,
        }
    }
}

impl std::fmt::Display for ResourceLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "memory {} MiB, {} CPU s, {} open files, {} processes, files up to {} MiB",
            self.memory_bytes / MIB,
            self.cpu_seconds,
            self.open_files,
            self.processes,
            self.file_bytes / MIB
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_on_both_sides_of_their_ranges() {
        let defaults = ResourceLimits::default();
        let raw = |text: &str| toml::from_str::<RawLimits>(text).unwrap();
        assert_eq!(ResourceLimits::resolve(None, &defaults), Ok(defaults));
        let low = raw(
            "max_memory_bytes = 16777216\nmax_cpu_seconds = 1\nmax_open_files = 16\nmax_processes = 1\nmax_file_bytes = 1",
        );
        assert!(ResourceLimits::resolve(Some(&low), &defaults).is_ok());
        for (text, flag) in [
            ("max_memory_bytes = 16777215", "limits.max_memory_bytes"),
            ("max_cpu_seconds = 0", "limits.max_cpu_seconds"),
            ("max_cpu_seconds = 86401", "limits.max_cpu_seconds"),
            ("max_open_files = 15", "limits.max_open_files"),
            ("max_processes = 0", "limits.max_processes"),
            ("max_file_bytes = 1099511627777", "limits.max_file_bytes"),
        ] {
            let e = ResourceLimits::resolve(Some(&raw(text)), &defaults).unwrap_err();
            assert!(e.contains(flag), "{text}: {e}");
        }
        assert!(
            toml::from_str::<RawLimits>("max_memory = 1").is_err(),
            "unknown fields are refused"
        );
    }
}
