//! The Kubernetes manifests: the kustomize base and the example overlay render with `kubectl
//! kustomize`, validate strictly against the Kubernetes schemas (`kubernetes-validate`), and
//! say what the services rely on: a headless tool-runner Service, gRPC probes on the health
//! service, a grace period above the drain grace, locked-down containers, the HPA, the PDB, the
//! NetworkPolicy and the tools manifest ConfigMap. `./scripts/test` installs both tools.

use std::path::{Path, PathBuf};
use std::process::Command;

use e2e::repo_root;

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
        .find(|doc| doc.lines().any(|l| l == format!("kind: {kind}")) && doc.contains(&format!("  name: {name}\n")))
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
        assert!(
            deployment.contains("terminationGracePeriodSeconds: 40"),
            "grace period above the drain grace"
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
