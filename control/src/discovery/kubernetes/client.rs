//! The Kubernetes client from the kubectl flags stunnerd accepts ([`KubeOptions`]): what can be
//! checked before the first connection, `--request-timeout` read as kubectl reads it, and the
//! kube-rs config built as kubectl builds its own from the same flags.

use kube::Client;
use std::path::PathBuf;
use std::time::Duration;

/// How to reach the API server: the kubectl flags stunnerd accepts. With none set, kube-rs
/// infers the config: `KUBECONFIG` or `~/.kube/config`, else the in-cluster service account.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubeOptions {
    /// `--kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// `--context`.
    pub context: Option<String>,
    /// `--cluster`.
    pub cluster: Option<String>,
    /// `--user`.
    pub user: Option<String>,
    /// `--server`: the API server URL, overriding the kubeconfig's.
    pub server: Option<String>,
    /// `--token`: a bearer token, overriding the kubeconfig's.
    pub token: Option<String>,
    /// `--insecure-skip-tls-verify`.
    pub insecure_skip_tls_verify: bool,
    /// `--tls-server-name`.
    pub tls_server_name: Option<String>,
    /// `--certificate-authority`: a PEM file of CAs for the API server, overriding the
    /// kubeconfig's (re-read as it changes).
    pub certificate_authority: Option<PathBuf>,
    /// `--client-certificate`: a PEM client certificate file, overriding the kubeconfig's.
    pub client_certificate: Option<PathBuf>,
    /// `--client-key`: the PEM key file of `--client-certificate`.
    pub client_key: Option<PathBuf>,
    /// `--as`: the user to impersonate.
    pub impersonate: Option<String>,
    /// `--as-group`: the groups to impersonate (repeatable).
    pub impersonate_groups: Vec<String>,
    /// `--as-uid`: the UID to impersonate.
    pub impersonate_uid: Option<String>,
    /// `--request-timeout`: bounds connecting to the API server and sending a request (a
    /// watch that stays open is not cut by it).
    pub request_timeout: Option<Duration>,
}

impl KubeOptions {
    /// Checks what can be checked before the first connection: the files the flags name are
    /// readable. The error names the flag, the value and the fix.
    pub fn check(&self) -> Result<(), String> {
        for (flag, path) in [
            ("--certificate-authority", &self.certificate_authority),
            ("--client-certificate", &self.client_certificate),
            ("--client-key", &self.client_key),
        ] {
            if let Some(path) = path {
                std::fs::metadata(path)
                    .and_then(|m| {
                        if m.is_file() {
                            std::fs::File::open(path).map(|_| ())
                        } else {
                            Err(std::io::Error::other("not a file"))
                        }
                    })
                    .map_err(|e| {
                        format!(
                            "{flag} {:?}: cannot read it: {e}; name a readable PEM file",
                            path.display().to_string()
                        )
                    })?;
            }
        }
        if self.client_certificate.is_some() != self.client_key.is_some() {
            return Err(
                "--client-certificate and --client-key go together: give both, or neither".into(),
            );
        }
        Ok(())
    }
}

/// Parses `--request-timeout` as kubectl does: `0` is no timeout, a bare integer is seconds,
/// otherwise a Go duration such as `5s`, `1m30s` or `500ms`.
pub fn parse_request_timeout(value: &str) -> Result<Option<Duration>, String> {
    let bad = || {
        format!(
            "--request-timeout {value:?} is not a duration; use e.g. 30s, 1m or 500ms (0: no timeout)"
        )
    };
    if let Ok(seconds) = value.parse::<u64>() {
        return Ok((seconds > 0).then(|| Duration::from_secs(seconds)));
    }
    // kubectl takes no sign (a negative timeout means nothing).
    if value.starts_with(['+', '-']) {
        return Err(bad());
    }
    let seconds = uturn_shared::go::parse_duration(value).ok_or_else(bad)?;
    let total = Duration::try_from_secs_f64(seconds).map_err(|_| bad())?;
    Ok((!total.is_zero()).then_some(total))
}

