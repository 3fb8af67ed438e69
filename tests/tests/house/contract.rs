//! The contracts in `proto/` under buf (installed from npm by `./scripts/npm-tools`, which
//! `./scripts/test` runs): `buf lint` with the rules of `buf.yaml`, and `buf breaking` against
//! the parent commit (main's parent on main), so a change that would break existing callers
//! fails the tests. A deliberately broken copy shows the check bites.

use std::path::PathBuf;
use std::process::{Command, Output};

use testkit::repo_root;

type TestResult = anyhow::Result<()>;

fn buf() -> anyhow::Result<PathBuf> {
    let path = testkit::model_servers::cache_dir().join("npm-tools/node_modules/.bin/buf");
    anyhow::ensure!(
        path.exists(),
        "{} is missing: ./scripts/npm-tools installs it (./scripts/test runs it first)",
        path.display()
    );
    Ok(path)
}

fn run_buf(args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(buf()?).args(args).current_dir(repo_root()).output()?)
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn buf_lint_is_clean() -> TestResult {
    let output = run_buf(&["lint"])?;
    assert!(output.status.success(), "buf lint:\n{}", text(&output));
    Ok(())
}

#[test]
fn the_contracts_do_not_break_what_the_parent_commit_published() -> TestResult {
    // A shallow clone has no parent: then the working tree is checked against HEAD.
    let parent = Command::new("git")
        .args(["rev-parse", "--verify", "--quiet", "HEAD~1"])
        .current_dir(repo_root())
        .output()?;
    let against = if parent.status.success() {
        ".git#ref=HEAD~1,subdir=proto"
    } else {
        eprintln!("no parent commit (a shallow clone?): checking against HEAD");
        ".git#ref=HEAD,subdir=proto"
    };
    let output = run_buf(&["breaking", "--against", against])?;
    assert!(
        output.status.success(),
        "buf breaking --against {against}:\n{}",
        text(&output)
    );
    Ok(())
}

#[test]
fn a_renumbered_field_is_caught_as_breaking() -> TestResult {
    let copy = tempfile::tempdir()?;
    let proto = repo_root().join("proto");
    for file in ["orchestrator/v1/orchestrator.proto", "toolrunner/v1/tool_runner.proto"] {
        let target = copy.path().join(file);
        std::fs::create_dir_all(target.parent().ok_or_else(|| anyhow::anyhow!("no parent"))?)?;
        std::fs::copy(proto.join(file), target)?;
    }
    let file = copy.path().join("orchestrator/v1/orchestrator.proto");
    let source = std::fs::read_to_string(&file)?;
    let broken = source.replacen("string run_id = 1;", "string run_id = 99;", 1);
    anyhow::ensure!(broken != source, "the copy was not changed");
    std::fs::write(&file, broken)?;
    let copy_path = copy.path().to_string_lossy().into_owned();
    let against = proto.to_string_lossy().into_owned();
    let output = run_buf(&["breaking", &copy_path, "--against", &against])?;
    assert!(
        !output.status.success(),
        "a renumbered field passed:\n{}",
        text(&output)
    );
    assert!(text(&output).contains("run_id"), "{}", text(&output));
    Ok(())
}
