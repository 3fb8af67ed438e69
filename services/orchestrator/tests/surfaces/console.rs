//! The console in a real browser: Debian's headless Chromium driven through its ChromeDriver
//! (WebDriver, with fantoccini), against two orchestrator replicas on NATS with the console on,
//! a tool-runner serving the refund MCP server, and the stand-in model. Controls are found as a
//! person finds them: by their label, their role and their name (never by a CSS class).
//!
//! A person signs in; sees a live run's text grow; approves a call waiting for approval and the
//! run completes; decides again on an approved call found in doubt (the page says it may or may
//! not have taken effect) and runs it again; answers a tool's question, first with a value its schema refuses (the refusal
//! shown), then a good one; keeps following a run whose replica is SIGKILLed while it runs; does
//! not see another principal's run, whose page says "not found"; and a POST without the CSRF
//! token is refused. `UPDATE_SCREENSHOTS=1` writes each page's screenshot into docs/console/.

use std::process::Stdio;
use std::time::Duration;

use fantoccini::{Client as Browser, Locator};
use mock_llm::{MockLlm, Scenario, Scenarios, Step, Turn};
use orchestrator_client::{Client, ClientBuilder, RunRequest, RunStream};
use proto::orchestrator::v1 as pb;
use serde_json::json;
use testkit::Service;
use testkit::nats::Nats;
use tokio::process::{Child, Command};

type TestResult = anyhow::Result<()>;

const BIN: &str = env!("CARGO_BIN_EXE_orchestrator");
/// How long a page may take to show what a step waits for.
const PAGE_LIMIT: Duration = Duration::from_secs(30);
const ALICE: &str = "alice-token";
const BOB: &str = "bob-token";

/// The stand-in model's scenarios, by the model a run asks for.
fn scenarios() -> Scenarios {
    let mut counting = Turn::default();
    for word in ["One", "two", "three", "four", "five", "six", "seven", "eight"] {
        counting = counting
            .then(Step::Text {
                text: format!("{word}, "),
                chunk_chars: None,
            })
            .then(Step::Delay { ms: 500 });
    }
    let named = [
        (
            "counting",
            Scenario::new(vec![counting.then(Step::Text {
                text: "done.".into(),
                chunk_chars: None,
            })]),
        ),
        (
            "approve",
            Scenario::new(vec![
                Turn::text("Sleeping a little.\n").then(Step::call("sleep", json!({"ms": 10}))),
                Turn::text("Slept."),
            ]),
        ),
        (
            "ask",
            Scenario::new(vec![
                Turn::text("Booking the return.\n").then(Step::call("shop__return_items", json!({"order": "R-7"}))),
                Turn::text("Booked."),
            ]),
        ),
        (
            "lasting",
            Scenario::new(vec![Turn::text("Thinking.").then(Step::Delay { ms: 60_000 })]),
        ),
        (
            "charge",
            Scenario::new(vec![
                Turn::text("Charging.\n").then(Step::call("charge", json!({}))),
                Turn::text("Charged."),
            ]),
        ),
        (
            "nap",
            Scenario::new(vec![
                Turn::text("Resting.\n").then(Step::call("sleep", json!({"ms": 4000}))),
                Turn::text("Rested."),
            ]),
        ),
    ];
    Scenarios {
        default: Scenario::new(vec![Turn::text("Hello.")]),
        named: named.into_iter().map(|(n, s)| (n.to_owned(), s)).collect(),
    }
}

/// Two replicas on NATS with the console on, sharing a session secret, and what they run on.
struct World {
    replicas: Vec<Option<Service>>,
    consoles: Vec<String>,
    /// The tool-runner's address.
    runner: String,
    _llm: MockLlm,
    nats: Nats,
    dir: tempfile::TempDir,
}

