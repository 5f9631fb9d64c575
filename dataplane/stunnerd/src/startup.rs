//! Starting up, in stunnerd's order: the flags checked before the log exists ([`Checked`]),
//! the first config and where later ones come from ([`initial_config`]), the log and what it
//! says first ([`start_logging`]), what the first config and the flags must pass before
//! anything opens ([`check_start`]), and the shards ([`start_dataplane`]). Anything that
//! stops the start is a [`Refusal`].

use crate::flags::Cli;
use crate::kube_flags::kube_options;
use crate::logging;
use crate::offload;
use crate::siblings;
use base64::Engine as _;
use std::io::Write as _;
use uturn_control::cds::CdsTarget;
use uturn_control::kubernetes::KubeOptions;
use uturn_control::origin::{load_once, ConfigOrigin};
use uturn_control::state::Siblings;
use uturn_control::{License, Source};
use uturn_dataplane::io::check::{check_config, check_tls_material, SharedPorts};
use uturn_dataplane::io::offload::OffloadMode;
use uturn_dataplane::io::state::StateDir;
use uturn_dataplane::io::{admission::StreamLimits, SiblingSetup};
use uturn_dataplane::io::{select_backend, usable_cpus, Dataplane, DataplaneConfig, IoBackend};
use uturn_shared::config::{StunnerConfig, Transport};
use uturn_shared::logspec::SpecProblem;
use uturn_shared::snapshot::SnapshotHandle;

/// Why stunnerd exits 1 before it serves.
pub(crate) enum Refusal {
    /// Found before the log is set up: printed on stderr as it is.
    Usage(String),
    /// Found after: logged at ERROR.
    Logged(String),
}

impl Refusal {
    /// Says why, where it belongs.
    pub(crate) fn report(&self) {
        match self {
            Refusal::Usage(why) => eprintln!("{why}"),
            Refusal::Logged(why) => tracing::error!(target: "stunnerd", "{why}"),
        }
    }
}

/// What the flags give once checked, before the log is set up.
pub(crate) struct Checked {
    /// `<namespace>/<name>` ([`instance_id`]).
    pub(crate) id: String,
    /// How to reach the Kubernetes API server.
    pub(crate) kube: KubeOptions,
    /// kubectl and CDS flags set in the environment, which are ignored (to log).
    pub(crate) env_ignored: Vec<String>,
    /// Where the siblings come from and the forwarding setup (`--siblings`).
    pub(crate) siblings: Option<(Siblings, SiblingSetup)>,
    /// `--license`.
    pub(crate) license: Option<License>,
    /// The log spec `-l` or `-v` sets (it overrides `admin.loglevel`).
    pub(crate) log: Option<String>,
    /// What is wrong with it but does not stop the start (to log).
    pub(crate) log_problems: Vec<SpecProblem>,
}

impl Checked {
    /// Checks the flags in stunnerd's order; the first problem refuses the start.
    pub(crate) fn new(cli: &Cli, matches: &clap::ArgMatches) -> Result<Checked, Refusal> {
        let usage = |e: String| Refusal::Usage(format!("stunnerd: {e}"));
        let (kube, env_ignored) = kube_options(&cli.kube, matches).map_err(usage)?;
        cli.check_positional().map_err(usage)?;
        let id = instance_id(cli);
        let siblings = siblings::forwarding(
            cli.siblings.as_ref(),
            &id,
            cli.sibling_key_file.as_deref(),
            cli.sibling_port,
        )
        .map_err(usage)?;
        let license = cli
            .license
            .as_deref()
            .map(License::parse)
            .transpose()
            .map_err(Refusal::Usage)?;
        let log = cli
            .log
            .clone()
            .or_else(|| cli.verbose.then(|| "all:DEBUG".to_string()));
        let log_problems = log
            .as_deref()
            .map(uturn_shared::logspec::check)
            .unwrap_or_default();
        if let Some(skipped) = log_problems.iter().find(|p| p.is_skipped()) {
            return Err(Refusal::Usage(format!(
                "stunnerd: -l/--log {:?}: {skipped}",
                log.unwrap_or_default()
            )));
        }
        Ok(Checked {
            id,
            kube,
            env_ignored,
            siblings,
            license,
            log,
            log_problems,
        })
    }
}

