//! A throwaway PKI made with the `openssl` command, for the tests that call the services over
//! TLS and mTLS.

use std::path::PathBuf;

use tokio::process::Command;

type TestResult = anyhow::Result<()>;

/// A throwaway PKI made with the `openssl` command.
pub struct Pki {
    /// Where the files are (removed on drop).
    pub dir: tempfile::TempDir,
}

impl Pki {
    /// An empty PKI in a new temporary directory.
    pub fn new() -> anyhow::Result<Self> {
        Ok(Self {
            dir: tempfile::tempdir()?,
        })
    }

    /// The file `name` of the PKI.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    async fn openssl(&self, args: &[&str]) -> TestResult {
        let output = Command::new("openssl")
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .await?;
        anyhow::ensure!(
            output.status.success(),
            "openssl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(())
    }

    /// A CA: `{name}.pem` and `{name}.key`.
    pub async fn ca(&self, name: &str) -> TestResult {
        let (pem, key, subject) = (format!("{name}.pem"), format!("{name}.key"), format!("/CN={name}"));
        self.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-keyout",
            &key,
            "-out",
            &pem,
            "-subj",
            &subject,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ])
        .await
    }

    /// A certificate for `name` (its common name; valid for 127.0.0.1 and localhost too) signed
    /// by the CA `ca`: `{name}.pem`, `{name}.key`.
    pub async fn leaf(&self, ca: &str, name: &str) -> TestResult {
        self.signed(ca, name, &format!("/CN={name}"), "DNS:localhost,IP:127.0.0.1")
            .await
    }

    /// A client certificate for `name` with an empty subject, naming itself only by a SPIFFE ID
    /// in its subject alternative names (as SPIFFE issuers make them), signed by `ca`.
    pub async fn leaf_without_subject(&self, ca: &str, name: &str) -> TestResult {
        self.signed(
            ca,
            name,
            "/",
            &format!("critical,URI:spiffe://test.local/ns/default/sa/{name}"),
        )
        .await
    }

    async fn signed(&self, ca: &str, name: &str, subject: &str, alt_names: &str) -> TestResult {
        let (csr, ext) = (format!("{name}.csr"), format!("{name}.ext"));
        std::fs::write(
            self.path(&ext),
            format!(
                "subjectAltName={alt_names}\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n"
            ),
        )?;
        let key = format!("{name}.key");
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            subject,
        ])
        .await?;
        let (ca_pem, ca_key, pem) = (format!("{ca}.pem"), format!("{ca}.key"), format!("{name}.pem"));
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_pem,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &pem,
            "-extfile",
            &ext,
        ])
        .await
    }

    /// The file `name` of the PKI, as a command-line argument.
    pub fn arg(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }
}

/// A tokens file (`--auth-tokens`) for `tokens`: each a principal, its bearer token, and extra
/// TOML lines of its entry (`roles = ["approver"]`, `tools = [...]`; empty for none).
pub fn tokens_toml(tokens: &[(&str, &str, &str)]) -> String {
    tokens
        .iter()
        .map(|(principal, token, extra)| {
            let sha = shared::auth::token_sha256(token);
            let extra = if extra.is_empty() {
                String::new()
            } else {
                format!("{extra}\n")
            };
            format!("[[token]]\nprincipal = \"{principal}\"\nsha256 = \"{sha}\"\n{extra}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}