impl World {
    /// The world, the replicas given `flags` too.
    async fn start_with(flags: &[&str]) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let tokens = dir.path().join("tokens.toml");
        std::fs::write(
            &tokens,
            testkit::pki::tokens_toml(&[("alice", ALICE, ""), ("bob", BOB, "")]),
        )?;
        let key = dir.path().join("session.key");
        std::fs::write(&key, "a-console-session-secret-of-the-tests-0123456789")?;
        let manifest = dir.path().join("tools.toml");
        // `charge`: a command tool with side effects, not declared idempotent.
        let charge =
            "[[tool]]\nname = \"charge\"\ndescription = \"charges\"\nargv = [\"sh\", \"-c\", \"printf '{}'\"]\n";
        std::fs::write(
            &manifest,
            testkit::mcp_servers::refund_server_table(&dir.path().join("refunds.log"))? + charge,
        )?;
        let nats = Nats::start().await?;
        let mut runner = tool_runner::Config {
            tools_manifest: Some(manifest),
            ..tool_runner::Config::default()
        };
        runner.fence.run_store = Some(nats.url());
        let runner = testkit::helpers::tool_runner_in_process_with(runner).await?;
        let llm = MockLlm::start(scenarios()).await?;
        let mut replicas = Vec::new();
        let mut consoles = Vec::new();
        for _ in 0..2 {
            let mut command = testkit::on_nats(
                testkit::orchestrator_command(BIN, &llm.base_url(), &runner),
                &nats.url(),
            );
            command.args(["--run-store-lease", "2s", "--auth-tokens"]).arg(&tokens);
            command
                .args(["--console-listen", "127.0.0.1:0", "--console-session-key-file"])
                .arg(&key)
                .args(flags);
            let replica = Service::orchestrator(command).await?;
            let console = replica
                .address_logged("console serving")
                .ok_or_else(|| anyhow::anyhow!("the replica did not log its console's address"))?;
            consoles.push(console);
            replicas.push(Some(replica));
        }
        Ok(Self {
            replicas,
            consoles,
            runner,
            _llm: llm,
            nats,
            dir,
        })
    }

    /// Makes call `call_id` of `run_id` (epoch 1) one a runner started and then went away from,
    /// its outcome never kept: what the runner finds when the call reaches it.
    /// Waits until the tool-runner serves (its required MCP server connected: a runner that
    /// (re)connects to it is NOT_SERVING, and a call to its tools is refused meanwhile).
    async fn until_the_runner_serves(&self) -> TestResult {
        use tonic_health::pb::health_check_response::ServingStatus;
        testkit::wait::until("the tool-runner to serve", Duration::from_secs(60), || async {
            let channel = tonic::transport::Channel::from_shared(self.runner.clone())
                .ok()?
                .connect()
                .await
                .ok()?;
            let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
            let asked = tonic_health::pb::HealthCheckRequest {
                service: tool_runner::server::SERVICE_NAME.into(),
            };
            let status = health.check(asked).await.ok()?.into_inner().status();
            (status == ServingStatus::Serving).then_some(())
        })
        .await
    }

    async fn left_in_doubt(&self, run_id: &str, call_id: &str) -> TestResult {
        use tool_runner::record::{Begun, Call, CallRecords};
        let client = async_nats::connect(self.nats.url()).await?;
        let js = shared::jetstream::JetStream::handle(&shared::jetstream::nats::context(client, None));
        let fence = tool_runner::fence::RunFence::over(js, "orchestrator-runs", Duration::from_secs(1));
        let gone = CallRecords::new(std::sync::Arc::new(fence), "gone-runner", Duration::from_secs(3), 1024);
        gone.renew().await;
        let call = Call {
            run_id,
            call_id,
            round: None,
            epoch: 1,
            idempotent: false,
            rerun_in_doubt: false,
            wait: Duration::from_secs(1),
        };
        let begun = gone.begin(&call).await;
        anyhow::ensure!(
            matches!(begun, Begun::Run(_)),
            "the call's record was not started: {begun:?}"
        );
        gone.leave().await;
        Ok(())
    }

    /// A client of replica `i` with `token`.
    async fn client(&self, i: usize, token: &str) -> anyhow::Result<Client> {
        let replica = self.replicas[i]
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("replica {i} is gone"))?;
        Ok(ClientBuilder::new(format!("http://{}", replica.grpc))
            .token(token)
            .connect()
            .await?)
    }
}

/// Starts `request` on `client`, detached (the run goes on whatever its caller does); its stream.
async fn start(client: &Client, request: RunRequest) -> anyhow::Result<RunStream> {
    Ok(client.orchestrate(request.detached(true)).await?)
}

/// Waits until `run_id`, read by `client`, has `status`.
async fn until_status(client: &Client, run_id: &str, status: pb::RunStatus) -> TestResult {
    testkit::wait::until(&format!("run {run_id} {status:?}"), Duration::from_secs(60), || async {
        let run = client.get_run(run_id).await.ok()?;
        (run.status() == status).then_some(())
    })
    .await
}

/// Debian's ChromeDriver on a free port, and a headless Chromium session through it.
struct Chrome {
    driver: Child,
    browser: Browser,
    _profile: tempfile::TempDir,
}

impl Chrome {
    async fn start() -> anyhow::Result<Self> {
        Self::start_with(&[]).await
    }