/// `--id`, else `$STUNNER_NAMESPACE/$STUNNER_NAME`, else `default/stunnerd-<hostname>`.
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

/// How the first config was got, and so what follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConfigMode {
    /// The positional TURN URI's built-in config, for the process's life.
    TurnUri,
    /// `-c` without `-w`: loaded once, kept for the process's life.
    Once,
    /// `-c … -w`: the zero config until the origin sends one, then each one it sends.
    Watch,
}

/// The first config, where later ones come from, and how it was got.
pub(crate) struct InitialConfig {
    /// The config the dataplane starts with (`--license` applied).
    pub(crate) config: StunnerConfig,
    /// Where later configs come from.
    pub(crate) source: Source,
    /// How it was got.
    pub(crate) mode: ConfigMode,
}

/// Loads the first config as the flags say: a TURN URI's built-in one, the origin's once, or
/// the zero config a watcher starts from.
pub(crate) fn initial_config(cli: &Cli, checked: &Checked) -> Result<InitialConfig, Refusal> {
    let mut initial =
        load_initial(cli, &checked.id).map_err(|e| Refusal::Usage(format!("stunnerd: {e}")))?;
    if let Some(license) = &checked.license {
        license.apply(&mut initial.config);
    }
    Ok(initial)
}

fn load_initial(cli: &Cli, id: &str) -> Result<InitialConfig, String> {
    let fixed = |config, mode| InitialConfig {
        config,
        source: Source::Fixed,
        mode,
    };
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
        return Ok(fixed(config, ConfigMode::TurnUri));
    }
    let node = std::env::var("STUNNER_NODENAME").ok();
    let origin = ConfigOrigin::parse(&cli.config);
    if !cli.watch {
        let config = load_once(&origin, id, node.as_deref())
            .map_err(|e| format!("could not load config: {e}"))?;
        return Ok(fixed(config, ConfigMode::Once));
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
    Ok(InitialConfig {
        config: StunnerConfig::zero(id),
        source,
        mode: ConfigMode::Watch,
    })
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

/// Sets up the log (`-l`/`-v`, else the first config's `admin.loglevel`) and writes its first
/// lines: what the flags and the config ask for that works otherwise than one may expect, and
/// what is starting. Returns the spec it runs with.
pub(crate) fn start_logging(cli: &Cli, checked: &Checked, initial: &InitialConfig) -> String {
    let config = &initial.config;
    let spec = checked
        .log
        .clone()
        .unwrap_or_else(|| config.admin.loglevel.clone());
    logging::init(&spec, cli.log_format);
    for ignored in &checked.env_ignored {
        tracing::warn!(target: "stunnerd", "{ignored}");
    }
    for problem in &checked.log_problems {
        tracing::warn!(target: "stunnerd", "-l/--log: {problem}");
    }
    let from_uri = initial.mode == ConfigMode::TurnUri;
    tracing::info!(
        target: "stunnerd",
        "starting stunnerd id {:?}, STUNner config origin {:?}, uturn {}",
        checked.id,
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
                uri_host(config),
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
    for warning in config.empty_warnings() {
        tracing::warn!(target: "stunner", "{warning}");
    }
    spec
}

/// What a start needs once its flags and first config passed.
pub(crate) struct StartPlan {
    /// The kernel offload to run.
    pub(crate) offload: OffloadMode,
    /// What waits for the sockets.
    pub(crate) backend: IoBackend,
    /// Whether a listener may open a port another process serves.
    pub(crate) shared_ports: SharedPorts,
}

/// Refuses at start what a reload would refuse (TLS material that does not load, ports another
/// process serves; a dry run opens no port, so checks no port), and checks every flag a start
/// acts on: the offload mode (its program is loaded only by a real start, and never stops
/// one) and the IO engine (probed).
pub(crate) fn check_start(
    cli: &Cli,
    checked: &Checked,
    config: &StunnerConfig,
) -> Result<StartPlan, Refusal> {
    let shared_ports = if cli.allow_shared_ports {
        SharedPorts::Allow
    } else {
        SharedPorts::Refuse
    };
    let initial_check = match cli.dry_run {
        true => check_tls_material(config),
        false => check_config(&StunnerConfig::zero(&checked.id), config, shared_ports),
    };
    initial_check.map_err(Refusal::Logged)?;
    let offload = offload::mode(cli.offload, config).map_err(Refusal::Logged)?;
    let backend = match select_backend(cli.io_engine.choice()) {
        Ok((backend, why)) => {
            tracing::info!(target: "stunnerd", "io engine: {backend} ({why})");
            backend
        }
        Err(why) => {
            return Err(Refusal::Logged(format!(
                "cannot use --io-engine uring: {why}"
            )))
        }
    };
    Ok(StartPlan {
        offload,
        backend,
        shared_ports,
    })
}

/// `-d`: says the config is valid and prints it as it would run (secrets redacted).
pub(crate) fn dry_run(config: &StunnerConfig) {
    tracing::info!(target: "stunnerd", "dry run: config is valid; not opening any socket");
    let shown = uturn_control::redacted(config);
    // Not println!: a closed stdout (`stunnerd -d … | head`) is no reason to panic.
    let _ = writeln!(
        std::io::stdout(),
        "{}",
        serde_json::to_string_pretty(&shown).unwrap_or_default()
    );
}

/// Starts the kernel offload `plan` asks for and the shards on `snapshot`: one per usable CPU
/// (or `$UTURN_SHARDS`), with the flags' limits and the siblings' forwarding setup.
pub(crate) fn start_dataplane(
    cli: &Cli,
    config: &StunnerConfig,
    snapshot: &SnapshotHandle,
    plan: &StartPlan,
    siblings: Option<SiblingSetup>,
) -> Result<(Dataplane, offload::OffloadChoice), Refusal> {
    let shards = std::env::var("UTURN_SHARDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|n: &usize| *n > 0)
        .unwrap_or_else(usable_cpus);
    // With a state directory, the nonce key is the last process's: a client's nonce stays
    // valid across a restart, so its next request gets no 438.
    // The flag, else the config's `admin.state_dir` (read at start only).
    let from_config = Some(&config.admin.state_dir).filter(|dir| !dir.is_empty());
    let state = cli
        .state_dir
        .clone()
        .or_else(|| from_config.map(std::path::PathBuf::from))
        .as_deref()
        .map(StateDir::open)
        .transpose()
        .map_err(Refusal::Logged)?;
    let nonce_key = match &state {
        Some(state) => state.nonce_key().map_err(Refusal::Logged)?,
        None => {
            let mut key = [0u8; 32];
            rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut key);
            key
        }
    };
    tracing::info!(
        target: "stunnerd",
        "dataplane: {} shard(s) on {}, {} UDP socket(s) per TURN-UDP listener",
        shards,
        match plan.backend {
            IoBackend::Uring => "io_uring",
            IoBackend::Epoll => "epoll",
        },
        cli.udp_thread_num.max(1)
    );
    let (running, choice) =
        offload::OffloadChoice::start(plan.offload, cli.offload.is_some(), config);
    let dataplane = Dataplane::start(DataplaneConfig {
        shards,
        offload: running,
        siblings,
        udp_thread_num: cli.udp_thread_num,
        snapshot: snapshot.clone(),
        nonce_key,
        state: state.map(std::sync::Arc::new),
        backend: plan.backend,
        limits: uturn_dataplane::proto::Limits {
            challenge_rate: cli.challenge_rate,
            challenge_burst: cli.challenge_burst,
            max_allocations: cli.max_allocations,
            max_permissions: cli.max_permissions as usize,
        },
        stream_limits: StreamLimits {
            max_unauthenticated: cli.max_unauthenticated_connections,
            max_unauthenticated_per_ip: cli.max_unauthenticated_connections_per_ip,
        },
    })
    .map_err(|e| Refusal::Logged(format!("cannot start dataplane: {e}")))?;
    Ok((dataplane, choice))
}

/// Raises the open-file limit to its hard maximum: every TCP/TLS client and every allocation
/// holds a socket, and the usual soft limit (1024) is far below what a gateway serves.
pub(crate) fn raise_fd_limit() {
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
