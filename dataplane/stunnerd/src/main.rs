//! `stunnerd`: uturn's drop-in replacement for STUNner's dataplane daemon.

mod logging;

use base64::Engine as _;
use clap::{CommandFactory, FromArgMatches, Parser, ValueEnum};
use logging::LogFormat;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use uturn_control::cds::CdsTarget;
use uturn_control::kubernetes::KubeOptions;
use uturn_control::origin::{load_once, ConfigOrigin};
use uturn_control::{Control, ControlConfig, Source};
use uturn_dataplane::io::certificates::CertificateExpiry;
use uturn_dataplane::io::check::{check_config, check_tls_material, SharedPorts};
use uturn_dataplane::io::metrics::add_count;
use uturn_dataplane::io::offload::{self, OffloadMode};
use uturn_dataplane::io::{
    select_backend, usable_cpus, BackendChoice, Dataplane, DataplaneConfig, IoBackend,
};
use uturn_shared::config::{StunnerConfig, Transport};

/// STUNner's stunnerd command line, flag for flag.
#[derive(Parser, Debug)]
#[command(
    name = "stunnerd",
    version,
    about = "uturn: a TURN media gateway dataplane for Kubernetes (stunnerd-compatible)"
)]
struct Cli {
    /// Config origin: file://PATH, IP:port or http(s)/ws(s) URL of a CDS server, or k8s.
    #[arg(
        short = 'c',
        long = "config",
        env = "STUNNER_CONFIG_ORIGIN",
        default_value = ":13478"
    )]
    config: String,
    /// Log level spec <scope>:<level>[,…] (overrides admin.loglevel).
    #[arg(short = 'l', long = "log")]
    log: Option<String>,
    /// Log format: text or json.
    #[arg(long = "log-format", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Instance id <namespace>/<name>.
    #[arg(short = 'i', long = "id")]
    id: Option<String>,
    /// Watch the config origin for updates.
    #[arg(short = 'w', long = "watch")]
    watch: bool,
    /// SO_REUSEPORT sockets per TURN-UDP listener (0: one).
    #[arg(short = 'u', long = "udp-thread-num", default_value_t = 0)]
    udp_thread_num: usize,
    /// Dry run: no sockets, no servers.
    #[arg(short = 'd', long = "dry-run")]
    dry_run: bool,
    /// Keep /ready at 200, also while draining.
    #[arg(long = "force-ready-status")]
    force_ready_status: bool,
    /// uturn: open listener ports that another process already serves (and share their
    /// clients with it through SO_REUSEPORT) instead of refusing the config.
    #[arg(long = "allow-shared-ports")]
    allow_shared_ports: bool,
    /// uturn: end a graceful shutdown after this many seconds even if allocations remain
    /// (default: wait for the last one, as stunnerd).
    #[arg(long = "drain-timeout", value_name = "SECONDS")]
    drain_timeout: Option<u64>,
    /// uturn: IO engine: auto (io_uring where it works, else epoll), uring or epoll.
    #[arg(
        long = "io-engine",
        env = "UTURN_IO_ENGINE",
        value_enum,
        default_value_t = IoBackendFlag::Auto
    )]
    io_engine: IoBackendFlag,
    /// Kernel offload of ChannelData: none, tc, xdp or auto (default: the config's
    /// admin.offload_engine, which defaults to none). tc and auto never stop the server: if the
    /// program cannot run, it relays in user space and logs why.
    #[arg(long = "offload", env = "UTURN_OFFLOAD", value_name = "MODE")]
    offload: Option<String>,
    /// uturn: how long /ready waits for the first EndpointSlice list of each Service that a
    /// KUBERNETES cluster names; after it, ready anyway with a warning (0: do not wait).
    #[arg(long = "discovery-timeout", value_name = "SECONDS", default_value_t = uturn_control::DEFAULT_DISCOVERY_TIMEOUT.as_secs())]
    discovery_timeout: u64,
    /// uturn: allocations held by all clients together; more get 508 (0: no cap).
    #[arg(long = "max-allocations", value_name = "N", default_value_t = uturn_dataplane::proto::limits::DEFAULT_MAX_ALLOCATIONS)]
    max_allocations: usize,
    /// uturn: permissions (and channels) one allocation may hold; more get 508.
    #[arg(long = "max-permissions", value_name = "N", default_value_t = uturn_dataplane::proto::limits::DEFAULT_MAX_PERMISSIONS as u32, value_parser = clap::value_parser!(u32).range(1..))]
    max_permissions: u32,
    /// uturn: 401/438 challenges per second per source IP on TURN-UDP, beyond which they are
    /// dropped and counted (0: no limit).
    #[arg(long = "challenge-rate", value_name = "N", default_value_t = uturn_dataplane::proto::limits::DEFAULT_CHALLENGE_RATE)]
    challenge_rate: u32,
    /// uturn: challenges a source IP may get at once before --challenge-rate applies.
    #[arg(long = "challenge-burst", value_name = "N", default_value_t = uturn_dataplane::proto::limits::DEFAULT_CHALLENGE_BURST, value_parser = clap::value_parser!(u32).range(1..))]
    challenge_burst: u32,
    /// uturn: TCP/TLS connections whose client holds no allocation yet, over the whole
    /// process; more are closed at accept (0: no cap).
    #[arg(long = "max-unauthenticated-connections", value_name = "N", default_value_t = uturn_dataplane::io::admission::DEFAULT_MAX_UNAUTHENTICATED)]
    max_unauthenticated_connections: usize,
    /// uturn: the same, from one client IP address (0: no cap).
    #[arg(long = "max-unauthenticated-connections-per-ip", value_name = "N", default_value_t = uturn_dataplane::io::admission::DEFAULT_MAX_UNAUTHENTICATED_PER_IP)]
    max_unauthenticated_connections_per_ip: u32,
    /// Same as -l all:DEBUG.
    #[arg(short = 'v', long = "verbose")]
    verbose: bool,
    /// CDS address for -c k8s.
    #[arg(long = "cds-server-address", env = "CDS_SERVER_ADDR")]
    cds_server_address: Option<String>,
    /// Namespace of the CDS pod for -c k8s.
    #[arg(long = "cds-server-namespace", env = "CDS_SERVER_NAMESPACE")]
    cds_server_namespace: Option<String>,
    /// CDS port for -c k8s.
    #[arg(long = "cds-server-port", default_value_t = 13478)]
    cds_server_port: u16,
    /// uturn: second-chance forwarding between the pods of this gateway: a client datagram
    /// that finds no allocation here goes to the sibling pod that holds it. `k8s` (the pods
    /// of the Service named by --id, `<namespace>/<gateway>` under STUNner's operator),
    /// `k8s:<namespace>/<service>`, or `static:<ip>,<ip>,…`. Off by default.
    #[arg(long = "siblings", env = "UTURN_SIBLINGS", value_name = "SPEC")]
    siblings: Option<String>,
    /// uturn: the UDP port of shard 0's sibling socket (shard i: port + i), the same on every
    /// pod of the gateway.
    #[arg(
        long = "sibling-port",
        env = "UTURN_SIBLING_PORT",
        default_value_t = 13479
    )]
    sibling_port: u16,
    /// uturn: the file holding the key the gateway's pods share to authenticate forwarded
    /// datagrams (at least 16 bytes; a mounted Secret); else env UTURN_SIBLING_KEY.
    #[arg(
        long = "sibling-key-file",
        env = "UTURN_SIBLING_KEY_FILE",
        value_name = "PATH"
    )]
    sibling_key_file: Option<String>,
    /// STUNner v2: on SIGTERM/SIGINT close everything and exit at once, without draining.
    #[arg(long = "no-graceful-shutdown")]
    no_graceful_shutdown: bool,
    /// STUNner v2: license JSON ({"license_config":{"key":…,"hmac":…}} or {"key":…,"hmac":…});
    /// it replaces admin.license_config in every config (uturn has no licensed features).
    #[arg(long = "license", value_name = "JSON")]
    license: Option<String>,
    /// STUNner v2 tunnel mode only: SNI for a TLS/DTLS upstream (tunnel mode is refused).
    #[arg(long = "sni")]
    sni: Option<String>,
    /// STUNner v2 tunnel mode only: accept a self-signed upstream (tunnel mode is refused).
    #[arg(long = "insecure")]
    insecure: bool,
    #[command(flatten)]
    kube: KubeFlags,
    /// turn://user:pass@host:port?transport=udp: run a built-in default config. (STUNner v2's
    /// tunnel mode, three arguments <client-addr> <turn-server-addr> <peer-addr>, is refused.)
    #[arg(value_name = "TURN-URI")]
    positional: Vec<String>,
}