    /// A session whose Chromium takes `extra` arguments besides the usual ones.
    async fn start_with(extra: &[&str]) -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| anyhow::anyhow!("chromedriver (Debian's chromium-driver; ./scripts/test installs it): {e}"))?;
        let profile = tempfile::tempdir()?;
        let mut capabilities = serde_json::Map::new();
        let mut args: Vec<String> = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1280,900",
        ]
        .iter()
        .chain(extra)
        .map(|a| (*a).to_owned())
        .collect();
        args.push(format!("--user-data-dir={}", profile.path().display()));
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({ "binary": "/usr/bin/chromium", "args": args }),
        );
        let url = format!("http://127.0.0.1:{port}");
        let browser = testkit::wait::until("ChromeDriver to take a session", Duration::from_secs(30), || async {
            // ChromeDriver on loopback speaks plain HTTP.
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            let mut builder = fantoccini::ClientBuilder::new(connector);
            builder.capabilities(capabilities.clone()).connect(&url).await.ok()
        })
        .await?;
        Ok(Self {
            driver,
            browser,
            _profile: profile,
        })
    }

    async fn stop(mut self) -> TestResult {
        self.browser.close().await?;
        self.driver.kill().await?;
        Ok(())
    }
}

/// XPath of a string (no quote inside the tests' names).
fn quoted(text: &str) -> String {
    format!("'{text}'")
}

/// The control labelled `label` (a `<label for>` or one wrapping it, or an `aria-label`).
fn labelled(label: &str) -> String {
    let l = quoted(label);
    format!(
        "//*[@id=//label[normalize-space(text())={l}]/@for] | //label[normalize-space(text())={l}]//*[self::input or self::select or self::textarea] | //*[self::input or self::select or self::textarea][@aria-label={l}]"
    )
}

/// The button named `name`.
fn button(name: &str) -> String {
    format!("//button[normalize-space(.)={}]", quoted(name))
}

/// The region, group or form named `name` (its `aria-label`).
fn named(name: &str) -> String {
    format!("//*[@aria-label={}]", quoted(name))
}

/// Waits until the page has an element at `xpath`; it.
async fn find(browser: &Browser, xpath: &str) -> anyhow::Result<fantoccini::elements::Element> {
    let found = testkit::wait::until(&format!("the page to show {xpath}"), PAGE_LIMIT, || async {
        browser.find(Locator::XPath(xpath)).await.ok()
    })
    .await;
    if found.is_err() {
        // What the page showed instead, to tell why.
        let body = browser.find(Locator::XPath("//body")).await?.text().await?;
        return found.map_err(|e| anyhow::anyhow!("{e}; the page said:\n{body}"));
    }
    found
}

/// Waits until the page's text holds `text`.
/// Clicks the button `name` within `element`.
async fn press(element: &fantoccini::elements::Element, name: &str) -> TestResult {
    element
        .find(Locator::XPath(&format!(".{}", button(name))))
        .await?
        .click()
        .await?;
    Ok(())
}

async fn shows(browser: &Browser, text: &str) -> TestResult {
    testkit::wait::until(&format!("the page to say {text:?}"), PAGE_LIMIT, || async {
        let body = browser.find(Locator::XPath("//body")).await.ok()?.text().await.ok()?;
        body.contains(text).then_some(())
    })
    .await
}

/// Opens the console's page `page` (`#/runs` …).
async fn visit(browser: &Browser, console: &str, page: &str) -> TestResult {
    Ok(browser.goto(&format!("{console}/{page}")).await?)
}

/// The link to run `run_id` in the runs table.
fn listed(run_id: &str) -> String {
    format!("//table[@aria-label='Runs']//a[normalize-space(.)={}]", quoted(run_id))
}

/// The accessibility rules (WCAG 2 A and AA, contrast included) that axe-core — npm, installed by
/// `./scripts/test` — finds broken on the page `browser` shows now, each with where.
async fn accessibility_violations(browser: &Browser) -> anyhow::Result<Vec<String>> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/js/node_modules/axe-core/axe.min.js");
    let axe = std::fs::read_to_string(path).map_err(|e| {
        anyhow::anyhow!("{path} (./scripts/test installs it: npm ci in services/orchestrator/tests/js): {e}")
    })?;
    browser.execute(&format!("{axe}\nreturn true;"), vec![]).await?;
    let found = browser
        .execute_async(
            "const done = arguments[arguments.length - 1];
             axe.run(document, { runOnly: ['wcag2a', 'wcag2aa'] })
               .then((r) => done(r.violations.map((v) => `${v.id}: ${v.nodes.map((n) => `${n.target.join(' ')} (${n.any.concat(n.all).map((c) => c.message).join('; ')})`).join(', ')}`)))
               .catch((e) => done([`axe failed: ${e}`]));",
            vec![],
        )
        .await?;
    Ok(serde_json::from_value(found)?)
}

/// Asserts the page `browser` shows now passes the accessibility check.
async fn accessible(browser: &Browser, page: &str) -> TestResult {
    let violations = accessibility_violations(browser).await?;
    anyhow::ensure!(violations.is_empty(), "{page}: {violations:#?}");
    Ok(())
}

