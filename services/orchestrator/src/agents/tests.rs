use std::io::Write;

use super::*;

const REFUNDS: &str = r#"
[[agent]]
name = "refunds"
description = "Refunds orders once a person approves"
system = "You handle refunds."
tools = ["lookup_order", "refund"]
needs_approval = ["refund"]
principals = ["alice", "support-*"]
overridable = ["params"]
exit_tools = [{ name = "submit_report", description = "File the report" }]
[agent.limits]
max_turns = 4

[[agent]]
name = "open"
"#;

fn file(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(text.as_bytes()).unwrap();
    file
}

#[test]
fn an_agent_is_open_to_the_principals_it_names_and_to_everyone_without_authentication() {
    let f = file(REFUNDS);
    let agents = Agents::load(Some(f.path())).unwrap();
    let names =
        |p: &Principal| -> Vec<String> { agents.open_to(p).iter().map(|a| a.definition.name.clone()).collect() };
    assert_eq!(names(&Principal::unrestricted("support-7")), ["open", "refunds"]);
    assert_eq!(names(&Principal::unrestricted("bob")), ["open"]);
    assert_eq!(names(&Principal::anonymous()), ["open", "refunds"]);
    assert!(agents.for_caller("refunds", &Principal::unrestricted("bob")).is_none());
    assert!(agents.for_caller("nobody", &Principal::anonymous()).is_none());
    let refunds = agents.for_caller("refunds", &Principal::unrestricted("alice")).unwrap();
    assert_eq!(refunds.definition.limits.max_turns, Some(4));
    assert_eq!(refunds.version.len(), 16);
}

#[test]
fn a_changed_definition_has_a_new_version_and_a_bad_file_keeps_the_agents() {
    let f = file(REFUNDS);
    let agents = Agents::load(Some(f.path())).unwrap();
    let alice = Principal::unrestricted("alice");
    let before = agents.for_caller("refunds", &alice).unwrap().version.clone();
    assert_eq!(agents.reload_if_changed(), Ok(false));
    let open_before = agents.for_caller("open", &alice).unwrap().version.clone();
    std::fs::write(f.path(), REFUNDS.replace("max_turns = 4", "max_turns = 5")).unwrap();
    assert_eq!(agents.reload_if_changed(), Ok(true));
    let after = agents.for_caller("refunds", &alice).unwrap();
    assert_ne!(after.version, before);
    assert_eq!(after.definition.limits.max_turns, Some(5));
    assert_eq!(
        agents.for_caller("open", &alice).unwrap().version,
        open_before,
        "an agent that did not change keeps its version"
    );
    std::fs::write(f.path(), "[[agent]]\nname = \"x\"\nunknown = 1\n").unwrap();
    let refused = agents.reload_if_changed().unwrap_err();
    assert!(refused.contains("unknown field"), "{refused}");
    assert_eq!(
        agents
            .for_caller("refunds", &alice)
            .unwrap()
            .definition
            .limits
            .max_turns,
        Some(5)
    );
}

#[test]
fn bad_files_are_refused_naming_the_problem() {
    for (text, expected) in [
        ("[[agent]]\nname = \"a\"\n[[agent]]\nname = \"a\"\n", "defined twice"),
        ("[[agent]]\nname = \"\"\n", "agent name is empty"),
        ("[[agent]]\nname = \"a b\"\n", "agent name"),
        (
            "[[agent]]\nname = \"a\"\noverridable = [\"everything\"]\n",
            "unknown variant",
        ),
        ("[[agent]]\nname = \"a\"\nmodel = \"\"\n", "model is empty"),
        (
            "[[agent]]\nname = \"a\"\nexit_tools = [{ name = \"s\", parameters_json_schema = \"{\" }]\n",
            "not JSON",
        ),
        ("[[agent]]\nname = \"a\"\non_busy = \"wait\"\n", "unknown variant"),
    ] {
        let f = file(text);
        let refused = Agents::load(Some(f.path())).err().unwrap_or_default();
        assert!(refused.contains(expected), "{text}: {refused}");
        assert!(refused.contains("agents file"), "{refused}");
    }
    let missing = Agents::load(Some(Path::new("/no/such/agents.toml")))
        .err()
        .unwrap_or_default();
    assert!(missing.contains("/no/such/agents.toml"), "{missing}");
    assert!(Agents::load(None).unwrap().open_to(&Principal::anonymous()).is_empty());
}