impl Cli {
    /// The TURN URI of the one-URI mode.
    fn turn_uri(&self) -> Option<&String> {
        match self.positional.as_slice() {
            [uri] => Some(uri),
            _ => None,
        }
    }

    /// Refuses what the positional arguments ask for beyond a TURN URI: STUNner v2's tunnel
    /// mode (three), or a count no mode takes.
    fn check_positional(&self) -> Result<(), String> {
        match self.positional.len() {
            0 | 1 => Ok(()),
            3 => Err(format!(
                "tunnel mode ({} {} {}) is not supported: uturn is the TURN server; to reach a \
                 peer through a TURN server from the command line use turncat (perf/), \
                 e.g. turncat udp://127.0.0.1:5000 turn://user:pass@gateway:3478 udp://peer:9000",
                self.positional[0], self.positional[1], self.positional[2]
            )),
            n => Err(format!(
                "{n} positional arguments: give none (daemon), one TURN URI \
                 (turn://user:pass@host:port?transport=udp), or see --help"
            )),
        }
    }
}

/// `--siblings` and its key: where the siblings come from, and the forwarding setup; `None`
/// when forwarding is off.
fn sibling_options(
    cli: &Cli,
    id: &str,
) -> Result<
    Option<(
        uturn_control::state::Siblings,
        uturn_dataplane::io::SiblingSetup,
    )>,
    String,