/// Writes the page's screenshot to docs/console/NAME.png under `UPDATE_SCREENSHOTS=1`.
async fn screenshot(browser: &Browser, name: &str) -> TestResult {
    let png = browser.screenshot().await?;
    anyhow::ensure!(png.starts_with(b"\x89PNG"), "a screenshot is a PNG");
    if std::env::var_os("UPDATE_SCREENSHOTS").is_some() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/console");
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(format!("{name}.png")), png)?;
    }
    Ok(())
}

#[tokio::test]
async fn a_person_watches_approves_and_answers_in_a_real_browser() -> TestResult {
    let agents = tempfile::tempdir()?;
    let agents_file = agents.path().join("agents.toml");
    std::fs::write(
        &agents_file,
        "[[agent]]\nname = \"counter\"\noverridable = [\"model\"]\n",
    )?;
    let agents_flag = agents_file.display().to_string();
    let receiver = testkit::receiver::Receiver::start().await?;
    let port = receiver.addr.port().to_string();
    let flags = [
        "--agents",
        &agents_flag,
        "--webhook-allow-cidr",
        "127.0.0.0/8",
        "--webhook-allow-port",
        &port,
    ];
    let mut world = World::start_with(&flags).await?;
    let chrome = Chrome::start().await?;
    let browser = &chrome.browser;
    let (alice_a, alice_b, bob_a) = (
        world.client(0, ALICE).await?,
        world.client(1, ALICE).await?,
        world.client(0, BOB).await?,
    );
    let console = format!("http://{}", world.consoles[1]);
    let hook = alice_a
        .create_webhook(pb::CreateWebhookRequest {
            url: receiver.url(),
            events: vec!["run.finished".into(), "run.awaiting".into()],
            ..Default::default()
        })
        .await?;

    // Sign in, on replica b's console.
    browser.goto(&console).await?;
    let token = find(browser, &labelled("Token")).await?;
    screenshot(browser, "sign-in").await?;
    accessible(browser, "sign-in").await?;
    // The check finds what it looks for: an image without a text alternative fails it.
    let add = "const i = document.createElement('img'); i.src = 'data:,'; i.id = 'no-alt'; document.body.append(i); return true;";
    browser.execute(add, vec![]).await?;
    let found = accessibility_violations(browser).await?;
    assert!(found.iter().any(|v| v.starts_with("image-alt")), "{found:?}");
    browser
        .execute("document.getElementById('no-alt').remove(); return true;", vec![])
        .await?;
    token.send_keys("not-a-token").await?;
    find(browser, &button("Sign in")).await?.click().await?;
    shows(browser, "not valid").await?;
    let token = find(browser, &labelled("Token")).await?;
    token.clear().await?;
    token.send_keys(ALICE).await?;
    find(browser, &button("Sign in")).await?.click().await?;
    shows(browser, "Signed in as alice").await?;

    // A live run's text grows in its page.
    let _counting = start(
        &alice_a,
        RunRequest::prompt("Count.")
            .run_id("counting-1")
            .model("counting")
            .agent("counter")
            .thread("support-42"),
    )
    .await?;
    visit(browser, &console, "#/runs/counting-1").await?;
    let text_of_turn = || async {
        let turn = browser.find(Locator::XPath(&named("Turn 1"))).await.ok()?;
        turn.text().await.ok()
    };
    let first = testkit::wait::until("turn 1's text", PAGE_LIMIT, || async {
        text_of_turn().await.filter(|t| t.contains("One,"))
    })
    .await?;
    testkit::wait::until("turn 1's text to grow", PAGE_LIMIT, || async {
        text_of_turn().await.filter(|t| t.len() > first.len() + 4)
    })
    .await?;
    screenshot(browser, "run").await?;
    shows(browser, "COMPLETED").await?;
    shows(browser, "Agent counter · version").await?;

    // The runs page lists it; the thread page shows its messages.
    visit(browser, &console, "#/runs").await?;
    let row = find(browser, &format!("{}/ancestor::tr", listed("counting-1"))).await?;
    let row = row.text().await?;
    assert!(row.contains("counter"), "the runs page shows the run's agent: {row}");
    let asked = find(browser, &format!("{}/ancestor::tr/td[last()]", listed("counting-1"))).await?;
    let asked = asked.attr("title").await?.unwrap_or_default();
    assert_eq!(asked, "Count.", "the runs page shows what a run was asked");
    screenshot(browser, "runs").await?;
    visit(browser, &console, "#/threads/support-42").await?;
    shows(browser, "One, two").await?;
    screenshot(browser, "thread").await?;

    // A call waiting for approval shows up, is approved in the page, and the run completes.
    let _approve = start(
        &alice_a,
        RunRequest::prompt("Sleep.")
            .run_id("approve-1")
            .model("approve")
            .tool("sleep")
            .needs_approval("sleep")
            .label("ticket", "T-1"),
    )
    .await?;
    visit(browser, &console, "#/waiting").await?;
    let waiting = find(browser, &named("sleep in run approve-1")).await?;
    // What a person decides on: what the run was asked, its labels, what the model said.
    let card = waiting.text().await?;
    for told in ["Asked: Sleep.", "Labels: ticket=T-1", "Sleeping a little."] {
        assert!(card.contains(told), "the waiting card shows {told:?}: {card}");
    }
    screenshot(browser, "waiting").await?;
    accessible(browser, "waiting").await?;
    press(&waiting, "Approve").await?;
    until_status(&alice_b, "approve-1", pb::RunStatus::Completed).await?;
    // The decision is an event of the run: its page says who approved, and after how long.
    visit(browser, &console, "#/runs/approve-1").await?;
    shows(browser, "Approved by alice after").await?;

    // An approved call found in doubt (a runner started it and went away) comes back to a person:
    // the page says it may or may not have taken effect, and running it again completes the run.
    let _charge = start(
        &alice_a,
        RunRequest::prompt("Charge.")
            .run_id("charge-1")
            .model("charge")
            .tool("charge")
            .needs_approval("charge"),
    )
    .await?;
    until_status(&alice_b, "charge-1", pb::RunStatus::AwaitingApproval).await?;
    let pending = alice_b.get_run("charge-1").await?.pending_approvals;
    let call_id = pending.first().map(|p| p.call_id.clone()).unwrap_or_default();
    world.left_in_doubt("charge-1", &call_id).await?;
    visit(browser, &console, "#/waiting").await?;
    press(&find(browser, &named("charge in run charge-1")).await?, "Approve").await?;
    let doubt = find(browser, &named("charge in run charge-1, in doubt")).await?;
    shows(browser, "may or may not have taken effect").await?;
    screenshot(browser, "in-doubt").await?;
    press(&doubt, "Run again").await?;
    until_status(&alice_b, "charge-1", pb::RunStatus::Completed).await?;
    let charged = alice_b.get_run("charge-1").await?;
    anyhow::ensure!(
        charged.tool_calls.iter().all(|c| c.ok && !c.in_doubt),
        "the call ran again: {:?}",
        charged.tool_calls
    );

    // A tool's question: a value its schema refuses is refused in the page, a good one taken.
    world.until_the_runner_serves().await?;
    let _ask = start(
        &alice_a,
        RunRequest::prompt("Return it.")
            .run_id("ask-1")
            .model("ask")
            .tool("shop__return_items"),
    )
    .await?;
    visit(browser, &console, "#/runs/ask-1").await?;
    let quantity = find(browser, &labelled("Quantity")).await?;
    quantity.send_keys("9").await?;
    find(browser, &button("Answer")).await?.click().await?;
    shows(browser, "maximum").await?;
    until_status(&alice_b, "ask-1", pb::RunStatus::AwaitingInput).await?;
    let quantity = find(browser, &labelled("Quantity")).await?;
    quantity.clear().await?;
    quantity.send_keys("2").await?;
    find(browser, &button("Answer")).await?.click().await?;
    until_status(&alice_b, "ask-1", pb::RunStatus::Completed).await?;
    shows(browser, "2 item(s) of order R-7 booked").await?;

    // The run page keeps following a run whose replica is SIGKILLed while its call runs.
    let _nap = start(
        &alice_a,
        RunRequest::prompt("Rest.").run_id("nap-1").model("nap").tool("sleep"),
    )
    .await?;
    visit(browser, &console, "#/runs/nap-1").await?;
    find(browser, &named("Tool call sleep call_1_0")).await?;
    if let Some(a) = world.replicas[0].take() {
        a.kill().await?;
    }
    shows(browser, "Rested.").await?;
    shows(browser, "COMPLETED").await?;

    // Another principal's run: not listed, and its page says "not found".
    let bob_b = world.client(1, BOB).await?;
    drop(bob_a);
    bob_b.run(RunRequest::prompt("Hi.").run_id("bob-1")).await?;
    visit(browser, &console, "#/runs").await?;
    find(browser, &listed("counting-1")).await?;
    let listed = browser
        .find_all(Locator::XPath("//a[normalize-space(.)='bob-1']"))
        .await?;
    assert!(listed.is_empty(), "another principal's run is not listed");
    visit(browser, &console, "#/runs/bob-1").await?;
    find(browser, "//h1[normalize-space(.)='Not found']").await?;

    // The webhook's deliveries: each of alice's finished runs, and her call that waited for a
    // person, delivered.
    testkit::wait::until_sync("a delivery", Duration::from_secs(30), || {
        receiver.received().into_iter().next()
    })
    .await?;
    let awaiting = receiver
        .received()
        .into_iter()
        .find(|r| r.json()["type"] == "run.awaiting");
    let awaiting = awaiting.map(|r| r.json()["data"].clone()).unwrap_or_default();
    assert_eq!(awaiting["waits_for"], "approval", "{awaiting}");
    assert_eq!(awaiting["status"], "AWAITING_APPROVAL", "{awaiting}");
    visit(browser, &console, "#/webhooks").await?;
    find(
        browser,
        &format!("//table[@aria-label='Webhooks']//a[normalize-space(.)='{}']", hook.id),
    )
    .await?;
    find(
        browser,
        "//table[@aria-label='Deliveries']//tr[td[normalize-space(.)='run.finished'] and td[normalize-space(.)='delivered'] and td[normalize-space(.)='204']]",
    )
    .await?;
    screenshot(browser, "webhooks").await?;
    accessible(browser, "webhooks").await?;

    // Usage, then a POST without the CSRF token, refused.
    visit(browser, &console, "#/usage").await?;
    find(
        browser,
        "//table[@aria-label='Usage']//th[starts-with(normalize-space(.), 'total')]",
    )
    .await?;
    screenshot(browser, "usage").await?;
    accessible(browser, "usage").await?;
    let status = browser
        .execute(
            "return fetch('/api/rpc/ListRuns', {method: 'POST', headers: {'content-type': 'application/json'}, body: '{}'}).then(r => r.status)",
            vec![],
        )
        .await?;
    assert_eq!(status, json!(403), "a POST without the CSRF token");

    // The session cookie is out of the page's reach, every answer carries the policy, and the
    // token was never logged.
    assert_eq!(browser.execute("return document.cookie", vec![]).await?, json!(""));
    let policy = browser
        .execute(
            "return fetch('/').then(r => r.headers.get('content-security-policy'))",
            vec![],
        )
        .await?;
    let policy = policy.as_str().unwrap_or_default();
    assert!(
        policy.contains("script-src 'self'") && !policy.contains("unsafe-inline"),
        "{policy}"
    );
    let replica = world.replicas[1]
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("replica b is gone"))?;
    assert!(replica.logged("console sign-in", Duration::from_secs(5)).await);
    assert!(
        !replica.logs().iter().any(|l| l.contains(ALICE)),
        "the token is never logged"
    );

    // The pages of a run, the runs and a thread pass the check too (looked at here, once the
    // flows above are done, so the check's seconds do not stretch them).
    for page in ["#/runs", "#/runs/approve-1", "#/threads/support-42"] {
        visit(browser, &console, page).await?;
        find(browser, "//h1").await?;
        accessible(browser, page).await?;
    }
    chrome.stop().await?;

    // Dark mode passes the same check (contrast included), in a browser that prefers it.
    let dark = Chrome::start_with(&["--force-dark-mode", "--blink-settings=preferredColorScheme=0"]).await?;
    let browser = &dark.browser;
    browser.goto(&console).await?;
    let prefers = "return matchMedia('(prefers-color-scheme: dark)').matches";
    assert_eq!(
        browser.execute(prefers, vec![]).await?,
        json!(true),
        "the browser prefers dark"
    );
    find(browser, &labelled("Token")).await?.send_keys(ALICE).await?;
    find(browser, &button("Sign in")).await?.click().await?;
    shows(browser, "Signed in as alice").await?;
    for page in ["#/runs", "#/runs/approve-1", "#/waiting", "#/webhooks", "#/usage"] {
        visit(browser, &console, page).await?;
        find(browser, "//h1").await?;
        accessible(browser, &format!("{page} in dark mode")).await?;
    }
    dark.stop().await
}

