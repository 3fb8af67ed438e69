//! The checks a table of the tools manifest passes, field by field, whether it declares a
//! command tool or an MCP server: bounded durations and numbers, and the program to run.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Longest timeout a command tool may declare.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);
/// Environment variables passed through when a tool names none.
pub const DEFAULT_ENV_ALLOWLIST: &[&str] = &["PATH", "LANG", "LC_ALL", "TZ"];

/// `text` as a duration within `min..=cap`; the error names the field.
pub(crate) fn parse_bounded_duration(name: &str, text: &str, min: Duration, cap: Duration) -> Result<Duration, String> {
    let value = shared::config::parse_duration(text).map_err(|e| format!("{name}: {e}"))?;
    shared::config::bound("value", value, min, cap)
        .check_as(|| name.to_owned())
        .map_err(|e| e.to_string())?;
    Ok(value)
}

/// `value` (or `default`) within `min..=cap`; the error names the field.
pub(crate) fn check_range(
    name: &'static str,
    value: Option<u64>,
    default: u64,
    min: u64,
    cap: u64,
) -> Result<u64, String> {
    let value = value.unwrap_or(default);
    shared::config::bound(name, value, min, cap)
        .check_as(|| name.to_owned())
        .map_err(|e| e.to_string())?;
    Ok(value)
}

pub(crate) fn resolve_dir(dir: &Path, base_dir: &Path) -> Result<PathBuf, String> {
    let dir = base_dir.join(dir);
    if !dir.is_dir() {
        return Err(format!("working_dir {} is not an existing directory", dir.display()));
    }
    Ok(dir)
}

/// Finds `program` the way a shell would: a path (relative to the manifest) or a name on PATH.
pub(crate) fn resolve_program(program: &str, base_dir: &Path) -> Result<PathBuf, String> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let path = base_dir.join(program);
        return if executable(&path) {
            Ok(path)
        } else {
            Err(format!("argv[0] {} is not an executable file", path.display()))
        };
    }
    let search = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&search)
        .map(|dir| dir.join(program))
        .find(|p| executable(p))
        .ok_or_else(|| format!("argv[0] {program:?} was not found on PATH"))
}