> {
    use uturn_control::state::Siblings;
    let Some(spec) = cli.siblings.as_deref() else {
        return Ok(None);
    };
    let siblings = match spec.split_once(':') {
        None if spec == "k8s" => Siblings::Service(id.to_owned()),
        Some(("k8s", service)) if service.split_once('/').is_some() => {
            Siblings::Service(service.to_owned())
        }
        Some(("static", list)) => Siblings::Static(
            list.split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|s| {
                    s.trim()
                        .parse()
                        .map_err(|_| format!("--siblings {spec:?}: {s:?} is not an IP address"))
                })
                .collect::<Result<_, _>>()?,
        ),
        _ => {
            return Err(format!(
                "--siblings {spec:?}: use k8s, k8s:<namespace>/<service> or static:<ip>,<ip>"
            ))
        }
    };
    let key = match (&cli.sibling_key_file, std::env::var("UTURN_SIBLING_KEY")) {
        (Some(path), _) => {
            std::fs::read(path).map_err(|e| format!("--sibling-key-file {path:?}: {e}"))?
        }
        (None, Ok(key)) => key.into_bytes(),
        (None, Err(_)) => {
            return Err(
                "--siblings needs the key the gateway's pods share: --sibling-key-file PATH \
                 (a mounted Secret) or UTURN_SIBLING_KEY"
                    .to_owned(),
            )
        }
    };
    let key = uturn_dataplane::proto::sibling::SiblingKey::new(&key)
        .map_err(|e| format!("--siblings: {e}"))?;
    Ok(Some((
        siblings,
        uturn_dataplane::io::SiblingSetup {
            key,
            port: cli.sibling_port,
        },
    )))
}