/// A request to `path` with `method`, sent to the name `host`, from `origin` (if any), with a
/// JSON `body`.
fn request(method: &str, path: &str, host: &str, origin: Option<&str>, body: &str) -> String {
    let origin = origin.map(|o| format!("Origin: {o}\r\n")).unwrap_or_default();
    format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{origin}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// The console answers only to its own names (a page whose domain is rebound to the console's
/// address is refused, its POSTs too), takes changes only from its own origin, serves no one on a
/// network address without authentication unless told to (and then says so loudly), and behind
/// `--console-public-url https://…` its cookie is `Secure`, `__Host-` and answers carry HSTS.
#[tokio::test]
async fn the_console_answers_only_its_own_names_and_origins() -> TestResult {
    let llm = MockLlm::start(Scenario::new(vec![Turn::text("Done.")])).await?;
    let runner = testkit::helpers::tool_runner_in_process().await?;
    let start = |flags: &[&str]| {
        let mut command = testkit::orchestrator_command(BIN, &llm.base_url(), &runner);
        command.args(flags);
        Service::orchestrator(command)
    };

    // Without authentication, on loopback, behind a public HTTPS name.
    let public = "https://console.example.com";
    let open = start(&["--console-listen", "127.0.0.1:0", "--console-public-url", public]).await?;
    let address = open
        .address_logged("console serving")
        .ok_or_else(|| anyhow::anyhow!("no console address logged"))?;
    let sign_in = |host: &str, origin: Option<&str>| request("POST", "/api/session", host, origin, "{}");
    let (status, _, _) = exchange(
        &address,
        request("GET", "/api/session", "attacker.example:80", None, ""),
    )
    .await?;
    assert_eq!(status, 421, "a rebound name reads nothing");
    let (status, _, _) = exchange(
        &address,
        sign_in("attacker.example:80", Some("http://attacker.example:80")),
    )
    .await?;
    assert_eq!(status, 421, "a rebound name signs no one in");
    for origin in [None, Some("http://attacker.example")] {
        let (status, _, _) = exchange(&address, sign_in(&address, origin)).await?;
        assert_eq!(status, 403, "a POST from {origin:?}");
    }
    let (status, head, _) = exchange(&address, sign_in(&address, Some(&format!("http://{address}")))).await?;
    assert_eq!(status, 200, "{head}");
    let (status, head, _) = exchange(&address, sign_in("console.example.com", Some(public))).await?;
    assert_eq!(status, 200, "{head}");
    let head = head.to_ascii_lowercase();
    assert!(
        head.contains("set-cookie: __host-orchestrator-console=") && head.contains("; secure"),
        "{head}"
    );
    assert!(head.contains("strict-transport-security: max-age="), "{head}");
    open.stop().await?;

    // On a network address without authentication: refused at start, unless told to.
    let mut refused = testkit::orchestrator_command(BIN, &llm.base_url(), &runner);
    refused
        .args(["--listen", "127.0.0.1:0", "--console-listen", "0.0.0.0:0"])
        .env("ORCHESTRATOR_METRICS_LISTEN", "off");
    let output = tokio::time::timeout(Duration::from_secs(30), refused.output()).await??;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--console-allow-unauthenticated"), "{stderr}");
    let told = start(&["--console-listen", "0.0.0.0:0", "--console-allow-unauthenticated"]).await?;
    assert!(told.logged("THE CONSOLE IS OPEN", Duration::from_secs(10)).await);
    told.stop().await?;
    Ok(())
}

/// The session cookie (`name=value`) and CSRF token a sign-in answer carries.
fn session_of(head: &str, body: &str) -> anyhow::Result<(String, String)> {
    let cookie = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .starts_with("set-cookie:")
                .then(|| l[11..].trim().to_owned())
        })
        .and_then(|c| c.split(';').next().map(str::to_owned))
        .ok_or_else(|| anyhow::anyhow!("no cookie: {head}"))?;
    let csrf = serde_json::from_str::<serde_json::Value>(body)?["csrf"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    Ok((cookie, csrf))
}

