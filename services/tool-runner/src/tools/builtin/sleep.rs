//! `sleep`: waits `ms` milliseconds (capped by `--sleep-max`), then reports how long it slept.
//! Mostly for tests and demos of concurrency, timeouts and cancellation.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::json;

use super::{Builtin, BuiltinConfig, spec};
use crate::tools::{Args, CallContext, Tool, ToolResult, u64_arg};

struct Sleep;

impl Tool for Sleep {
    fn call(&self, args: Args, _ctx: &CallContext) -> BoxFuture<'static, ToolResult> {
        // The schema guarantees an integer within [0, sleep_max].
        let ms = u64_arg(&args, "ms").unwrap_or(0);
        async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(json!({ "slept_ms": ms }))
        }
        .boxed()
    }
}

pub(super) fn builtin(config: &BuiltinConfig) -> Builtin {
    let max_ms = u64::try_from(config.sleep_max.as_millis()).unwrap_or(u64::MAX);
    let schema = json!({
        "type": "object",
        "properties": {
            "ms": {"type": "integer", "minimum": 0, "maximum": max_ms, "description": "How long to sleep, in milliseconds."}
        },
        "required": ["ms"],
        "additionalProperties": false
    });
    // The tool's own timeout leaves room above the longest allowed sleep.
    let timeout = config.sleep_max + Duration::from_secs(5);
    Builtin::Enabled(
        spec(
            "sleep",
            &format!("Waits `ms` milliseconds (at most {max_ms}) and returns."),
            schema,
            timeout,
        ),
        Arc::new(Sleep),
    )
}
