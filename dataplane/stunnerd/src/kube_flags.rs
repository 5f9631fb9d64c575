//! The kubectl connection flags stunnerd accepts ([`KubeFlags`]), read into the options the
//! control plane's Kubernetes client is built from, and the kubectl and CDS flags uturn does
//! not act on: refused on the command line, logged and ignored in the environment.

use uturn_control::kubernetes::KubeOptions;

/// The kubectl connection flags stunnerd accepts: here they reach the Kubernetes API server
/// that KUBERNETES clusters and `--siblings k8s` watch (in a pod, the in-cluster config
/// needs none of them).
#[derive(clap::Args, Debug)]
pub(crate) struct KubeFlags {
    /// Kubernetes API: the kubeconfig file (default: in-cluster, else $KUBECONFIG or
    /// ~/.kube/config).
    #[arg(long)]
    pub(crate) kubeconfig: Option<String>,
    /// Kubernetes API: the kubeconfig context to use.
    #[arg(long)]
    pub(crate) context: Option<String>,
    /// Kubernetes API: the kubeconfig cluster to use.
    #[arg(long)]
    pub(crate) cluster: Option<String>,
    /// Kubernetes API: the kubeconfig user to use.
    #[arg(long)]
    pub(crate) user: Option<String>,
    #[arg(
        short = 'n',
        long,
        help = "Refused (KUBERNETES cluster endpoints name their namespace, \
                <namespace>/<service>)"
    )]
    pub(crate) namespace: Option<String>,
    /// Kubernetes API: the server's URL.
    #[arg(short = 's', long)]
    pub(crate) server: Option<String>,
    /// Kubernetes API: a bearer token.
    #[arg(long)]
    pub(crate) token: Option<String>,
    /// Kubernetes API: the user to impersonate.
    #[arg(long = "as")]
    pub(crate) as_user: Option<String>,
    /// Kubernetes API: a group to impersonate (repeatable).
    #[arg(long = "as-group")]
    pub(crate) as_group: Vec<String>,
    /// Kubernetes API: the UID to impersonate.
    #[arg(long = "as-uid")]
    pub(crate) as_uid: Option<String>,
    /// Kubernetes API: the CA certificate file.
    #[arg(long = "certificate-authority")]
    pub(crate) certificate_authority: Option<String>,
    /// Kubernetes API: the client certificate file.
    #[arg(long = "client-certificate")]
    pub(crate) client_certificate: Option<String>,
    /// Kubernetes API: the client key file.
    #[arg(long = "client-key")]
    pub(crate) client_key: Option<String>,
    /// Kubernetes API: do not verify the server's certificate.
    #[arg(long = "insecure-skip-tls-verify")]
    pub(crate) insecure_skip_tls_verify: bool,
    /// Kubernetes API: the server name to verify its certificate against.
    #[arg(long = "tls-server-name")]
    pub(crate) tls_server_name: Option<String>,
    /// Kubernetes API: how long connecting and sending a request may take, a duration such as
    /// 30s or 1m (an open watch is not bounded).
    #[arg(long = "request-timeout")]
    pub(crate) request_timeout: Option<String>,
    /// Refused (uturn keeps no API discovery cache).
    #[arg(long = "cache-dir")]
    pub(crate) cache_dir: Option<String>,
    /// Refused (basic authentication left Kubernetes in 1.19: use --token or a client
    /// certificate).
    #[arg(long)]
    pub(crate) username: Option<String>,
    /// Refused (basic authentication left Kubernetes in 1.19: use --token or a client
    /// certificate).
    #[arg(long)]
    pub(crate) password: Option<String>,
}

/// The kubectl and CDS flags uturn does not act on, and why; given on the command line they
/// are refused (exit 1), set in the environment they are logged and ignored.
const REFUSED_FLAGS: &[(&str, &str, &str)] = &[
    ("namespace", "--namespace", "KUBERNETES cluster endpoints name their namespace (<namespace>/<service>); drop the flag"),
    ("cache_dir", "--cache-dir", "uturn keeps no API discovery cache; drop the flag"),
    ("username", "--username", "basic authentication was removed from Kubernetes in 1.19; authenticate with --token, --client-certificate and --client-key, or a kubeconfig"),
    ("password", "--password", "basic authentication was removed from Kubernetes in 1.19; authenticate with --token, --client-certificate and --client-key, or a kubeconfig"),
    ("cds_server_address", "--cds-server-address (CDS_SERVER_ADDR)", "it only serves -c k8s, which uturn does not support; point -c at the config discovery server instead, e.g. -c http://stunner-config-discovery.stunner-system:13478"),
    ("cds_server_namespace", "--cds-server-namespace (CDS_SERVER_NAMESPACE)", "it only serves -c k8s, which uturn does not support; point -c at the config discovery server instead, e.g. -c http://stunner-config-discovery.stunner-system:13478"),
    ("cds_server_port", "--cds-server-port", "it only serves -c k8s, which uturn does not support; point -c at the config discovery server instead, e.g. -c http://stunner-config-discovery.stunner-system:13478"),
];

/// The Kubernetes connection options from the kubectl flags, and the ignored flags set in the
/// environment (to log); an error for a flag uturn refuses or a value it cannot use.
pub(crate) fn kube_options(
    flags: &KubeFlags,
    matches: &clap::ArgMatches,
) -> Result<(KubeOptions, Vec<String>), String> {
    let mut env_ignored = Vec::new();
    for (id, flag, why) in REFUSED_FLAGS {
        match matches.value_source(id) {
            Some(clap::parser::ValueSource::CommandLine) => {
                return Err(format!("{flag} is not supported: {why}"))
            }
            Some(clap::parser::ValueSource::EnvVariable) => {
                env_ignored.push(format!("{flag} set in the environment is ignored: {why}"))
            }
            _ => {}
        }
    }
    let request_timeout = match &flags.request_timeout {
        Some(value) => uturn_control::kubernetes::parse_request_timeout(value)?,
        None => None,
    };
    let options = KubeOptions {
        kubeconfig: flags.kubeconfig.clone().map(Into::into),
        context: flags.context.clone(),
        cluster: flags.cluster.clone(),
        user: flags.user.clone(),
        server: flags.server.clone(),
        token: flags.token.clone(),
        insecure_skip_tls_verify: flags.insecure_skip_tls_verify,
        tls_server_name: flags.tls_server_name.clone(),
        certificate_authority: flags.certificate_authority.clone().map(Into::into),
        client_certificate: flags.client_certificate.clone().map(Into::into),
        client_key: flags.client_key.clone().map(Into::into),
        impersonate: flags.as_user.clone(),
        impersonate_groups: flags.as_group.clone(),
        impersonate_uid: flags.as_uid.clone(),
        request_timeout,
    };
    options.check()?;
    Ok((options, env_ignored))
}
