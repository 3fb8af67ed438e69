//! The Kubernetes manifests: the kustomize base and the example and mTLS overlays render with
//! `kubectl kustomize`, validate strictly against the Kubernetes schemas (`kubernetes-validate`),
//! and say what the services rely on: a headless tool-runner Service, gRPC probes on the health
//! service, a grace period above preStop plus the drain grace, locked-down containers and pods,
//! HPAs and PDBs, the NetworkPolicies and the tools manifest ConfigMap. The NATS configuration
//! they ship runs in a real `nats-server` and admits the orchestrator only with its password; the
//! compose file publishes on loopback only. `./scripts/test` installs the tools.

use std::path::{Path, PathBuf};
use std::process::Command;

use testkit::repo_root;
use tokio::net::TcpListener;

type TestResult = anyhow::Result<()>;

/// The Kubernetes version the manifests are validated against.
const KUBERNETES_VERSION: &str = "1.30.0";

fn tool(name: &str) -> anyhow::Result<PathBuf> {
    let venv = repo_root().join("target/tools/venv/bin").join(name);
    if venv.exists() {
        return Ok(venv);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.exists())
        .ok_or_else(|| anyhow::anyhow!("{name} is not installed: run ./scripts/test, which installs it"))
}

fn render(dir: &Path) -> anyhow::Result<String> {
    let output = Command::new(tool("kubectl")?).arg("kustomize").arg(dir).output()?;
    anyhow::ensure!(
        output.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    // kustomize v5 warns about the deprecated forms (bases, patchesStrategicMerge, commonLabels …)
    // on stderr: the manifests use none.
    anyhow::ensure!(
        output.stderr.is_empty(),
        "kubectl kustomize {} warned: {}",
        dir.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

fn validate(rendered: &str) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("rendered.yaml");
    std::fs::write(&file, rendered)?;
    let output = Command::new(tool("kubernetes-validate")?)
        .args(["--strict", "--quiet", "--no-warn", "-k", KUBERNETES_VERSION])
        .arg(&file)
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "kubernetes-validate: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// The YAML documents of `rendered` whose `kind:` and `name:` match.
fn document<'a>(rendered: &'a str, kind: &str, name: &str) -> anyhow::Result<&'a str> {
    rendered
        .split("\n---\n")
        .find(|doc| {
            doc.lines().any(|l| l == format!("kind: {kind}")) && doc.lines().any(|l| l == format!("  name: {name}"))
        })
        .ok_or_else(|| anyhow::anyhow!("no {kind} {name} in the rendered manifests"))
}

#[test]
fn the_base_and_the_example_overlay_render_and_validate() -> TestResult {
    let base = render(&repo_root().join("deploy/k8s/base"))?;
    validate(&base)?;
    let overlay = render(&repo_root().join("deploy/k8s/overlays/example"))?;
    validate(&overlay)?;
    for kind in [
        "Namespace",
        "ConfigMap",
        "Service",
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
    ] {
        assert!(overlay.contains(&format!("kind: {kind}\n")), "no {kind}");
    }
    assert!(overlay.contains("namespace: orchestrator-demo"));
    Ok(())
}

#[test]
fn the_manifests_say_what_the_services_rely_on() -> TestResult {
    let rendered = render(&repo_root().join("deploy/k8s/overlays/example"))?;

    let headless = document(&rendered, "Service", "tool-runner")?;
    assert!(
        headless.contains("clusterIP: None"),
        "the tool-runner Service must be headless:\n{headless}"
    );

    let runner = document(&rendered, "Deployment", "tool-runner")?;
    let orchestrator = document(&rendered, "Deployment", "orchestrator")?;
    for (deployment, port, service) in [
        (runner, 50052, "toolrunner.v1.ToolRunner"),
        (orchestrator, 50051, "orchestrator.v1.Orchestrator"),
    ] {
        assert!(
            deployment.contains(&format!("port: {port}\n            service: {service}")),
            "readiness on the gRPC health of {service}"
        );
        assert!(deployment.contains("value: 30s"), "drain grace 30s");
        for line in [
            "readOnlyRootFilesystem: true",
            "allowPrivilegeEscalation: false",
            "runAsNonRoot: true",
            "- ALL",
        ] {
            assert!(deployment.contains(line), "{line} missing");
        }
        assert!(deployment.contains("OTEL_EXPORTER_OTLP_ENDPOINT"), "OTEL wired");
        assert!(deployment.contains("requests:") && deployment.contains("limits:"));
    }
    assert!(
        orchestrator.contains("value: dns:///tool-runner:50052"),
        "the orchestrator resolves the headless Service"
    );
    assert!(
        orchestrator.contains("value: http://mock-llm:8000/v1"),
        "the overlay points at the stand-in model"
    );
    assert!(
        runner.contains("name: tool-runner-tools-"),
        "the tools manifest comes from the generated ConfigMap"
    );
    assert!(runner.contains("image: tool-runner:dev"));

    let hpa = document(&rendered, "HorizontalPodAutoscaler", "tool-runner")?;
    assert!(hpa.contains("name: cpu") && hpa.contains("averageUtilization: 70"));
    assert!(document(&rendered, "PodDisruptionBudget", "tool-runner")?.contains("maxUnavailable: 1"));
    let policy = document(&rendered, "NetworkPolicy", "tool-runner")?;
    assert!(policy.contains("app.kubernetes.io/name: orchestrator") && policy.contains("port: 50052"));
    let tools = rendered
        .split("\n---\n")
        .find(|d| d.contains("kind: ConfigMap") && d.contains("tools.toml"))
        .ok_or_else(|| anyhow::anyhow!("no tools ConfigMap"))?;
    assert!(tools.contains("name = \"text_stats\""));
    Ok(())
}

/// The number after `key: ` in `doc`.
fn number(doc: &str, key: &str) -> anyhow::Result<u64> {
    let line = doc
        .lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{key}: ")))
        .ok_or_else(|| anyhow::anyhow!("no {key}"))?;
    Ok(line.trim().parse()?)
}

#[test]
fn pods_are_locked_down_drained_and_bounded() -> TestResult {
    let rendered = render(&repo_root().join("deploy/k8s/overlays/example"))?;
    for (kind, name) in [
        ("Deployment", "orchestrator"),
        ("Deployment", "tool-runner"),
        ("Deployment", "mock-llm"),
        ("Deployment", "jaeger"),
        ("StatefulSet", "nats"),
    ] {
        let pod = document(&rendered, kind, name)?;
        assert!(
            pod.contains("automountServiceAccountToken: false"),
            "{name}: service account token mounted"
        );
        assert_eq!(
            pod.matches("ephemeral-storage:").count(),
            2,
            "{name}: ephemeral-storage request and limit"
        );
        let empty_dirs = pod.matches("emptyDir:").count();
        assert_eq!(
            pod.matches("sizeLimit:").count(),
            empty_dirs,
            "{name}: an emptyDir without sizeLimit"
        );
    }
    // Endpoints leave the Service before SIGTERM; preStop and the 30 s drain fit in the grace.
    for (name, pre_stop) in [("orchestrator", 5), ("tool-runner", 10)] {
        let pod = document(&rendered, "Deployment", name)?;
        assert!(pod.contains("preStop:\n            sleep:"), "{name}: no preStop sleep");
        assert_eq!(number(pod, "seconds")?, pre_stop, "{name}");
        assert!(
            number(pod, "terminationGracePeriodSeconds")? > pre_stop + 30,
            "{name}: grace too short"
        );
    }
    let hpa = document(&rendered, "HorizontalPodAutoscaler", "orchestrator")?;
    assert!(hpa.contains("name: orchestrator") && number(hpa, "minReplicas")? >= 2);
    assert!(document(&rendered, "PodDisruptionBudget", "orchestrator")?.contains("maxUnavailable: 1"));

    // NATS: a password from a Secret, in the orchestrator's URLs and in the server's config.
    let orchestrator = document(&rendered, "Deployment", "orchestrator")?;
    assert!(orchestrator.contains("value: nats://orchestrator:$(NATS_PASSWORD)@nats:4222"));
    assert!(orchestrator.contains("key: orchestrator-password\n              name: nats-credentials-"));
    let nats = document(&rendered, "StatefulSet", "nats")?;
    assert!(nats.contains("- /etc/nats/nats.conf") && nats.contains("name: NATS_ORCHESTRATOR_PASSWORD"));
    let secret = rendered
        .split("\n---\n")
        .find(|d| d.contains("kind: Secret") && d.contains("name: nats-credentials-"))
        .ok_or_else(|| anyhow::anyhow!("no nats-credentials Secret"))?;
    assert!(secret.contains("orchestrator-password:"));
    Ok(())
}

#[test]
fn network_policies_admit_only_whom_they_name() -> TestResult {
    let rendered = render(&repo_root().join("deploy/k8s/base"))?;
    let orchestrator = document(&rendered, "NetworkPolicy", "orchestrator")?;
    assert!(orchestrator.contains("orchestrator.io/client: \"true\"") && orchestrator.contains("port: 50051"));
    let nats = document(&rendered, "NetworkPolicy", "nats")?;
    let client_rule = nats
        .split("- from:")
        .find(|rule| rule.contains("port: 4222"))
        .ok_or_else(|| anyhow::anyhow!("no rule for the NATS client port"))?;
    assert!(
        client_rule.contains("app.kubernetes.io/name: orchestrator") && !client_rule.contains("namespaceSelector"),
        "NATS clients: the orchestrator's pods only\n{client_rule}"
    );
    let runner = document(&rendered, "NetworkPolicy", "tool-runner")?;
    assert!(runner.contains("- Egress"), "the runners' egress is not restricted");
    for needle in [
        "k8s-app: kube-dns",
        "port: 53",
        "cidr: 0.0.0.0/0",
        "- 169.254.0.0/16",
        "- 10.0.0.0/8",
    ] {
        assert!(runner.contains(needle), "tool-runner egress: {needle} missing");
    }
    check_orchestrator_egress(orchestrator)
}

/// The orchestrator's egress: each rule pairs a destination with its port (the model-server
/// pods with any port), and nothing else is allowed.
fn check_orchestrator_egress(policy: &str) -> TestResult {
    assert!(
        policy.contains("- Egress"),
        "the orchestrator's egress is not restricted"
    );
    // The rendered list: `  egress:`, then rules starting `  - `, until the next key.
    let egress: String = policy
        .lines()
        .skip_while(|l| *l != "  egress:")
        .skip(1)
        .take_while(|l| l.starts_with("  - ") || l.starts_with("    "))
        .map(|l| format!("{l}\n"))
        .collect();
    let egress = format!("\n{egress}");
    let rules: Vec<&str> = egress.split("\n  - ").filter(|r| !r.trim().is_empty()).collect();
    let expected: [(&str, Option<&str>); 6] = [
        ("k8s-app: kube-dns", Some("port: 53")),
        ("app.kubernetes.io/name: tool-runner", Some("port: 50052")),
        ("app.kubernetes.io/name: nats", Some("port: 4222")),
        ("app.kubernetes.io/name: jaeger", Some("port: 4317")),
        ("orchestrator.io/llm: \"true\"", None),
        ("cidr: 0.0.0.0/0", Some("port: 443")),
    ];
    assert_eq!(rules.len(), expected.len(), "egress rules:\n{egress}");
    for (to, port) in expected {
        let rule = rules
            .iter()
            .find(|r| r.contains(to))
            .ok_or_else(|| anyhow::anyhow!("no egress rule to {to}:\n{egress}"))?;
        match port {
            Some(port) => assert!(rule.contains(port), "egress to {to} is not on {port}:\n{rule}"),
            None => assert!(!rule.contains("ports:"), "model servers on any port:\n{rule}"),
        }
    }
    let public = rules
        .iter()
        .find(|r| r.contains("cidr: 0.0.0.0/0"))
        .copied()
        .unwrap_or_default();
    for private in [
        "- 10.0.0.0/8",
        "- 172.16.0.0/12",
        "- 192.168.0.0/16",
        "- 169.254.0.0/16",
    ] {
        assert!(
            public.contains(private),
            "public addresses only: {private} not excluded"
        );
    }
    Ok(())
}

/// The example overlay's stand-in model carries the label the orchestrator's egress admits, so
/// the demo still reaches its model with the policies enforced.
#[test]
fn the_example_model_server_is_reachable_under_the_orchestrators_egress() -> TestResult {
    let rendered = render(&repo_root().join("deploy/k8s/overlays/example"))?;
    let model = document(&rendered, "Deployment", "mock-llm")?;
    let template = model
        .split_once("template:")
        .map(|(_, t)| t)
        .ok_or_else(|| anyhow::anyhow!("no pod template"))?;
    assert!(template.contains("orchestrator.io/llm: \"true\""), "{template}");
    let orchestrator = document(&rendered, "Deployment", "orchestrator")?;
    assert!(
        orchestrator.contains("http://mock-llm:8000/v1"),
        "the example talks to the stand-in model"
    );
    Ok(())
}

#[test]
fn the_mtls_overlay_wires_cert_manager_certificates_into_both_services() -> TestResult {
    let rendered = render(&repo_root().join("deploy/k8s/overlays/mtls"))?;
    let (cert_manager, core): (Vec<&str>, Vec<&str>) = rendered
        .split("\n---\n")
        .partition(|doc| doc.contains("apiVersion: cert-manager.io/v1"));
    // kubernetes-validate knows no CRDs: the cert-manager documents are checked below.
    validate(&core.join("\n---\n"))?;
    let certificate = |name: &str| {
        cert_manager
            .iter()
            .find(|d| d.contains("kind: Certificate") && d.contains(&format!("  name: {name}\n")))
            .copied()
            .ok_or_else(|| anyhow::anyhow!("no Certificate {name}"))
    };
    assert!(certificate("orchestrator-ca")?.contains("isCA: true"));
    let runner_cert = certificate("tool-runner-tls")?;
    assert!(runner_cert.contains("- tool-runner\n") && runner_cert.contains("- server auth"));
    assert!(certificate("orchestrator-runner-client")?.contains("- client auth"));
    assert!(certificate("orchestrator-tls")?.contains("- orchestrator\n"));

    let runner = document(&rendered, "Deployment", "tool-runner")?;
    for needle in [
        "name: TOOL_RUNNER_TLS_CLIENT_CA",
        "secretName: tool-runner-tls",
        "name: TOOL_RUNNER_HEALTH_LISTEN",
    ] {
        assert!(runner.contains(needle), "tool-runner: {needle} missing");
    }
    let orchestrator = document(&rendered, "Deployment", "orchestrator")?;
    for needle in [
        "name: ORCHESTRATOR_TOOL_RUNNER_CA",
        "name: ORCHESTRATOR_TOOL_RUNNER_CERT",
        "secretName: orchestrator-runner-client-tls",
        "secretName: orchestrator-tls",
        "value: dns:///tool-runner:50052",
    ] {
        assert!(orchestrator.contains(needle), "orchestrator: {needle} missing");
    }
    for deployment in [runner, orchestrator] {
        // Both probes on the plaintext health port: Kubernetes' gRPC probes speak no TLS.
        assert_eq!(
            deployment.matches("grpc:\n            port: 8081").count(),
            2,
            "{deployment}"
        );
    }
    Ok(())
}

/// The console overlay: each replica serves the console on :8080 behind the Service's port
/// "console", signs people in with the tokens file (which the gRPC port checks too), and signs
/// sessions with one secret of every replica; only pods labelled for it reach the port.
#[test]
fn the_console_overlay_serves_the_console_behind_the_service() -> TestResult {
    let rendered = render(&repo_root().join("deploy/k8s/overlays/console"))?;
    validate(&rendered)?;
    let orchestrator = document(&rendered, "Deployment", "orchestrator")?;
    for needle in [
        "name: ORCHESTRATOR_CONSOLE_LISTEN",
        "value: 0.0.0.0:8080",
        "name: ORCHESTRATOR_CONSOLE_SESSION_KEY_FILE",
        "name: ORCHESTRATOR_AUTH_TOKENS",
        "name: ORCHESTRATOR_CONSOLE_PUBLIC_URL",
        "containerPort: 8080",
    ] {
        assert!(orchestrator.contains(needle), "orchestrator: {needle} missing");
    }
    // It ships no credential: the session secret and the tokens are the operator's to create.
    assert!(
        !rendered.contains("session.key:") && !rendered.contains("tokens.toml:"),
        "the console overlay renders a Secret"
    );
    let service = document(&rendered, "Service", "orchestrator")?;
    assert!(
        service.contains("name: console") && service.contains("port: 8080"),
        "{service}"
    );
    assert!(service.contains("port: 50051"), "the gRPC port stays: {service}");
    let policy = document(&rendered, "NetworkPolicy", "orchestrator-console")?;
    assert!(
        policy.contains("orchestrator.io/console: \"true\"") && policy.contains("port: 8080"),
        "{policy}"
    );
    Ok(())
}

#[test]
fn compose_publishes_on_loopback_only() -> TestResult {
    let compose = std::fs::read_to_string(repo_root().join("deploy/compose.yaml"))?;
    let mappings: Vec<&str> = compose
        .split('"')
        .filter(|s| s.contains(':') && s.chars().all(|c| c.is_ascii_digit() || c == ':' || c == '.'))
        .collect();
    assert!(mappings.len() >= 8, "port mappings not found: {mappings:?}");
    for mapping in mappings {
        assert!(
            mapping.starts_with("127.0.0.1:"),
            "{mapping} is published on every interface"
        );
    }
    Ok(())
}

/// The shipped nats.conf in a real nats-server (its store moved to a temporary directory): the
/// orchestrator connects with the password in its URL, and a wrong one is refused with an error
/// that does not show it.
#[tokio::test]
async fn the_shipped_nats_config_admits_the_orchestrator_with_its_password() -> TestResult {
    let dir = tempfile::tempdir()?;
    let conf = std::fs::read_to_string(repo_root().join("deploy/k8s/base/nats.conf"))?;
    let store = dir.path().join("store");
    let conf_path = dir.path().join("nats.conf");
    std::fs::write(
        &conf_path,
        conf.replace("\"/data\"", &format!("{:?}", store.display().to_string())),
    )?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let password = "d3adbeefcafe0123456789ab";
    let mut server = tokio::process::Command::new(tool("nats-server")?)
        .arg("-c")
        .arg(&conf_path)
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-m", "0"])
        .env("NATS_ORCHESTRATOR_PASSWORD", password)
        .env("NATS_TOOL_RUNNER_PASSWORD", RUNNER_PASSWORD)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let runner = testkit::Runner::start(tool_runner::Config::default()).await?;

    let serve_once = |url: String| {
        let runner = format!("http://{}", runner.addr);
        async move {
            let mut config = orchestrator::Config::new("http://127.0.0.1:1/v1", "m", vec![runner]);
            config.signals.topic = url.parse().map_err(|e: String| anyhow::anyhow!(e))?;
            config.store.backend = url.parse().map_err(|e: String| anyhow::anyhow!(e))?;
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            // Serves until its (immediate) shutdown: Ok once NATS and the signal stream are up.
            anyhow::Ok(orchestrator::serve(listener, config, async {}).await)
        }
    };
    let (limit, pace) = (
        std::time::Duration::from_secs(15),
        std::time::Duration::from_millis(100),
    );
    testkit::wait::until_paced("the orchestrator to connect", limit, pace, || async {
        let served = serve_once(format!("nats://orchestrator:{password}@127.0.0.1:{port}")).await;
        match served.ok()? {
            Ok(()) => Some(()),
            Err(e) => {
                assert!(!e.to_string().contains(password), "{e}");
                None
            }
        }
    })
    .await?;
    let wrong = "0123456789abcdef01234567";
    let refused = serve_once(format!("nats://orchestrator:{wrong}@127.0.0.1:{port}"))
        .await?
        .err()
        .ok_or_else(|| anyhow::anyhow!("a wrong NATS password was admitted"))?
        .to_string();
    assert!(
        refused.contains("cannot connect to NATS at nats://127.0.0.1:"),
        "{refused}"
    );
    assert!(!refused.contains(wrong), "{refused}");
    the_runners_user_reads_run_fences_only(port, password).await?;
    server.kill().await?;
    Ok(())
}

/// The tool-runners' password in the deploy tests' NATS.
const RUNNER_PASSWORD: &str = "f3nce0123456789abcdef012";

/// The shipped config's `tool-runner` user: a runner given it in `--run-store` reads a run's
/// fence and refuses an older epoch's call, and records the durable call it runs; the user writes
/// no fence.
async fn the_runners_user_reads_run_fences_only(port: u16, orchestrator_password: &str) -> TestResult {
    let connect = |user: &'static str, password: String| async move {
        async_nats::ConnectOptions::with_user_and_password(user.to_owned(), password)
            .connect(format!("127.0.0.1:{port}"))
            .await
    };
    let orchestrator = async_nats::jetstream::new(connect("orchestrator", orchestrator_password.to_owned()).await?);
    let runs = orchestrator.get_key_value("orchestrator-runs").await?;
    runs.put(shared::fence::key("moved"), shared::fence::encode(2).into())
        .await?;
    let mut config = tool_runner::Config::default();
    config.fence.run_store = Some(format!("nats://tool-runner:{RUNNER_PASSWORD}@127.0.0.1:{port}"));
    let runner = testkit::Runner::start(config).await?;
    let call = |epoch| proto::toolrunner::v1::RunToolRequest {
        run_id: "moved".to_owned(),
        call_id: "c".to_owned(),
        tool_name: "echo".to_owned(),
        arguments_json: "{}".to_owned(),
        epoch,
        ..Default::default()
    };
    let Err(refused) = runner.client().await?.run_tool(call(1)).await else {
        anyhow::bail!("a call of a replaced owner ran");
    };
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    runner.client().await?.run_tool(call(2)).await?;
    let recorded = runs.entry("call.moved.c").await?;
    assert!(recorded.is_some(), "the runner recorded the durable call it ran");
    let as_runner = async_nats::jetstream::new(connect("tool-runner", RUNNER_PASSWORD.to_owned()).await?);
    let read_only = as_runner.get_key_value("orchestrator-runs").await?;
    let written = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        read_only.put(shared::fence::key("moved"), shared::fence::encode(1).into()),
    )
    .await;
    assert!(!matches!(written, Ok(Ok(_))), "the runners' user wrote a fence");
    Ok(())
}