/// `--license`: the JSON licensegen writes, `{"license_config":{"key":…,"hmac":…}}` or the bare
/// `{"key":…,"hmac":…}`, both strings non-empty; the `license_config` value it gives.
fn parse_license(json: &str) -> Result<serde_json::Value, String> {
    let bad = || {
        "invalid --license: expecting the JSON licensegen writes, \
         {\"license_config\":{\"key\":\"…\",\"hmac\":\"…\"}} or {\"key\":\"…\",\"hmac\":\"…\"}, \
         with both fields non-empty"
            .to_owned()
    };
    let value: serde_json::Value = serde_json::from_str(json).map_err(|_| bad())?;
    let inner = value.get("license_config").unwrap_or(&value);
    let field = |key: &str| {
        inner
            .get(key)
            .and_then(|v| v.as_str())
            .filter(|v| !v.is_empty())
    };
    match (field("key"), field("hmac")) {
        (Some(key), Some(hmac)) => Ok(serde_json::json!({"key": key, "hmac": hmac})),
        _ => Err(bad()),
    }
}

/// `--io-engine`: which kernel interface the shards use for their sockets. (Not "engine" in
/// code: that word is the TURN engine.)
// No `///` on the variants: clap would print them as a second list in `--help`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum IoBackendFlag {
    // io_uring where the probe passes, else epoll.
    Auto,
    // io_uring, or exit 1 naming why it cannot run.
    Uring,
    // epoll readiness, for hosts whose seccomp profile blocks io_uring.
    Epoll,
}

impl IoBackendFlag {
    /// The dataplane's selection request for this flag value.
    fn choice(self) -> BackendChoice {
        match self {
            IoBackendFlag::Auto => BackendChoice::Auto,
            IoBackendFlag::Uring => BackendChoice::Uring,
            IoBackendFlag::Epoll => BackendChoice::Epoll,
        }
    }
}

/// The kubectl connection flags stunnerd accepts (used by -c k8s).
#[derive(clap::Args, Debug)]
struct KubeFlags {
    /// Path to the kubeconfig file.
    #[arg(long)]
    kubeconfig: Option<String>,
    /// Kubeconfig context.
    #[arg(long)]
    context: Option<String>,
    /// Kubeconfig cluster.
    #[arg(long)]
    cluster: Option<String>,
    /// Kubeconfig user.
    #[arg(long)]
    user: Option<String>,
    /// Namespace.
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    /// API server address.
    #[arg(short = 's', long)]
    server: Option<String>,
    /// Bearer token.
    #[arg(long)]
    token: Option<String>,
    /// Impersonate user.
    #[arg(long = "as")]
    as_user: Option<String>,
    /// Impersonate groups.
    #[arg(long = "as-group")]
    as_group: Vec<String>,
    /// Impersonate UID.
    #[arg(long = "as-uid")]
    as_uid: Option<String>,
    /// CA certificate file.
    #[arg(long = "certificate-authority")]
    certificate_authority: Option<String>,
    /// Client certificate file.
    #[arg(long = "client-certificate")]
    client_certificate: Option<String>,
    /// Client key file.
    #[arg(long = "client-key")]
    client_key: Option<String>,
    /// Skip TLS verification.
    #[arg(long = "insecure-skip-tls-verify")]
    insecure_skip_tls_verify: bool,
    /// TLS server name.
    #[arg(long = "tls-server-name")]
    tls_server_name: Option<String>,
    /// Request timeout.
    #[arg(long = "request-timeout")]
    request_timeout: Option<String>,
    /// Cache directory.
    #[arg(long = "cache-dir")]
    cache_dir: Option<String>,
    /// Basic-auth username.
    #[arg(long)]
    username: Option<String>,
    /// Basic-auth password.
    #[arg(long)]
    password: Option<String>,
}

