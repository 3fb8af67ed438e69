//! `time_now`: the current time, as Unix milliseconds and RFC 3339 (UTC).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::json;

use super::{Builtin, spec};
use crate::tools::{Args, CallContext, Tool, ToolError, ToolResult};

struct TimeNow;

impl Tool for TimeNow {
    fn call(&self, _args: Args, _ctx: &CallContext) -> BoxFuture<'static, ToolResult> {
        let now = SystemTime::now();
        let result = now
            .duration_since(UNIX_EPOCH)
            .map_err(|_| ToolError::failed("the runner's clock is set before 1970"))
            .map(|since_epoch| {
                json!({
                    "unix_ms": u64::try_from(since_epoch.as_millis()).unwrap_or(u64::MAX),
                    "rfc3339": humantime::format_rfc3339_millis(now).to_string(),
                    "timezone": "UTC",
                })
            });
        futures::future::ready(result).boxed()
    }
}

pub(super) fn builtin() -> Builtin {
    let schema = json!({"type": "object", "properties": {}, "additionalProperties": false});
    Builtin::Enabled(
        spec(
            "time_now",
            "Returns the current date and time in UTC (RFC 3339) and as Unix milliseconds.",
            schema,
            Duration::from_secs(5),
        ),
        Arc::new(TimeNow),
    )
}