/// One HTTP/1.1 exchange with the console at `address`, its whole answer read: status, head,
/// body.
async fn exchange(address: &str, request: String) -> anyhow::Result<(u16, String, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await??;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    Ok((status_of(head), head.to_owned(), body.to_owned()))
}

/// The status an answer's head (or its start) carries (0: none).
fn status_of(head: &str) -> u16 {
    head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// Sends `request` to `address` and reads until the answer's head arrived: the connection, and
/// what it read (the head, maybe more).
async fn until_the_head(address: &str, request: &str) -> anyhow::Result<(tokio::net::TcpStream, Vec<u8>)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut read = Vec::new();
    let mut buf = [0u8; 4096];
    while !read.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await??;
        anyhow::ensure!(n > 0, "closed before the head");
        read.extend_from_slice(&buf[..n]);
    }
    Ok((stream, read))
}

/// The status of the answer to `request`, read from its head alone (a page's stream is left at
/// once: it gives its slot back).
async fn head_status(address: &str, request: &str) -> anyhow::Result<u16> {
    let (_, head) = until_the_head(address, request).await?;
    Ok(status_of(&String::from_utf8_lossy(&head)))
}

/// A request carrying `cookie` (and `csrf` and an empty JSON body on a POST), from the console's
/// own origin.
fn as_session(method: &str, path: &str, address: &str, (cookie, csrf): (&str, &str)) -> String {
    let body = match method {
        "POST" => "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
        _ => "\r\n",
    };
    format!(
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nOrigin: http://{address}\r\nCookie: {cookie}\r\nx-csrf-token: {csrf}\r\nConnection: close\r\n{body}"
    )
}