#[test]
fn the_mcp_overlay_runs_an_http_mcp_server_that_only_the_runners_reach() -> TestResult {
    let dir = repo_root().join("deploy/k8s/overlays/mcp");
    let rendered = render(&dir)?;
    validate(&rendered)?;
    let server = document(&rendered, "Deployment", "mcp-everything")?;
    for line in [
        "image: mcp-everything:dev",
        "readOnlyRootFilesystem: true",
        "runAsNonRoot: true",
        "namespace: orchestrator-demo",
    ] {
        assert!(server.contains(line), "{line} missing:\n{server}");
    }
    // Only the runners reach it, and the runners' egress gains exactly its port.
    let policy = document(&rendered, "NetworkPolicy", "mcp-everything")?;
    assert!(policy.contains("app.kubernetes.io/name: tool-runner") && policy.contains("port: 3001"));
    assert!(policy.contains("egress: []"), "it reaches nothing:\n{policy}");
    let runner = document(&rendered, "NetworkPolicy", "tool-runner")?;
    let rule = runner
        .split("- to:")
        .find(|rule| rule.contains("mcp-everything"))
        .ok_or_else(|| anyhow::anyhow!("the runners may not reach the MCP server:\n{runner}"))?;
    assert!(rule.contains("port: 3001"), "{rule}");
    assert!(runner.contains("k8s-app: kube-dns"), "the base rules stay");
    // The runners' manifest names the server by its Service, and loads.
    let tools = rendered
        .split("\n---\n")
        .find(|d| d.contains("kind: ConfigMap") && d.contains("tools.toml"))
        .ok_or_else(|| anyhow::anyhow!("no tools ConfigMap"))?;
    assert!(tools.contains("url = \"http://mcp-everything:3001/mcp\""), "{tools}");
    let manifest = tool_runner::tools::manifest::load(&dir.join("tools.toml"))?;
    assert_eq!(manifest.mcp_server_names(), ["everything"]);
    Ok(())
}

