//! Every shell session in docs/ is produced by running it. A session is a block of the docs
//! under `<!-- session: NAME -->`; [`sessions`] holds what each one types. This test starts the
//! services the session's prose describes (the stand-in model in this process, a tool-runner,
//! the orchestrator binary), runs each typed line with `sh -c` (`orchestrator` on `PATH` is the
//! binary under test, `ORCHESTRATOR_ENDPOINT` points at it) — a line started in one shell and
//! read until a marker, others typed "in another shell" meanwhile, then the first read to its end
//! — and compares what a terminal would show with the block, run ids, times and durations masked
//! and runs of spaces taken as one. `UPDATE_DOC_SESSIONS=1` writes the blocks instead.

use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use mock_llm::{MockLlm, Scenario};
use regex::Regex;
use testkit::Service;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

type TestResult = anyhow::Result<()>;

const BIN: &str = env!("CARGO_BIN_EXE_orchestrator");
/// How long one typed line may take.
const LINE_DEADLINE: Duration = Duration::from_secs(60);
/// Where a line typed in another shell is announced, as the docs align it.
const ASIDE: &str = "                                           # … in another shell:";
const GOES_ON: &str = "                                           # … and the first stream goes on:";

/// What a session types, in order.
enum Step {
    /// Shown as typed; the world runs its equivalent (the stand-in model it starts).
    Shown(&'static str),
    /// Typed and run to its end.
    Run(&'static str),
    /// Typed and run to its end; its lines come from commands run at once, in any order, so they
    /// are sorted.
    RunTogether(&'static str),
    /// Typed and read until a line holding the marker; it goes on while the next steps run in
    /// another shell.
    Start(&'static str, &'static str),
    /// The started line read to its end.
    Resume,
}

/// A session of the docs: the block it fills and what it types, on a world of its own.
struct Session {
    file: &'static str,
    name: &'static str,
    world: WorldKind,
    steps: Vec<Step>,
}

/// The services a session's prose describes.
enum WorldKind {
    /// The stand-in model playing the demo scenario, `submit_report` an exit tool.
    Demo,
    /// The stand-in model playing `crates/mock-llm/scenarios/conversation.json`.
    Conversation,
    /// The demo, with the tokens file of docs/operating.md's "Sharing the service".
    Shared,
}

fn sessions() -> Vec<Session> {
    use Step::*;
    vec![
        Session {
            file: "docs/running.md",
            name: "walkthrough",
            world: WorldKind::Demo,
            steps: vec![
                Run(
                    r#"orchestrator call --prompt "check the tools" --tool calculate --tool time_now --tool sleep --run-id first"#,
                ),
                Run("orchestrator call --attach first --after 1"),
                Run("orchestrator get first"),
                Run("orchestrator runs --status completed"),
            ],
        },
        Session {
            file: "docs/running.md",
            name: "approvals",
            world: WorldKind::Demo,
            steps: vec![
                Start(
                    r#"orchestrator call --prompt "check the tools" --tool calculate --tool time_now --tool sleep --needs-approval sleep --run-id refund-7"#,
                    "waits for approval",
                ),
                Run("orchestrator approvals"),
                Run("orchestrator decide refund-7 --approve call_1_2"),
                Resume,
            ],
        },
        Session {
            file: "docs/running.md",
            name: "cancel-after-turn",
            world: WorldKind::Conversation,
            steps: vec![
                Start(
                    r#"orchestrator call --prompt "Find flights to Oslo." --tool sleep --run-id oslo-1"#,
                    "⚙ sleep",
                ),
                Run("orchestrator cancel oslo-1 --after-turn"),
                Resume,
                Run("orchestrator get oslo-1"),
            ],
        },
        Session {
            file: "docs/running.md",
            name: "thread",
            world: WorldKind::Conversation,
            steps: vec![
                Shown("pkill -x mock-llm; mock-llm --scenarios crates/mock-llm/scenarios/conversation.json &"),
                Run(r#"orchestrator call --thread trip --prompt "Find flights to Oslo." --tool sleep"#),
                Run(r#"orchestrator call --thread trip --prompt "And a hotel there?" --tool sleep"#),
                Run("orchestrator thread trip"),
            ],
        },
        Session {
            file: "docs/running.md",
            name: "steering",
            world: WorldKind::Conversation,
            steps: vec![
                Start(
                    r#"orchestrator call --prompt "Find flights to Oslo." --tool sleep --run-id steer-1"#,
                    "⚙ sleep",
                ),
                Run(r#"orchestrator say steer-1 "Only direct flights, please.""#),
                Resume,
            ],
        },
        Session {
            file: "docs/operating.md",
            name: "sharing",
            world: WorldKind::Shared,
            steps: vec![
                Run(
                    r#"ORCHESTRATOR_TOKEN=support-secret orchestrator call --prompt "check the tools" --run-id s-1 | tail -n 1"#,
                ),
                RunTogether(
                    r#"for i in 5 6 7 8; do ORCHESTRATOR_TOKEN=billing-secret orchestrator call --prompt "check the tools" --run-id q-$i --label batch=8 | grep "run started" & done; wait"#,
                ),
                RunTogether("ORCHESTRATOR_TOKEN=billing-secret orchestrator runs --label batch=8"),
                Run("ORCHESTRATOR_TOKEN=billing-secret orchestrator runs --principal support"),
                Run("ORCHESTRATOR_TOKEN=ops-secret orchestrator usage --principal support --since 3h"),
            ],
        },
    ]
}

/// The services of a session, and the environment its shell lines run in.
struct World {
    _orchestrator: Service,
    _llm: MockLlm,
    /// `orchestrator` on `PATH`, and the tokens file.
    dir: tempfile::TempDir,
    endpoint: String,
}

impl World {
    async fn start(kind: &WorldKind) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        std::os::unix::fs::symlink(BIN, dir.path().join("orchestrator"))?;
        let scenario = match kind {
            WorldKind::Demo | WorldKind::Shared => Scenario::demo(),
            WorldKind::Conversation => {
                let path = concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/../../crates/mock-llm/scenarios/conversation.json"
                );
                serde_json::from_str(&std::fs::read_to_string(path)?)?
            }
        };
        let llm = MockLlm::start(scenario).await?;
        let runner = testkit::helpers::tool_runner_in_process().await?;
        let mut flags = vec!["--exit-tool".to_owned(), "submit_report".to_owned()];
        if let WorldKind::Shared = kind {
            let tokens = dir.path().join("tokens.toml");
            std::fs::write(&tokens, testkit::pki::tokens_toml(&SHARED_PRINCIPALS))?;
            flags.extend(["--auth-tokens".to_owned(), tokens.display().to_string()]);
        }
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let orchestrator = testkit::runs::orchestrator(BIN, (&llm.base_url(), &runner), None, &flags).await?;
        let endpoint = format!("http://{}", orchestrator.grpc);
        Ok(Self {
            _orchestrator: orchestrator,
            _llm: llm,
            dir,
            endpoint,
        })
    }

    /// `sh -c LINE`, its stderr joined to its stdout as a terminal shows them.
    fn shell(&self, line: &str) -> anyhow::Result<Command> {
        let path = format!("{}:{}", self.dir.path().display(), std::env::var("PATH")?);
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!("exec 2>&1; {line}"))
            .env("PATH", path)
            .env("ORCHESTRATOR_ENDPOINT", &self.endpoint)
            .env("ORCHESTRATOR_METRICS_LISTEN", "off")
            .env_remove("ORCHESTRATOR_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        Ok(command)
    }
}

/// The principals of docs/operating.md's tokens file: `(name, token, its lines)`.
const SHARED_PRINCIPALS: [(&str, &str, &str); 3] = [
    ("billing", "billing-secret", "max_runs = 2\nmax_queued = 20"),
    ("support", "support-secret", "max_runs = 8\nweight = 3"),
    ("ops", "ops-secret", "roles = [\"operator\"]"),
];

/// A line typed and started, read so far.
struct Started {
    _child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Started {
    async fn start(world: &World, line: &str) -> anyhow::Result<Self> {
        let mut child = world.shell(line)?.spawn()?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        Ok(Self {
            _child: child,
            lines: BufReader::new(stdout).lines(),
        })
    }

    /// Reads lines into `shown` until one holds `marker` (`None`: to the end).
    async fn read_until(&mut self, shown: &mut Vec<String>, marker: Option<&str>) -> TestResult {
        let read = async {
            while let Some(line) = self.lines.next_line().await? {
                let found = marker.is_some_and(|m| line.contains(m));
                shown.push(line);
                if found {
                    return anyhow::Ok(());
                }
            }
            match marker {
                Some(marker) => anyhow::bail!("the output ended before a line holding {marker:?}"),
                None => Ok(()),
            }
        };
        tokio::time::timeout(LINE_DEADLINE, read)
            .await
            .map_err(|_| anyhow::anyhow!("no line holding {marker:?} within {LINE_DEADLINE:?}: {shown:#?}"))?
    }
}

/// What a terminal shows for `session`.
async fn play(session: &Session) -> anyhow::Result<Vec<String>> {
    let world = World::start(&session.world).await?;
    let mut shown = Vec::new();
    let mut started: Option<Started> = None;
    for step in &session.steps {
        match step {
            Step::Shown(line) => shown.push(format!("$ {line}")),
            Step::Run(line) | Step::RunTogether(line) => {
                if started.is_some() && !shown.iter().any(|l| l == ASIDE) {
                    shown.push(ASIDE.to_owned());
                }
                shown.push(format!("$ {line}"));
                let mut run = Started::start(&world, line).await?;
                let mut printed = Vec::new();
                run.read_until(&mut printed, None).await?;
                if let Step::RunTogether(_) = step {
                    printed.sort();
                }
                shown.extend(printed);
            }
            Step::Start(line, marker) => {
                shown.push(format!("$ {line}"));
                let mut run = Started::start(&world, line).await?;
                run.read_until(&mut shown, Some(marker)).await?;
                started = Some(run);
            }
            Step::Resume => {
                let mut run = started
                    .take()
                    .ok_or_else(|| anyhow::anyhow!("nothing started to resume"))?;
                shown.push(GOES_ON.to_owned());
                run.read_until(&mut shown, None).await?;
            }
        }
    }
    Ok(shown)
}

/// `text` with what differs from run to run masked: run ids, times, durations; runs of spaces
/// (table columns sized by them) as one; the results of calls run together in any order (each
/// comes as its call ends).
fn masked(text: &str) -> String {
    static SPACES: OnceLock<Option<Regex>> = OnceLock::new();
    let spaces = SPACES.get_or_init(|| Regex::new(" +").ok());
    let text = masked_values(text);
    let text = match spaces {
        Some(spaces) => spaces.replace_all(&text, " ").into_owned(),
        None => text,
    };
    let mut lines: Vec<&str> = text.lines().collect();
    let result = |line: &&&str| line.contains(" <duration> ✔") || line.contains(" <duration> ✘");
    let mut at = 0;
    while at < lines.len() {
        let run = lines[at..].iter().take_while(result).count();
        lines[at..at + run].sort_unstable();
        at += run.max(1);
    }
    lines.join("\n")
}

/// `text` with run ids, times and durations masked, its layout kept.
fn masked_values(text: &str) -> String {
    static RULES: OnceLock<Vec<(Regex, &'static str)>> = OnceLock::new();
    let rules = RULES.get_or_init(|| {
        [
            (r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f-]*…?", "<id>"),
            (r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z", "<time>"),
            (r"\b1\d{12}\b", "<unix ms>"),
            (r"\b\d+(\.\d+)?(ms|s|m|h)( \d+(ms|s))?\b", "<duration>"),
            (r"\b\d+ ms\b", "<duration>"),
        ]
        .into_iter()
        .filter_map(|(pattern, mask)| Regex::new(pattern).ok().map(|r| (r, mask)))
        .collect()
    });
    let mut text = text.to_owned();
    for (rule, mask) in rules {
        text = rule.replace_all(&text, *mask).into_owned();
    }
    text.lines().map(str::trim_end).collect::<Vec<_>>().join("\n")
}

/// Where two masked texts part, as a person reads it.
fn first_difference(documented: &str, printed: &str) -> String {
    let (documented, printed): (Vec<&str>, Vec<&str>) = (documented.lines().collect(), printed.lines().collect());
    let at = documented.iter().zip(&printed).take_while(|(d, p)| d == p).count();
    format!(
        "line {} (masked) reads\n  documented: {}\n  printed:    {}",
        at + 1,
        documented.get(at).unwrap_or(&"(nothing)"),
        printed.get(at).unwrap_or(&"(nothing)")
    )
}

/// The block of `doc` under `<!-- session: NAME -->`: its line range (inside the fence).
fn block(doc: &str, name: &str) -> anyhow::Result<std::ops::Range<usize>> {
    let lines: Vec<&str> = doc.lines().collect();
    let marker = format!("<!-- session: {name} -->");
    let at = lines
        .iter()
        .position(|l| l.trim() == marker)
        .ok_or_else(|| anyhow::anyhow!("no {marker} in the doc"))?;
    let open = at + 1;
    anyhow::ensure!(
        lines.get(open).is_some_and(|l| l.starts_with("```")),
        "{marker} is not followed by a fenced block"
    );
    let close = (open + 1..lines.len())
        .find(|&i| lines[i].starts_with("```"))
        .ok_or_else(|| anyhow::anyhow!("the block under {marker} is not closed"))?;
    Ok(open + 1..close)
}

fn repo_file(relative: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative)
}

#[tokio::test]
async fn every_shell_session_in_the_docs_is_what_running_it_prints() -> TestResult {
    let update = std::env::var_os("UPDATE_DOC_SESSIONS").is_some();
    let mut differ = Vec::new();
    for session in sessions() {
        let shown = play(&session).await?;
        let path = repo_file(session.file);
        let doc = std::fs::read_to_string(&path)?;
        let range = block(&doc, session.name)?;
        let lines: Vec<&str> = doc.lines().collect();
        let documented = lines[range.clone()].join("\n");
        let printed = shown.join("\n");
        let same = match update {
            // Written again when anything but the values masked differs, layout included.
            true => masked_values(&documented) == masked_values(&printed),
            false => masked(&documented) == masked(&printed),
        };
        if same {
            continue;
        }
        if update {
            let mut written: Vec<String> = lines[..range.start].iter().map(|l| (*l).to_owned()).collect();
            written.extend(shown);
            written.extend(lines[range.end..].iter().map(|l| (*l).to_owned()));
            std::fs::write(&path, written.join("\n") + "\n")?;
        } else {
            differ.push(format!(
                "{} ({}): {}\n--- printed\n{printed}",
                session.name,
                session.file,
                first_difference(&masked(&documented), &masked(&printed)),
            ));
        }
    }
    assert!(
        differ.is_empty(),
        "sessions in the docs differ from what running them prints \
         (UPDATE_DOC_SESSIONS=1 cargo test -p orchestrator --test surfaces doc_sessions writes them):\n\n{}",
        differ.join("\n\n")
    );
    Ok(())
}

#[test]
fn the_masks_hide_only_what_differs_from_run_to_run() {
    assert_eq!(
        masked("  sleep 4004 ms ✔ {\"slept_ms\":4000}  expires in 59m 58s"),
        " sleep <duration> ✔ {\"slept_ms\":4000} expires in <duration>"
    );
    assert_eq!(
        masked("run 01a217ff-549f-… · COMPLETED · 2 turn(s) · 345 prompt"),
        "run <id> · COMPLETED · 2 turn(s) · 345 prompt"
    );
    assert_eq!(masked("q-7   COMPLETED  2026-11-27T17:07:28Z"), "q-7 COMPLETED <time>");
    assert_eq!(masked(r#"{"unix_ms":1795840927744}"#), r#"{"unix_ms":<unix ms>}"#);
    assert_ne!(masked("budget left 63"), masked("budget left 64"));
    assert_eq!(
        masked("  ⚙ b {}\n  time_now 3 ms ✔ {}\n  calculate 2 ms ✔ {}\n── turn 1 finished"),
        masked("  ⚙ b {}\n  calculate 4 ms ✔ {}\n  time_now 2 ms ✔ {}\n── turn 1 finished"),
    );
}
