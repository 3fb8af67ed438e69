//! `read_file` and `list_dir`, confined to a sandbox root directory.
//!
//! Paths are relative to the root. Absolute paths and `..` components are refused outright, and
//! the resolved path (symlinks followed) must still lie inside the root, so a symlink pointing
//! out of the sandbox is refused too.

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

use super::{Builtin, BuiltinConfig, spec};
use crate::tools::{Args, CallContext, ErrorCode, Tool, ToolError, ToolResult, str_arg, u64_arg};

/// The sandbox: a canonical root directory.
#[derive(Debug, Clone)]
struct Sandbox {
    root: PathBuf,
}

impl Sandbox {
    /// Resolves `requested` inside the root, refusing every way out of it.
    async fn resolve(&self, requested: &str) -> Result<PathBuf, ToolError> {
        let relative = Path::new(requested);
        if relative.is_absolute() {
            return Err(ToolError::denied(format!(
                "{requested:?} is an absolute path; paths are relative to the sandbox root (use \".\" for the root)"
            )));
        }
        if relative.components().any(|c| matches!(c, Component::ParentDir)) {
            return Err(ToolError::denied(format!(
                "{requested:?} contains '..', which would leave the sandbox"
            )));
        }
        let joined = self.root.join(relative);
        let resolved = tokio::fs::canonicalize(&joined)
            .await
            .map_err(|e| io_error(requested, &e))?;
        if !resolved.starts_with(&self.root) {
            return Err(ToolError::denied(format!(
                "{requested:?} resolves (through a symlink) outside the sandbox"
            )));
        }
        Ok(resolved)
    }
}

fn io_error(path: &str, e: &std::io::Error) -> ToolError {
    match e.kind() {
        std::io::ErrorKind::NotFound => ToolError::failed(format!("{path:?} does not exist")),
        std::io::ErrorKind::PermissionDenied => ToolError::denied(format!("{path:?}: permission denied")),
        _ => ToolError::failed(format!("{path:?}: {e}")),
    }
}

struct ReadFile {
    sandbox: Sandbox,
    max_bytes: u64,
}

impl Tool for ReadFile {
    fn call(&self, args: Args, _ctx: &CallContext) -> BoxFuture<'static, ToolResult> {
        let sandbox = self.sandbox.clone();
        let path = str_arg(&args, "path").unwrap_or_default().to_owned();
        let limit = u64_arg(&args, "max_bytes").map_or(self.max_bytes, |n| n.min(self.max_bytes));
        async move {
            let resolved = sandbox.resolve(&path).await?;
            let file = tokio::fs::File::open(&resolved)
                .await
                .map_err(|e| io_error(&path, &e))?;
            let metadata = file.metadata().await.map_err(|e| io_error(&path, &e))?;
            if !metadata.is_file() {
                return Err(ToolError::invalid(format!(
                    "{path:?} is not a regular file (use list_dir for directories)"
                )));
            }
            let mut bytes = Vec::new();
            file.take(limit)
                .read_to_end(&mut bytes)
                .await
                .map_err(|e| io_error(&path, &e))?;
            let content = String::from_utf8(bytes).map_err(|_| {
                ToolError::new(
                    ErrorCode::Failed,
                    format!("{path:?} is not UTF-8 text; read_file returns text only"),
                )
            })?;
            Ok(json!({
                "path": path,
                "size": metadata.len(),
                "content": content,
                "truncated": metadata.len() > limit,
            }))
        }
        .boxed()
    }
}

struct ListDir {
    sandbox: Sandbox,
    max_entries: usize,
}

