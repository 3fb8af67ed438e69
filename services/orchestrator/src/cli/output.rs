//! What the client commands print besides the event stream: a message as JSON for scripts
//! (`--json`: protobuf's canonical JSON mapping, read off the contract's descriptors, one line,
//! default values included), a time a person reads, a status's name, and a refusal in the
//! words of the domain (the server's message and its code, no gRPC boilerplate). Everything goes
//! to standard output through [`Stdout`], which ends the command when its reader went away.

use std::time::Duration;

use proto::orchestrator::v1 as pb;

use crate::Error;

/// `message` (of the contract's type `name`, e.g. `orchestrator.v1.RunResult`) as one line of
/// JSON, every field named, enums by name (see [`crate::wire::json`]).
pub fn json<M: prost::Message>(message: &M, name: &str) -> Result<String, Error> {
    crate::wire::json::to_json(message, name).map_err(Error::Call)
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

/// A refusal of `what` (the command's action, e.g. "cancel run r-1") as a person reads it, with
/// what to do when the refusal is the command line's to fix.
pub fn refused(what: &str, error: orchestrator_client::Error) -> Error {
    let hint = hint(&error).map(|h| format!("\n  {h}")).unwrap_or_default();
    Error::Call(format!("{what}: {}{hint}", with_flags(&error.to_string())))
}

/// The fields of the contract a client command fills from one of its flags, longest first: a
/// server's refusal names the field (it speaks to every client), a person typed the flag.
const FLAGS_OF_FIELDS: &[(&str, &str)] = &[
    ("limits.approval_timeout_ms", "--approval-timeout"),
    ("limits.run_timeout_ms", "--run-timeout"),
    ("tools.approval.tools", "--needs-approval"),
    ("params.tool_choice", "--tool-choice"),
    ("params.temperature", "--temperature"),
    ("params.max_tokens", "--max-tokens"),
    ("tools.normal", "--tool"),
    ("tools.exit", "--exit-tool"),
    ("thread_id", "--thread"),
    ("on_busy", "--on-busy"),
    ("run_id", "--run-id"),
];

/// `message` with each field of [`FLAGS_OF_FIELDS`] it names (as a whole word; its first
/// mention) followed by its flag: `tools.approval.tools (--needs-approval) names "x", …`.
pub fn with_flags(message: &str) -> String {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut marks: Vec<(usize, &str)> = FLAGS_OF_FIELDS
        .iter()
        .filter_map(|(field, flag)| {
            let (at, _) = message.match_indices(field).find(|(at, _)| {
                let before = message[..*at].chars().next_back();
                let after = message[at + field.len()..].chars().next();
                before.is_none_or(|c| !word(c) && c != '.') && after.is_none_or(|c| !word(c))
            })?;
            let end = message[at..]
                .find(|c: char| c.is_whitespace() || c == ':' || c == ',')
                .map_or(message.len(), |n| at + n);
            Some((end, *flag))
        })
        .collect();
    marks.sort_unstable();
    let (mut marked, mut from) = (String::with_capacity(message.len() + 32), 0);
    for (end, flag) in marks {
        marked.push_str(&message[from..end]);
        marked.push_str(&format!(" ({flag})"));
        from = end;
    }
    marked.push_str(&message[from..]);
    marked
}

/// What a person does about `error`, when the command line can fix it.
fn hint(error: &orchestrator_client::Error) -> Option<&'static str> {
    use tonic::Code;
    let text = error.to_string();
    match error.code() {
        Some(Code::Unauthenticated) => {
            Some("the orchestrator authenticates callers: pass --token TOKEN (or set ORCHESTRATOR_TOKEN)")
        }
        Some(Code::PermissionDenied) => Some("your token's principal may not do this: ask for a token that may"),
        Some(Code::Unknown | Code::Internal | Code::Unimplemented)
            if text.contains("h2 protocol error")
                || text.contains("grpc-status header missing")
                || text.contains("status: 404") =>
        {
            Some(
                "the endpoint does not answer gRPC: is --endpoint the orchestrator's gRPC port (50051 by \
                 default), not its console, A2A or metrics port?",
            )
        }
        _ if text.contains("h2 protocol error") || text.contains("frame with invalid size") => Some(
            "the endpoint does not answer gRPC over HTTP/2: is --endpoint the orchestrator's gRPC port, \
             and https:// only when it serves TLS?",
        ),
        _ => None,
    }
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

/// A decision on call `call_id` of tool `name`, as a line: what, by whom, after how long (when
/// `waited_ms` is known), and the reason or the edited arguments.
pub fn decision_line(name: &str, call_id: &str, d: &pb::ApprovalDecision, waited_ms: Option<u64>) -> String {
    use pb::ApprovalOutcome as O;
    let who = match d.principal.as_str() {
        "" => "the anonymous caller",
        who => who,
    };
    let after = waited_ms
        .map(|ms| {
            format!(
                " after {}",
                humantime::format_duration(Duration::from_millis(ms / 1000 * 1000))
            )
        })
        .unwrap_or_default();
    let at = utc(i64::try_from(d.decided_at_unix_ms).unwrap_or(0));
    let what = match O::try_from(d.outcome).unwrap_or_default() {
        O::Approved => format!("✔ approved by {who}{after}"),
        O::Edited => format!("✎ approved by {who}{after} with arguments {}", d.edited_arguments_json),
        O::Rejected => format!("✘ rejected by {who}{after}: {}", d.message),
        O::TimedOut => format!("⌛ not decided{after}: {}", d.message),
        O::Answered => format!("✔ answered by {who}{after}"),
        O::Unspecified => format!("decided by {who}{after}"),
    };
    format!("{what}  [{name} {call_id}, {at}]")
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

    #[test]
    fn a_refusal_naming_a_field_names_its_flag_too() {
        assert_eq!(
            with_flags("tools.approval.tools names \"x\", which is not a normal tool of this run"),
            "tools.approval.tools (--needs-approval) names \"x\", which is not a normal tool of this run"
        );
        assert_eq!(
            with_flags("tools.exit[0].name \"a b\" must be 1-64 letters"),
            "tools.exit[0].name (--exit-tool) \"a b\" must be 1-64 letters"
        );
        assert_eq!(
            with_flags("name at most one of run_id and thread_id"),
            "name at most one of run_id (--run-id) and thread_id (--thread)"
        );
        // Not a field: part of another word, or of another path.
        for text in ["my_run_id is wrong", "a.tools.normal b", "the model stopped"] {
            assert_eq!(with_flags(text), text);
        }
    }
}
