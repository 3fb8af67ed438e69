//! An MCP server's changed tool list, across both services: the tool-runner lists the new tool
//! and the orchestrator's next catalog refresh offers it to the model. The MCP server is the
//! official reference one (`@modelcontextprotocol/server-everything`, installed by
//! `./scripts/mcp-servers`, which `./scripts/test` runs).

use std::time::Duration;

use testkit::mcp_servers::{everything_js, python};
use testkit::stack::{Stack, request, runner_config};

type TestResult = anyhow::Result<()>;

#[tokio::test]
async fn a_changed_tool_list_reaches_the_runner_and_then_the_orchestrators_catalog() -> TestResult {
    // server-everything adds `simulate-research-query` once initialized and then sends
    // notifications/tools/list_changed; a filter holds `notifications/initialized` back for 4 s,
    // so the first tools/list comes before the change (the handshake of 2025-11-25, whose
    // `initialized` it holds, is asked for).
    let dir = tempfile::tempdir()?;
    let hold = testkit::repo_root().join("tests/fixtures/mcp/hold-initialized.py");
    let manifest = format!(
        "[[mcp_servers]]\nname = \"everything\"\nprotocol = \"2025-11-25\"\ncommand = \"sh\"\nargs = [\"-c\", \"'{python}' -u '{hold}' 4 | exec node '{js}' stdio\"]\n",
        python = python()?.display(),
        hold = hold.display(),
        js = everything_js()?.display(),
    );
    let path = dir.path().join("tools.toml");
    std::fs::write(&path, manifest)?;
    let added = "everything__simulate-research-query";
    let stack = Stack::start(
        mock_llm::Scenario::new(vec![mock_llm::Turn::text("Listed.")]),
        runner_config(Some(path)),
        |config| config.tool_runners.refresh_interval = Duration::from_secs(1),
    )
    .await?;
    let offered = |body: &serde_json::Value| -> Vec<String> {
        body["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["function"]["name"].as_str().map(str::to_owned))
            .collect()
    };

    // Before the change: the runner and the model see the server's first list.
    let runner_names: Vec<String> = stack.runner.tools().await?.into_iter().map(|t| t.name).collect();
    assert!(
        runner_names.iter().any(|n| n == "everything__get-sum"),
        "{runner_names:?}"
    );
    assert!(!runner_names.iter().any(|n| n == added), "{runner_names:?}");
    stack.run(request("list", &[])).await?;
    let first = offered(stack.mock.requests().last().unwrap_or(&serde_json::Value::Null));
    assert!(first.iter().any(|n| n == "everything__get-sum"), "{first:?}");
    assert!(!first.iter().any(|n| n == added), "{first:?}");

    // After it: the runner lists the new tool, and the orchestrator's next refresh offers it.
    let limit = Duration::from_secs(20);
    testkit::wait::until("the runner to list the new tool", limit, || async {
        let names = stack.runner.tools().await.ok()?;
        names.iter().any(|t| t.name == added).then_some(())
    })
    .await?;
    testkit::wait::until("the orchestrator to offer the new tool", limit, || async {
        stack.run(request("list", &[])).await.ok()?;
        let names = offered(stack.mock.requests().last()?);
        names.iter().any(|n| n == added).then_some(())
    })
    .await?;
    Ok(())
}