impl Tool for ListDir {
    fn call(&self, args: Args, _ctx: &CallContext) -> BoxFuture<'static, ToolResult> {
        let sandbox = self.sandbox.clone();
        let max_entries = self.max_entries;
        let path = str_arg(&args, "path").unwrap_or(".").to_owned();
        async move {
            let resolved = sandbox.resolve(&path).await?;
            let mut dir = tokio::fs::read_dir(&resolved).await.map_err(|e| io_error(&path, &e))?;
            let mut entries = Vec::new();
            let mut total = 0usize;
            while let Some(entry) = dir.next_entry().await.map_err(|e| io_error(&path, &e))? {
                total += 1;
                if entries.len() >= max_entries {
                    continue;
                }
                let file_type = entry.file_type().await.ok();
                let kind = match file_type {
                    Some(t) if t.is_dir() => "dir",
                    Some(t) if t.is_file() => "file",
                    Some(t) if t.is_symlink() => "symlink",
                    _ => "other",
                };
                let size = match kind {
                    "file" => entry.metadata().await.ok().map(|m| m.len()),
                    _ => None,
                };
                entries.push(json!({
                    "name": entry.file_name().to_string_lossy(),
                    "type": kind,
                    "size": size,
                }));
            }
            entries.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
            Ok(json!({
                "path": path,
                "entries": Value::Array(entries),
                "total": total,
                "truncated": total > max_entries,
            }))
        }
        .boxed()
    }
}

pub(super) fn builtins(root: &Path, config: &BuiltinConfig) -> Result<Vec<Builtin>, crate::Error> {
    let root = std::fs::canonicalize(root)
        .map_err(|e| crate::Error::Config(format!("--sandbox-root {}: {e}", root.display())))?;
    if !root.is_dir() {
        return Err(crate::Error::Config(format!(
            "--sandbox-root {} is not a directory",
            root.display()
        )));
    }
    let sandbox = Sandbox { root };
    let timeout = config.io_timeout;
    let read = json!({
        "type": "object",
        "properties": {
            "path": {"type": "string", "minLength": 1, "description": "File path relative to the sandbox root."},
            "max_bytes": {"type": "integer", "minimum": 1, "description": format!("Read at most this many bytes (the runner's cap is {}).", config.read_max_bytes)}
        },
        "required": ["path"],
        "additionalProperties": false
    });
    let list = json!({
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "Directory relative to the sandbox root; \".\" (the default) is the root."}
        },
        "additionalProperties": false
    });
    Ok(vec![
        Builtin::Enabled(
            spec(
                "read_file",
                "Reads a UTF-8 text file inside the runner's sandbox directory.",
                read,
                timeout,
            ),
            Arc::new(ReadFile {
                sandbox: sandbox.clone(),
                max_bytes: config.read_max_bytes,
            }),
        ),
        Builtin::Enabled(
            spec(
                "list_dir",
                "Lists a directory inside the runner's sandbox directory.",
                list,
                timeout,
            ),
            Arc::new(ListDir {
                sandbox,
                max_entries: config.list_max_entries,
            }),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn sandbox() -> (tempfile::TempDir, Sandbox) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/a.txt"), "hello").unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        (dir, Sandbox { root })
    }

    #[tokio::test]
    async fn resolves_inside_and_refuses_every_escape() {
        let (dir, sb) = sandbox().await;
        assert!(sb.resolve("sub/a.txt").await.is_ok());
        assert!(sb.resolve(".").await.is_ok());
        assert!(
            sb.resolve("./sub/../sub/a.txt")
                .await
                .unwrap_err()
                .message
                .contains("..")
        );
        assert_eq!(
            sb.resolve("/etc/passwd").await.unwrap_err().code,
            ErrorCode::PermissionDenied
        );
        assert_eq!(sb.resolve("../x").await.unwrap_err().code, ErrorCode::PermissionDenied);
        std::os::unix::fs::symlink("/etc", dir.path().join("out")).unwrap();
        let err = sb.resolve("out/passwd").await.unwrap_err();
        assert_eq!(err.code, ErrorCode::PermissionDenied, "{err}");
        assert_eq!(sb.resolve("missing").await.unwrap_err().code, ErrorCode::Failed);
    }
}