/// Opens a live run page: once its head arrived, its status; then, read until the stream ends
/// (or `limit` passes), what it sent.
async fn open_page(
    address: String,
    request: String,
    limit: Duration,
) -> anyhow::Result<(u16, tokio::task::JoinHandle<anyhow::Result<String>>)> {
    use tokio::io::AsyncReadExt;
    let (mut stream, mut answer) = until_the_head(&address, &request).await?;
    let status = status_of(&String::from_utf8_lossy(&answer));
    let rest = tokio::spawn(async move {
        tokio::time::timeout(limit, stream.read_to_end(&mut answer)).await??;
        Ok(String::from_utf8_lossy(&answer).into_owned())
    });
    Ok((status, rest))
}

/// Sessions end where people expect: signing out on one replica ends the session on the other,
/// and a live run page open there closes within one keep-alive (`broke`, UNAUTHENTICATED); so
/// does one whose token is taken out of the tokens file. One session follows at most
/// `--console-max-streams-per-session` pages; one address signs in at most
/// `--console-sign-ins-per-minute` times a minute; a client that sends its request head slowly is
/// cut off after `--console-header-timeout`.
#[tokio::test]
async fn sign_out_and_token_removal_end_sessions_and_their_live_pages_on_every_replica() -> TestResult {
    let world = World::start_with(&[
        "--tls-reload-interval",
        "1s",
        "--console-keep-alive",
        "1s",
        "--console-max-streams-per-session",
        "1",
        "--console-sign-ins-per-minute",
        "4",
        "--console-header-timeout",
        "1s",
    ])
    .await?;
    let tokens = world.dir.path().join("tokens.toml");
    let consoles = &world.consoles;
    let (a, b) = (consoles[0].clone(), consoles[1].clone());
    let sign_in = |address: &str, token: &str| {
        let body = format!("{{\"token\": \"{token}\"}}");
        format!(
            "POST /api/session HTTP/1.1\r\nHost: {address}\r\nOrigin: http://{address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let client = world.client(0, ALICE).await?;
    let _run = start(&client, RunRequest::prompt("think").model("lasting").run_id("live-1")).await?;
    until_status(&client, "live-1", pb::RunStatus::Running).await?;

    // Signed in on a, following the run on b; a second page of the same session is refused.
    let (status, head, body) = exchange(&a, sign_in(&a, ALICE)).await?;
    assert_eq!(status, 200, "{head}");
    let (cookie, csrf) = session_of(&head, &body)?;
    let page = as_session("GET", "/api/runs/live-1/events", &b, (&cookie, &csrf));
    let (status, open) = open_page(b.clone(), page.clone(), Duration::from_secs(20)).await?;
    assert_eq!(status, 200, "the page");
    assert_eq!(head_status(&b, &page).await?, 429, "a second page of the session");

    // Signing out on a ends the session on b, and closes its page there within a keep-alive.
    let (status, head, _) = exchange(&a, as_session("POST", "/api/session/end", &a, (&cookie, &csrf))).await?;
    assert_eq!(status, 200, "{head}");
    let sent = open.await??;
    assert!(
        sent.contains("event: broke") && sent.contains("UNAUTHENTICATED"),
        "{sent}"
    );
    let (status, _, body) = exchange(&b, as_session("GET", "/api/session", &b, (&cookie, &csrf))).await?;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("signed out"), "{body}");

    // A token taken out of the tokens file closes its session's open page too.
    let (_, head, body) = exchange(&b, sign_in(&b, ALICE)).await?;
    let (cookie, csrf) = session_of(&head, &body)?;
    let page = as_session("GET", "/api/runs/live-1/events", &b, (&cookie, &csrf));
    let (status, open) = open_page(b.clone(), page.clone(), Duration::from_secs(20)).await?;
    assert_eq!(status, 200, "the page");
    assert_eq!(head_status(&b, &page).await?, 429, "a second page of the session");
    std::fs::write(&tokens, testkit::pki::tokens_toml(&[("bob", BOB, "")]))?;
    let sent = open.await??;
    assert!(
        sent.contains("event: broke") && sent.contains("UNAUTHENTICATED"),
        "{sent}"
    );

    // Four sign-ins a minute from one address, right or wrong: then 429 until the minute ends
    // (b took one already, this minute or the last: three or four more).
    testkit::wait::until("a minute not about to end", Duration::from_secs(30), || async {
        (shared::sync::unix_ms() % 60_000 < 40_000).then_some(())
    })
    .await?;
    let mut statuses = Vec::new();
    for token in [BOB, ALICE, BOB, BOB, BOB] {
        statuses.push(exchange(&b, sign_in(&b, token)).await?.0);
    }
    let taken = statuses.iter().take_while(|s| **s != 429).count();
    assert!(
        (3..=4).contains(&taken) && statuses[taken..].iter().all(|s| *s == 429),
        "{statuses:?}"
    );
    assert_eq!(statuses[1], 401, "alice's token is gone: {statuses:?}");

    // A request head sent slowly is cut off after the header timeout.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut slow = tokio::net::TcpStream::connect(&a).await?;
        slow.write_all(format!("GET / HTTP/1.1\r\nHost: {a}\r\n").as_bytes())
            .await?;
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut rest)).await;
        assert!(
            closed.is_ok(),
            "a slow head held its connection past the header timeout"
        );
    }
    Ok(())
}