fn instance_id(cli: &Cli) -> String {
    if let Some(id) = &cli.id {
        return id.clone();
    }
    if let (Ok(ns), Ok(name)) = (
        std::env::var("STUNNER_NAMESPACE"),
        std::env::var("STUNNER_NAME"),
    ) {
        return format!("{ns}/{name}");
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    format!("default/stunnerd-{host}")
}

/// The host of the TURN URI a config was built from (its v1 listener's address).
fn uri_host(config: &StunnerConfig) -> String {
    config
        .v1
        .as_ref()
        .and_then(|v1| v1.listeners.first())
        .map(|l| l.address.clone())
        .unwrap_or_default()
}

/// Where the config comes from: the first one, and what to follow afterwards.
fn initial_config(cli: &Cli, id: &str) -> Result<(StunnerConfig, Source, &'static str), String> {
    if let Some(uri) = cli.turn_uri() {
        let mut config = StunnerConfig::from_turn_uri(uri).map_err(|e| e.to_string())?;
        // A TLS/DTLS listener from a TURN URI gets a fresh self-signed certificate.
        let host = uri_host(&config);
        for listener in &mut config.listeners {
            let tls = matches!(listener.protocol, Transport::Tls | Transport::Dtls);
            if tls && listener.cert.is_empty() {
                let (cert, key) = uturn_dataplane::io::tls::self_signed(&host)?;
                listener.cert = base64::engine::general_purpose::STANDARD.encode(cert);
                listener.key = base64::engine::general_purpose::STANDARD.encode(key);
            }
        }
        return Ok((config, Source::Fixed, "TURN-URI"));
    }
    let node = std::env::var("STUNNER_NODENAME").ok();
    let origin = ConfigOrigin::parse(&cli.config);
    if !cli.watch {
        let config = load_once(&origin, id, node.as_deref())
            .map_err(|e| format!("could not load config: {e}"))?;
        return Ok((config, Source::Fixed, "once"));
    }
    // A watcher starts from the zero config; the first config from the origin replaces it.
    let source = match origin {
        ConfigOrigin::File(path) => Source::File(path),
        ConfigOrigin::Cds(url) => Source::Cds(CdsTarget::new(&url, id, node.as_deref())?),
        ConfigOrigin::K8s => {
            return Err(load_once(&origin, id, None)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default())
        }
    };
    Ok((StunnerConfig::zero(id), source, "watch"))
}

/// Raises the open-file limit to its hard maximum: every TCP/TLS client and every allocation
/// holds a socket, and the usual soft limit (1024) is far below what a gateway serves.
fn raise_fd_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

fn main() -> ExitCode {
    // Before any thread exists, so that every thread inherits the mask.
    let _ = SHUTDOWN_SIGNALS.set(block_shutdown_signals());
    raise_fd_limit();
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let (kube, env_ignored) = match kube_options(&cli.kube, &matches) {
        Ok(options) => options,
        Err(e) => {
            eprintln!("stunnerd: {e}");
            return ExitCode::from(1);
        }
    };
    if let Err(e) = cli.check_positional() {
        eprintln!("stunnerd: {e}");
        return ExitCode::from(1);
    }
    let siblings = match sibling_options(&cli, &instance_id(&cli)) {
        Ok(siblings) => siblings,
        Err(e) => {
            eprintln!("stunnerd: {e}");
            return ExitCode::from(1);
        }
    };
    let license = match cli.license.as_deref().map(parse_license).transpose() {
        Ok(license) => license,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(1);
        }
    };
    let cli_log = cli
        .log
        .clone()
        .or_else(|| cli.verbose.then(|| "all:DEBUG".to_string()));
    let id = instance_id(&cli);
    // Applied to every config, the first and each one received later.
    let rewrite = move |config: &mut StunnerConfig| {
        if let Some(license) = &license {
            config.admin.license_config = Some(license.clone());
        }
    };
    let (mut config, source, mode) = match initial_config(&cli, &id) {
        Ok(initial) => initial,
        Err(e) => {
            eprintln!("stunnerd: {e}");
            return ExitCode::from(1);
        }
    };
    rewrite(&mut config);
    let from_uri = mode == "TURN-URI";
    let log_spec = cli_log
        .clone()
        .unwrap_or_else(|| config.admin.loglevel.clone());
    logging::init(&log_spec, cli.log_format);
    for ignored in &env_ignored {
        tracing::warn!(target: "stunnerd", "{ignored}");
    }
    tracing::info!(
        target: "stunnerd",
        "starting stunnerd id {:?}, STUNner config origin {:?}, uturn {}",
        id,
        if from_uri { "TURN-URI" } else { cli.config.as_str() },
        env!("CARGO_PKG_VERSION")
    );
    if from_uri {
        // The password is the URI's: logging it would put a credential in every log store.
        if let (Some(user), Some(l)) = (
            config.auth.credentials.get("username"),
            config.listeners.first(),
        ) {
            tracing::info!(
                target: "stunnerd",
                "TURN server on {}:{} ({}), realm {:?}: use username {:?} and the password \
                 from the TURN URI",
                uri_host(&config),
                l.port,
                l.protocol.as_str(),
                config.auth.realm,
                user
            );
        }
    }
    for warning in config.warnings() {
        tracing::warn!(target: "stunnerd", "{warning}");
    }
    if config.listeners.is_empty() {
        tracing::warn!(target: "stunner", "Running with no listeners: gateway unreachable");
    }
    if config.clusters.is_empty() {
        tracing::warn!(target: "stunner", "Running with no clusters: TURN forwarding to peers not permitted");
    }
    let shared_ports = if cli.allow_shared_ports {
        SharedPorts::Allow
    } else {
        SharedPorts::Refuse
    };
    // A config whose TLS material does not load, or whose ports another process serves, is
    // refused at start as it would be on reload (a dry run opens no port, so checks no port).
    let initial_check = match cli.dry_run {
        true => check_tls_material(&config),
        false => check_config(&StunnerConfig::zero(&id), &config, shared_ports),
    };
    if let Err(e) = initial_check {
        tracing::error!(target: "stunnerd", "{e}");
        return ExitCode::from(1);
    }
    if cli.dry_run {
        tracing::info!(target: "stunnerd", "dry run: config is valid; not opening any socket");
        let shown = uturn_control::redacted(&config);
        println!(
            "{}",
            serde_json::to_string_pretty(&shown).unwrap_or_default()
        );
        return ExitCode::SUCCESS;
    }
    let snapshot = uturn_control::first_snapshot(&config);
    let shards = std::env::var("UTURN_SHARDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|n: &usize| *n > 0)
        .unwrap_or_else(usable_cpus);
    let mut nonce_key = [0u8; 32];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut nonce_key);
    let backend = match select_backend(cli.io_engine.choice()) {
        Ok((backend, why)) => {
            tracing::info!(target: "stunnerd", "io engine: {backend} ({why})");
            backend
        }
        Err(why) => {
            tracing::error!(target: "stunnerd", "cannot use --io-engine uring: {why}");
            return ExitCode::from(1);
        }
    };
    tracing::info!(
        target: "stunnerd",
        "dataplane: {} shard(s) on {}, {} UDP socket(s) per TURN-UDP listener",
        shards,
        match backend {
            IoBackend::Uring => "io_uring",
            IoBackend::Epoll => "epoll",
        },
        cli.udp_thread_num.max(1)
    );
    let offload_mode = match cli
        .offload
        .as_deref()
        .unwrap_or(config.admin.offload_engine.as_str())
        .parse::<OffloadMode>()
    {
        Ok(mode) => mode,
        Err(e) => {
            tracing::error!(target: "stunnerd", "--offload: {e}");
            return ExitCode::from(1);
        }
    };
    let (offload, offload_status) = offload::start(offload_mode, &config.admin.offload_interfaces);
    let offload_live = offload.clone();
    let dataplane = match Dataplane::start(DataplaneConfig {
        shards,
        offload,
        siblings: siblings.as_ref().map(|(_, setup)| setup.clone()),
        udp_thread_num: cli.udp_thread_num,
        snapshot: snapshot.clone(),
        nonce_key,
        backend,
        limits: uturn_dataplane::proto::Limits {
            challenge_rate: cli.challenge_rate,
            challenge_burst: cli.challenge_burst,
            max_allocations: cli.max_allocations,
            max_permissions: cli.max_permissions as usize,
        },
        stream_limits: uturn_dataplane::io::admission::StreamLimits {
            max_unauthenticated: cli.max_unauthenticated_connections,
            max_unauthenticated_per_ip: cli.max_unauthenticated_connections_per_ip,
        },
    }) {
        Ok(d) => d,
        Err(e) => {
            tracing::error!(target: "stunnerd", "cannot start dataplane: {e}");
            return ExitCode::from(1);
        }
    };
    let stats = dataplane.stats_handle();
    let scrape_stats = dataplane.stats_handle();
    let certificates = Arc::new(CertificateExpiry::new());
    let (applied_certificates, scraped_certificates) = (certificates.clone(), certificates.clone());
    let status_stats = dataplane.stats_handle();
    let session_stats = dataplane.stats_handle();
    let follow_loglevel = cli_log.is_none();
    let offload_flag_set = cli.offload.is_some();
    let offload_seen = std::sync::Mutex::new((
        config.admin.offload_engine.clone(),
        config.admin.offload_interfaces.clone(),
    ));
    let offload_running = offload_status.running;
    let status_snapshot = snapshot.clone();
    let forwarding = siblings.is_some();
    let running_loglevel = std::sync::Mutex::new(log_spec);
    let control = match Control::start(ControlConfig {
        source,
        initial: config,
        snapshot,
        kube,
        discovery_timeout: Duration::from_secs(cli.discovery_timeout),
        allocations: Arc::new(move || {
            stats
                .iter()
                .map(|s| s.allocations.load(std::sync::atomic::Ordering::Relaxed))
                .sum()
        }),
        listener_allocations: Arc::new(move || {
            let mut total: Vec<(String, u64)> = Vec::new();
            for shard in session_stats.iter() {
                let Ok(report) = shard.report.lock() else {
                    continue;
                };
                for (name, n) in &report.listener_allocations {
                    add_count(&mut total, name.clone(), *n);
                }
            }
            total
        }),
        siblings: siblings.map(|(siblings, _)| siblings).unwrap_or_default(),
        rewrite: Box::new(rewrite),
        on_config: Box::new(move |config: &StunnerConfig| {
            applied_certificates.observe(config, unix_now());
            let Ok(mut running) = running_loglevel.lock() else {
                return;
            };
            if follow_loglevel && *running != config.admin.loglevel {
                running.clone_from(&config.admin.loglevel);
                logging::set_spec(&config.admin.loglevel);
            }
            // The offload is chosen once, at start; say so when a config asks for another.
            let asked = (
                config.admin.offload_engine.clone(),
                config.admin.offload_interfaces.clone(),
            );
            let Ok(mut seen) = offload_seen.lock() else {
                return;
            };
            if offload_flag_set || asked == *seen {
                return;
            }
            tracing::warn!(
                target: "stunnerd",
                "admin.offload_engine {:?} / offload_interfaces {:?}: the offload is chosen at \
                 start ({} runs); restart stunnerd to change it",
                asked.0,
                asked.1,
                offload_running
            );
            *seen = asked;
        }),
        metrics: Arc::new(move |recorder: &dyn metrics::Recorder| {
            uturn_dataplane::io::metrics::record(&scrape_stats, recorder);
            scraped_certificates.record(recorder);
        }),
        force_ready: cli.force_ready_status,
        dataplane_status: Arc::new(
            move |doc: &mut serde_json::Map<String, serde_json::Value>| {
                let channels: u64 = status_stats
                    .iter()
                    .map(|s| s.report.lock().map(|r| r.offload_channels).unwrap_or(0))
                    .sum();
                // Live: XDP is taken off an interface that drops what it sends.
                let (running, xdp_interfaces) = match &offload_live {
                    Some(o) => (o.running(), o.xdp_interfaces()),
                    None => (offload_status.running, Vec::new()),
                };
                if forwarding {
                    // Each sibling, and how many clients this pod forwards to it.
                    let mut forwarding_for: Vec<(std::net::IpAddr, u64)> = Vec::new();
                    for shard in status_stats.iter() {
                        let Ok(report) = shard.report.lock() else {
                            continue;
                        };
                        for &(ip, n) in report.siblings.iter().flat_map(|(_, owners)| owners) {
                            add_count(&mut forwarding_for, ip, n);
                        }
                    }
                    let siblings: Vec<serde_json::Value> = status_snapshot
                        .load()
                        .sibling_ips
                        .iter()
                        .map(|ip| {
                            let n = forwarding_for
                                .iter()
                                .find(|(i, _)| i == ip)
                                .map_or(0, |(_, n)| *n);
                            serde_json::json!({"address": ip, "forwarding_for": n})
                        })
                        .collect();
                    doc.insert("siblings".into(), serde_json::Value::Array(siblings));
                }
                doc.insert(
                    "offload".into(),
                    serde_json::json!({
                        "requested": offload_status.requested.name(),
                        "running": running,
                        "reason": offload_status.reason,
                        "interfaces": offload_status.interfaces,
                        "xdp_interfaces": xdp_interfaces,
                        "channels": channels,
                    }),
                );
            },
        ),
        check: Box::new(move |running: &StunnerConfig, new: &StunnerConfig| {
            check_config(running, new, shared_ports)
        }),
    }) {
        Ok(control) => control,
        Err(e) => {
            tracing::error!(target: "stunnerd", "cannot start the control thread: {e}");
            return ExitCode::from(1);
        }
    };
    run_until_drained(
        &dataplane,
        &control,
        cli.drain_timeout.map(Duration::from_secs),
        cli.no_graceful_shutdown,
        &|| certificates.recheck(unix_now()),
    );
    ExitCode::SUCCESS
}