/// Builds a kube-rs client from `options`, as kubectl builds its config from the same flags:
/// the kubeconfig (`--kubeconfig`, else `KUBECONFIG`, else `~/.kube/config`) with the flags
/// applied over it; with no kubeconfig, the flags alone when `--server` is given; else the
/// in-cluster service account.
pub async fn client(options: &KubeOptions) -> Result<Client, String> {
    use kube::config::{KubeConfigOptions, Kubeconfig};
    let selection = KubeConfigOptions {
        context: options.context.clone(),
        cluster: options.cluster.clone(),
        user: options.user.clone(),
    };
    let explicit =
        selection.context.is_some() || selection.cluster.is_some() || selection.user.is_some();
    let mut config = match &options.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .map_err(|e| format!("cannot read kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &selection)
                .await
                .map_err(|e| format!("invalid kubeconfig {}: {e}", path.display()))?
        }
        None if explicit => kube::Config::from_kubeconfig(&selection)
            .await
            .map_err(|e| format!("invalid kubeconfig: {e}"))?,
        None => match (&options.server, Kubeconfig::read()) {
            (Some(_), Ok(kubeconfig)) => {
                kube::Config::from_custom_kubeconfig(kubeconfig, &selection)
                    .await
                    .map_err(|e| format!("invalid kubeconfig: {e}"))?
            }
            // kubectl --server with no kubeconfig: the flags are the whole config (no
            // credentials but --token or --client-certificate, no CA but
            // --certificate-authority, as kubectl).
            (Some(server), Err(_)) => kube::Config::new(server_url(server)?),
            (None, _) => kube::Config::infer().await.map_err(|e| {
                format!(
                    "no Kubernetes credentials: {e} (run in a pod with a service account, or \
                     give --kubeconfig or KUBECONFIG, or --server with --token or \
                     --client-certificate and --client-key)"
                )
            })?,
        },
    };
    if let Some(server) = &options.server {
        config.cluster_url = server_url(server)?;
    }
    if let Some(token) = &options.token {
        config.auth_info.token = Some(token.clone().into());
    }
    if options.insecure_skip_tls_verify {
        config.accept_invalid_certs = true;
    }
    if let Some(name) = &options.tls_server_name {
        config.tls_server_name = Some(name.clone());
    }
    if let Some(ca) = &options.certificate_authority {
        config.root_cert_file = Some(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&options.client_certificate, &options.client_key) {
        config.auth_info.client_certificate = Some(cert.display().to_string());
        config.auth_info.client_certificate_data = None;
        config.auth_info.client_key = Some(key.display().to_string());
        config.auth_info.client_key_data = None;
    }
    if let Some(user) = &options.impersonate {
        config.auth_info.impersonate = Some(user.clone());
    }
    if !options.impersonate_groups.is_empty() {
        config.auth_info.impersonate_groups = Some(options.impersonate_groups.clone());
    }
    if let Some(uid) = &options.impersonate_uid {
        config.auth_info.impersonate_uid = Some(uid.clone());
    }
    if let Some(timeout) = options.request_timeout {
        config.connect_timeout = Some(timeout);
        config.write_timeout = Some(timeout);
    }
    Client::try_from(config).map_err(|e| format!("cannot create Kubernetes client: {e}"))
}

/// `--server`'s URL (a bare `HOST:PORT` means `https://HOST:PORT`).
pub(super) fn server_url(server: &str) -> Result<hyper::Uri, String> {
    let bad = |e: &dyn std::fmt::Display| {
        format!("--server {server:?} is not a URL: {e}; give e.g. https://10.0.0.1:6443")
    };
    let url = if server.contains("://") {
        server.to_string()
    } else {
        format!("https://{server}")
    };
    let uri: hyper::Uri = url.parse().map_err(|e| bad(&e))?;
    if uri.host().is_none() {
        return Err(bad(&"it names no host"));
    }
    Ok(uri)
}
