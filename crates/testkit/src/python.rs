//! The Python of the test virtualenv, for the tests that call the services through grpcio.

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
