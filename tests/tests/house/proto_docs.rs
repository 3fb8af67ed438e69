//! `docs/proto.md`, the reference of the gRPC contracts, is what `testkit::proto_docs` renders from
//! the `.proto` comments now: a change to a contract's comments that is not carried into the docs
//! fails here. `UPDATE_PROTO_DOCS=1` rewrites the file instead.

use testkit::repo_root;

#[test]
fn the_proto_reference_in_docs_is_current() -> anyhow::Result<()> {
    let rendered = testkit::proto_docs::render(proto::FILE_DESCRIPTOR_SET, &["orchestrator.", "toolrunner."])?;
    for expected in [
        "### service `Orchestrator`",
        "| `Orchestrate` | `OrchestrateRequest` | stream `OrchestrateEvent` |",
        "### service `ToolRunner`",
        "| `metadata` | map<`string`, `string`> | 8 |",
        "### enum `RunStatus`",
        "(one of `event`)",
    ] {
        assert!(rendered.contains(expected), "the rendering lacks {expected:?}");
    }
    let path = repo_root().join("docs/proto.md");
    if std::env::var_os("UPDATE_PROTO_DOCS").is_some() {
        std::fs::write(&path, &rendered)?;
        return Ok(());
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        current == rendered,
        "docs/proto.md is stale: UPDATE_PROTO_DOCS=1 cargo test -p e2e --test house proto_docs rewrites it"
    );
    Ok(())
}
