//! The example clients in other languages (Python through grpcio, TypeScript through grpc-js) and
//! the Python of the test virtualenv they run on; the A2A project's Python and JavaScript clients.

use std::path::PathBuf;

/// The Python of the test virtualenv, with grpcio and grpcio-tools.
pub fn python() -> anyhow::Result<PathBuf> {
    let python = crate::repo_root().join("target/tools/venv/bin/python");
    anyhow::ensure!(
        python.exists(),
        "{} is missing: ./scripts/test installs it (python3 -m venv, pip install -r examples/python/requirements.txt)",
        python.display()
    );
    Ok(python)
}

/// `python examples/python/SCRIPT` on the test virtualenv.
pub fn python_example(script: &str) -> anyhow::Result<tokio::process::Command> {
    let mut command = tokio::process::Command::new(python()?);
    command.arg(crate::repo_root().join("examples/python").join(script));
    Ok(command)
}

/// `node examples/typescript/dist/orchestrate.js`, built by `./scripts/test`.
pub fn typescript_example() -> anyhow::Result<tokio::process::Command> {
    let script = crate::repo_root().join("examples/typescript/dist/orchestrate.js");
    anyhow::ensure!(
        script.exists(),
        "{} is missing: ./scripts/test builds it (cd examples/typescript && npm ci && npm run build)",
        script.display()
    );
    let mut command = tokio::process::Command::new("node");
    command.arg(script);
    Ok(command)
}

/// `python services/orchestrator/tests/python/a2a_caller.py` on the A2A virtualenv (the A2A
/// project's `a2a-sdk`, installed by `./scripts/test`).
pub fn a2a_caller() -> anyhow::Result<tokio::process::Command> {
    a2a_python("a2a_caller.py")
}

/// `python services/orchestrator/tests/python/adk_caller.py` on the A2A virtualenv (Google ADK,
/// an agent framework that calls remote A2A agents, installed by `./scripts/test`).
pub fn adk_caller() -> anyhow::Result<tokio::process::Command> {
    a2a_python("adk_caller.py")
}

/// `python services/orchestrator/tests/python/SCRIPT` on the A2A virtualenv.
fn a2a_python(script: &str) -> anyhow::Result<tokio::process::Command> {
    let python = crate::repo_root().join("target/tools/a2a/bin/python");
    anyhow::ensure!(
        python.exists(),
        "{} is missing: ./scripts/test installs it (python3 -m venv, pip install a2a-sdk google-adk)",
        python.display()
    );
    let mut command = tokio::process::Command::new(python);
    command.arg(
        crate::repo_root()
            .join("services/orchestrator/tests/python")
            .join(script),
    );
    Ok(command)
}

/// `node services/orchestrator/tests/js/a2a_caller.mjs` (the A2A project's `@a2a-js/sdk`,
/// installed there by `./scripts/test`).
pub fn a2a_js_caller() -> anyhow::Result<tokio::process::Command> {
    let dir = crate::repo_root().join("services/orchestrator/tests/js");
    anyhow::ensure!(
        dir.join("node_modules/@a2a-js/sdk").exists(),
        "{} has no node_modules/@a2a-js/sdk: ./scripts/test installs it (npm ci there)",
        dir.display()
    );
    let mut command = tokio::process::Command::new("node");
    command.arg(dir.join("a2a_caller.mjs"));
    Ok(command)
}
