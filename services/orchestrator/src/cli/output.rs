//! What the client commands print besides the event stream: a message as JSON for scripts
//! (`--json`: protobuf's canonical JSON mapping, read off the contract's descriptors, one line,
//! default values included), a time a person reads, a status's name, and a refusal in the
//! words of the domain (the server's message and its code, no gRPC boilerplate). Everything goes
//! to standard output through [`Stdout`], which ends the command when its reader went away.

use std::time::Duration;

use proto::orchestrator::v1 as pb;

use crate::Error;

/// `message` (of the contract's type `name`, e.g. `orchestrator.v1.RunResult`) as one line of
/// JSON, every field named, enums by name (see [`crate::json`]).
pub fn json<M: prost::Message>(message: &M, name: &str) -> Result<String, Error> {
    crate::json::to_json(message, name).map_err(Error::Call)
}

/// Prints `message` as JSON (see [`json`]).
pub fn print_json<M: prost::Message>(message: &M, name: &str) -> Result<(), Error> {
    line(&json(message, name)?);
    Ok(())
}

/// The exit code of a command whose reader went away, as a process killed by `SIGPIPE` has.
pub const CLOSED_PIPE: i32 = 141;

/// Standard output for the client commands: a reader that went away (a closed pipe: `| head`)
/// ends the command at once, quietly, with [`CLOSED_PIPE`], as a Unix tool does; never a panic.
pub struct Stdout;

impl std::io::Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        ended_if_closed(std::io::stdout().write(buf))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        ended_if_closed(std::io::stdout().flush())
    }
}

fn ended_if_closed<T>(result: std::io::Result<T>) -> std::io::Result<T> {
    if let Err(e) = &result
        && e.kind() == std::io::ErrorKind::BrokenPipe
    {
        std::process::exit(CLOSED_PIPE)
    }
    result
}

/// Prints `text` and a newline on [`Stdout`] (another failure to print is not the command's).
pub fn line(text: &str) {
    use std::io::Write as _;
    let _ = writeln!(Stdout, "{text}");
}

/// Rows printed as columns sized to what they hold, two spaces apart, no space at a line's end.
pub struct Table {
    header: Vec<&'static str>,
    /// Columns of numbers, aligned right.
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these columns; a name starting with `>` is a right-aligned column (the `>`
    /// is not printed).
    pub fn new(columns: &[&'static str]) -> Self {
        Self {
            header: columns.iter().map(|c| c.trim_start_matches('>')).collect(),
            right: columns.iter().map(|c| c.starts_with('>')).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row: a cell per column.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as lines of text.
    pub fn lines(&self) -> Vec<String> {
        let header: Vec<String> = self.header.iter().map(|h| (*h).to_owned()).collect();
        let all: Vec<&Vec<String>> = std::iter::once(&header).chain(&self.rows).collect();
        let widths: Vec<usize> = (0..self.header.len())
            .map(|i| {
                all.iter()
                    .filter_map(|r| r.get(i))
                    .map(|c| c.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        all.iter()
            .map(|row| {
                let cells = row.iter().zip(&widths).zip(&self.right);
                let line: Vec<String> = cells
                    .map(|((cell, &width), &right)| match right {
                        true => format!("{cell:>width$}"),
                        false => format!("{cell:<width$}"),
                    })
                    .collect();
                line.join("  ").trim_end().to_owned()
            })
            .collect()
    }

    /// Prints the table.
    pub fn print(&self) {
        for line in self.lines() {
            say!("{line}");
        }
    }
}

/// A refusal of `what` (the command's action, e.g. "cancel run r-1") as a person reads it.
pub fn refused(what: &str, error: orchestrator_client::Error) -> Error {
    Error::Call(format!("{what}: {error}"))
}

/// What caused `error`, as one line: its sources' messages (a transport error says only
/// "transport error" itself), or its own when it has none.
pub fn causes(error: &dyn std::error::Error) -> String {
    let mut causes = Vec::new();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if causes.last().is_none_or(|last: &String| !last.contains(&text)) {
            causes.push(text);
        }
        source = cause.source();
    }
    match causes.is_empty() {
        true => error.to_string(),
        false => causes.join(": "),
    }
}

/// A run status as printed: `COMPLETED`, `AWAITING_INPUT` … (`?` for one this build does not know).
pub fn status_name(status: i32) -> &'static str {
    pb::RunStatus::try_from(status)
        .map_or("?", |s| s.as_str_name())
        .trim_start_matches("RUN_STATUS_")
}

/// A Unix time in ms as a person reads it: RFC 3339 in UTC, to the second.
pub fn utc(ms: i64) -> String {
    let at = std::time::UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_seconds(at).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_sizes_its_columns_to_what_they_hold() {
        let mut table = Table::new(&["RUN", ">TOKENS", "LABELS"]);
        table.row(vec!["first".into(), "1687".into(), String::new()]);
        table.row(vec!["q-5".into(), "12".into(), "batch=8".into()]);
        assert_eq!(
            table.lines(),
            ["RUN    TOKENS  LABELS", "first    1687", "q-5        12  batch=8"]
        );
    }
}
