//! The configuration reference (`docs/configuration.md`) against the real command lines: every
//! flag of `serve` (and its environment variable) is documented in its service's section, and
//! every flag the section's table names exists. A flag added without its row, or a row left behind
//! by a renamed flag, fails here.

use std::collections::BTreeSet;

use clap::CommandFactory;

type TestResult = anyhow::Result<()>;

/// Where the configuration tables are.
const REFERENCE: &str = "docs/configuration.md";

/// The reference's text from the heading `start` to the heading `end` (or its end).
fn section(start: &str, end: Option<&str>) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(testkit::repo_root().join(REFERENCE))?;
    let from = text
        .find(start)
        .ok_or_else(|| anyhow::anyhow!("{REFERENCE} has no {start:?}"))?;
    let to = match end {
        Some(end) => text[from..]
            .find(end)
            .map(|i| from + i)
            .ok_or_else(|| anyhow::anyhow!("{REFERENCE} has no {end:?} after {start:?}"))?,
        None => text.len(),
    };
    Ok(text[from..to].to_owned())
}

/// The long flags and environment variables of `serve`.
fn serve_flags(command: &clap::Command) -> anyhow::Result<Vec<(String, Option<String>)>> {
    let serve = command
        .get_subcommands()
        .find(|c| c.get_name() == "serve")
        .ok_or_else(|| anyhow::anyhow!("no serve subcommand"))?;
    Ok(serve
        .get_arguments()
        .filter_map(|a| {
            let long = a.get_long()?;
            let env = a.get_env().map(|e| e.to_string_lossy().into_owned());
            Some((format!("--{long}"), env))
        })
        .filter(|(long, _)| long != "--help" && long != "--version")
        .collect())
}

/// The flags the section's configuration table (its first table) names in the first cell of its
/// rows.
fn table_flags(section: &str) -> BTreeSet<String> {
    section
        .lines()
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .filter_map(|line| line.strip_prefix("| "))
        .filter_map(|row| row.split(" | ").next())
        .flat_map(|cell| {
            cell.split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .filter_map(|code| code.split_whitespace().next().map(str::to_owned))
        .filter(|flag| flag.starts_with("--"))
        .collect()
}

/// Whether the section names `env`: in full, or as a `_SUFFIX` / `[_SUFFIX]` shorthand after
/// a variable that shares its prefix.
fn names_env(section: &str, env: &str) -> bool {
    if section.contains(env) {
        return true;
    }
    env.match_indices('_').any(|(i, _)| {
        let (prefix, suffix) = env.split_at(i);
        section.contains(prefix)
            && (section.contains(&format!("`{suffix}`")) || section.contains(&format!("[{suffix}]")))
    })
}

fn check(command: clap::Command, start: &str, end: Option<&str>) -> TestResult {
    let section = section(start, end)?;
    let flags = serve_flags(&command)?;
    let documented = table_flags(&section);
    let mut missing: Vec<String> = Vec::new();
    for (flag, env) in &flags {
        if !documented.contains(flag) {
            missing.push(format!("{flag} has no row"));
        }
        if let Some(env) = env
            && !names_env(&section, env)
        {
            missing.push(format!("{flag}: {env} is not named"));
        }
    }
    let real: BTreeSet<&str> = flags.iter().map(|(f, _)| f.as_str()).collect();
    for flag in &documented {
        if !real.contains(flag.as_str()) {
            missing.push(format!("{flag} is in the table but not a flag"));
        }
    }
    assert!(missing.is_empty(), "{REFERENCE} {start:?}:\n{}", missing.join("\n"));
    Ok(())
}

#[test]
fn every_orchestrator_flag_has_its_row_in_the_configuration_reference() -> TestResult {
    check(
        orchestrator::cli::Cli::command(),
        "## orchestrator",
        Some("## tool-runner"),
    )
}

#[test]
fn every_tool_runner_flag_has_its_row_in_the_configuration_reference() -> TestResult {
    check(tool_runner::cli::Cli::command(), "## tool-runner", None)
}