/// Seconds since the Unix epoch.
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// Blocks SIGTERM and SIGINT in the calling thread and every thread it starts later, so that
/// only [`next_signal`] sees them. Call before any thread is spawned.
fn block_shutdown_signals() -> libc::sigset_t {
    // SAFETY: plain libc signal-set manipulation on a set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Waits up to `timeout` for SIGTERM or SIGINT; the signal, if one came.
fn next_signal(set: &libc::sigset_t, timeout: Duration) -> Option<i32> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: set and ts are valid for the call; no siginfo is requested.
    let signal = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) };
    (signal > 0).then_some(signal)
}

/// Runs until SIGTERM or SIGINT, then drains as stunnerd does: the config loader stops,
/// readiness fails (unless forced), every allocation keeps working, and the process exits once
/// the last allocation is gone (or `drain_timeout` passes).
///
/// With `--no-graceful-shutdown` (`immediate`) it exits at once instead, closing every socket.
/// Until the signal it calls `every_second` about once a second.
fn run_until_drained(
    dataplane: &Dataplane,
    control: &Control,
    drain_timeout: Option<Duration>,
    immediate: bool,
    every_second: &dyn Fn(),
) {
    let signals = SHUTDOWN_SIGNALS
        .get()
        .copied()
        .unwrap_or_else(block_shutdown_signals);
    const POLL: Duration = Duration::from_millis(250);
    while next_signal(&signals, Duration::from_secs(1)).is_none() {
        every_second();
    }
    if immediate {
        tracing::info!(
            target: "stunnerd",
            "exiting with {} active connection(s): graceful shutdown is disabled",
            dataplane.allocation_count()
        );
        return;
    }
    tracing::info!(
        target: "stunnerd",
        "Commencing graceful shutdown with {} active connection(s)",
        dataplane.allocation_count()
    );
    control.begin_drain();
    let started = std::time::Instant::now();
    loop {
        if dataplane.allocation_count() == 0 {
            tracing::info!(target: "stunnerd", "Normal exit on graceful shutdown");
            return;
        }
        if drain_timeout.is_some_and(|t| started.elapsed() >= t) {
            tracing::warn!(
                target: "stunnerd",
                "graceful shutdown timed out (--drain-timeout) with {} active connection(s): exiting",
                dataplane.allocation_count()
            );
            return;
        }
        if let Some(signal) = next_signal(&signals, POLL) {
            // A repeated signal restarts nothing, as in stunnerd; say it was seen.
            tracing::info!(
                target: "stunnerd",
                "signal {signal} during graceful shutdown: still waiting for {} active connection(s)",
                dataplane.allocation_count()
            );
        }
    }
}

/// The signal set blocked at the start of `main`.
static SHUTDOWN_SIGNALS: std::sync::OnceLock<libc::sigset_t> = std::sync::OnceLock::new();

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
fn kube_options(
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