#[test]
fn the_monitoring_rules_and_dashboard_render_and_their_queries_parse() -> TestResult {
    let dir = repo_root().join("deploy/k8s/monitoring");
    let rendered = render(&dir)?;
    let (rules, core): (Vec<&str>, Vec<&str>) = rendered
        .split("\n---\n")
        .partition(|doc| doc.contains("kind: PrometheusRule"));
    assert_eq!(rules.len(), 1);
    validate(&core.join("\n---\n"))?;
    let dashboard = document(&rendered, "ConfigMap", "orchestrator-dashboard")?;
    assert!(
        dashboard.contains("grafana_dashboard: \"1\""),
        "the Grafana sidecar's label"
    );

    // promtool checks the alert rules as Prometheus loads them (the PrometheusRule's spec) and
    // every dashboard query, each as a recording rule.
    let work = tempfile::tempdir()?;
    let source = std::fs::read_to_string(dir.join("prometheus-rules.yaml"))?;
    let (_, spec) = source
        .split_once("\nspec:\n")
        .ok_or_else(|| anyhow::anyhow!("no spec in the PrometheusRule"))?;
    let spec: String = spec
        .lines()
        .map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l)))
        .collect();
    std::fs::write(work.path().join("alerts.yaml"), spec)?;
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("grafana-dashboard.json"))?)?;
    let mut recorded = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let panels = json["panels"].as_array().cloned().unwrap_or_default();
    for (i, expr) in panels
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
        .enumerate()
    {
        recorded.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::Value::String(expr)
        ));
    }
    std::fs::write(work.path().join("dashboard.yaml"), recorded)?;
    for file in ["alerts.yaml", "dashboard.yaml"] {
        let output = Command::new(tool("promtool")?)
            .args(["check", "rules"])
            .arg(work.path().join(file))
            .output()?;
        assert!(
            output.status.success(),
            "promtool check rules {file}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// The HA overlay: NATS as a three-node JetStream cluster (a headless Service for the routes, one
/// pod per node where it can, a disruption budget, a release with `sync_interval`), and the
/// orchestrator keeping three copies of every stream with every node as a seed, the password
/// defined before the URLs that use it.
#[test]
fn the_ha_overlay_runs_nats_as_a_three_node_cluster() -> TestResult {
    let rendered = render(&repo_root().join("deploy/k8s/overlays/ha"))?;
    validate(&rendered)?;
    let nats = document(&rendered, "StatefulSet", "nats")?;
    for expected in [
        "replicas: 3",
        "serviceName: nats-cluster",
        "image: nats:2.12",
        "containerPort: 6222",
        "podAntiAffinity",
        "fieldPath: metadata.name",
    ] {
        assert!(
            nats.contains(expected),
            "{expected} missing from the NATS StatefulSet:\n{nats}"
        );
    }
    let config = rendered
        .split("\n---\n")
        .find(|doc| doc.contains("kind: ConfigMap") && doc.contains("name: nats-config-"))
        .ok_or_else(|| anyhow::anyhow!("no nats-config ConfigMap"))?;
    assert!(config.contains("sync_interval: always"), "{config}");
    assert!(document(&rendered, "Service", "nats-cluster")?.contains("clusterIP: None"));
    assert!(document(&rendered, "PodDisruptionBudget", "nats")?.contains("maxUnavailable: 1"));
    assert!(document(&rendered, "NetworkPolicy", "nats")?.contains("port: 6222"));
    let orchestrator = document(&rendered, "Deployment", "orchestrator")?;
    assert!(
        orchestrator.contains("name: NATS_REPLICAS\n          value: \"3\""),
        "{orchestrator}"
    );
    let seeds = "@nats-0.nats-cluster:4222,nats://orchestrator:$(NATS_PASSWORD)@nats-1.nats-cluster:4222";
    assert!(orchestrator.contains(seeds), "{orchestrator}");
    let defined = orchestrator.find("name: NATS_PASSWORD").unwrap_or(usize::MAX);
    let used = orchestrator.find("$(NATS_PASSWORD)").unwrap_or(0);
    assert!(defined < used, "NATS_PASSWORD is defined before the URLs that use it");
    Ok(())
}

/// The HA overlay's nats.conf, as shipped but for its addresses (loopback ports for the client,
/// monitoring and route ports, the routes pointed at them, a temporary store), in three real
/// nats-servers: they form one JetStream cluster that takes a stream of three replicas from the
/// orchestrator's user, its writes synced to disk.
#[tokio::test]
async fn the_ha_nats_config_forms_a_cluster_that_keeps_three_copies() -> TestResult {
    let bin = repo_root().join("target/tools/nats/bin/nats-server");
    anyhow::ensure!(bin.exists(), "{} is missing: ./scripts/test installs it", bin.display());
    let conf = std::fs::read_to_string(repo_root().join("deploy/k8s/overlays/ha/nats.conf"))?;
    let dir = tempfile::tempdir()?;
    let free = || -> anyhow::Result<u16> { Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port()) };
    let nodes: Vec<(u16, u16, u16)> = (0..3)
        .map(|_| Ok((free()?, free()?, free()?)))
        .collect::<anyhow::Result<_>>()?;
    let password = "d3adbeefcafe0123456789ab";
    let mut servers = Vec::new();
    for (i, (client, monitor, route)) in nodes.iter().enumerate() {
        let mut node = conf
            .replace("port: 4222", &format!("port: {client}"))
            .replace("http_port: 8222", &format!("http_port: {monitor}"))
            .replace("  port: 6222", &format!("  port: {route}"))
            .replace(
                "\"/data\"",
                &format!("{:?}", dir.path().join(format!("n{i}")).display().to_string()),
            );
        for (j, (_, _, other)) in nodes.iter().enumerate() {
            node = node.replace(&format!("nats-{j}.nats-cluster:6222"), &format!("127.0.0.1:{other}"));
        }
        let path = dir.path().join(format!("n{i}.conf"));
        std::fs::write(&path, node)?;
        servers.push(
            tokio::process::Command::new(&bin)
                .arg("-c")
                .arg(&path)
                .args(["-a", "127.0.0.1"])
                .env("POD_NAME", format!("nats-{i}"))
                .env("NATS_ORCHESTRATOR_PASSWORD", password)
                .env("NATS_TOOL_RUNNER_PASSWORD", RUNNER_PASSWORD)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .kill_on_drop(true)
                .spawn()?,
        );
    }
    let seeds: Vec<String> = nodes.iter().map(|(c, _, _)| format!("nats://127.0.0.1:{c}")).collect();
    let attempt = || async {
        let client = async_nats::ConnectOptions::with_user_and_password("orchestrator".into(), password.into())
            .connect(seeds.clone())
            .await?;
        let js = async_nats::jetstream::new(client);
        let mut stream = js
            .get_or_create_stream(async_nats::jetstream::stream::Config {
                name: "HA_CHECK".into(),
                subjects: vec!["ha.>".into()],
                num_replicas: 3,
                ..Default::default()
            })
            .await?;
        js.publish("ha.check", "kept".into()).await?.await?;
        let info = stream.info().await?;
        anyhow::Ok((info.config.num_replicas, info.cluster.clone().map(|c| c.replicas.len())))
    };
    let (limit, pace) = (
        std::time::Duration::from_secs(30),
        std::time::Duration::from_millis(300),
    );
    let what = "the HA NATS cluster to take a stream of three replicas";
    let (replicas, followers) =
        testkit::wait::until_paced(what, limit, pace, || async { attempt().await.ok() }).await?;
    assert_eq!((replicas, followers), (3, Some(2)), "a leader and two followers");
    for mut server in servers {
        server.kill().await?;
    }
    Ok(())
}
