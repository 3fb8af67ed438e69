//! `echo`: returns its arguments object unchanged. Useful to test a pipeline end to end.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::{Value, json};

use super::{Builtin, spec};
use crate::tools::{Args, CallContext, Tool, ToolResult};

struct Echo;

impl Tool for Echo {
    fn call(&self, args: Args, _ctx: &CallContext) -> BoxFuture<'static, ToolResult> {
        futures::future::ready(Ok(Value::Object(args))).boxed()
    }
}

pub(super) fn builtin() -> Builtin {
    let schema = json!({"type": "object", "description": "Any JSON object; it is returned as it is."});
    Builtin::Enabled(
        spec(
            "echo",
            "Returns its arguments object unchanged.",
            schema,
            Duration::from_secs(5),
        ),
        Arc::new(Echo),
    )
}
