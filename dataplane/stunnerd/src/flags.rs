//! stunnerd's command line, flag for flag, and uturn's own flags ([`Cli`]): each mode a flag
//! names is parsed into its type here (`--offload` an [`OffloadMode`], `--siblings` a
//! [`SiblingsFlag`], `--io-engine` an [`IoBackendFlag`]), so the rest of the binary never
//! compares strings. The kubectl connection flags are [`KubeFlags`].

use crate::kube_flags::KubeFlags;
use crate::logging::LogFormat;
use crate::siblings::SiblingsFlag;
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, FromArgMatches, Parser, ValueEnum};
use uturn_dataplane::io::offload::OffloadMode;
use uturn_dataplane::io::BackendChoice;

/// STUNner's stunnerd command line, flag for flag.
#[derive(Parser, Debug)]
#[command(
    name = "stunnerd",
    version,
    about = "uturn: a TURN media gateway dataplane for Kubernetes (stunnerd-compatible)"
)]
pub(crate) struct Cli {
    /// Config origin: file://PATH, or the config discovery server (CDS) as IP:port or an
    /// http(s):// or ws(s):// URL. (stunnerd's `k8s`, which finds the CDS server itself, is
    /// refused: name the server.)
    #[arg(
        short = 'c',
        long = "config",
        env = "STUNNER_CONFIG_ORIGIN",
        default_value = ":13478"
    )]
    pub(crate) config: String,
    // The help names its placeholders in angle brackets, as stunnerd's does, which a doc
    // comment would make HTML tags: it is given as `help` (here and below).
    #[arg(
        short = 'l',
        long = "log",
        help = "Log level spec <scope>:<LEVEL>[,…], e.g. all:INFO,stunner:DEBUG (overrides \
                admin.loglevel); an item that is not scope:LEVEL with a known level is refused"
    )]
    pub(crate) log: Option<String>,
    /// Log format: text or json.
    #[arg(long = "log-format", value_enum, default_value_t = LogFormat::Text)]
    pub(crate) log_format: LogFormat,
    #[arg(short = 'i', long = "id", help = "Instance id <namespace>/<name>")]
    pub(crate) id: Option<String>,
    /// Watch the config origin for updates.
    #[arg(short = 'w', long = "watch")]
    pub(crate) watch: bool,
    /// SO_REUSEPORT sockets per TURN-UDP listener (0: one).
    #[arg(short = 'u', long = "udp-thread-num", default_value_t = 0)]
    pub(crate) udp_thread_num: usize,
    /// Check the flags and the first config (printed as it would run), open nothing, exit.
    #[arg(short = 'd', long = "dry-run")]
    pub(crate) dry_run: bool,
    /// Keep /ready at 200, also while draining.
    #[arg(long = "force-ready-status")]
    pub(crate) force_ready_status: bool,
    /// uturn: open listener ports that another process already serves (and share their
    /// clients with it through SO_REUSEPORT) instead of refusing the config.
    #[arg(long = "allow-shared-ports")]
    pub(crate) allow_shared_ports: bool,
    /// uturn: end a graceful shutdown after this many seconds even if allocations remain
    /// (default: wait for the last one, as stunnerd).
    #[arg(long = "drain-timeout", value_name = "SECONDS")]
    pub(crate) drain_timeout: Option<u64>,
    /// uturn: IO engine: auto (io_uring where it works, else epoll), uring or epoll.
    #[arg(
        long = "io-engine",
        env = "UTURN_IO_ENGINE",
        value_enum,
        default_value_t = IoBackendFlag::Auto
    )]
    pub(crate) io_engine: IoBackendFlag,
    /// Kernel offload of ChannelData: none, tc, xdp or auto (default: the config's
    /// admin.offload_engine, which defaults to none). tc and auto never stop the server: if the
    /// program cannot run, it relays in user space and logs why.
    #[arg(long = "offload", env = "UTURN_OFFLOAD", value_name = "MODE")]
    pub(crate) offload: Option<OffloadMode>,
    /// uturn: keep the allocations in this directory (under Kubernetes an emptyDir with
    /// medium Memory), so that the next process started on it carries the calls of UDP
    /// clients on after a crash or restart; one process per directory (default: none).
    #[arg(long = "state-dir", env = "UTURN_STATE_DIR", value_name = "DIR")]
    pub(crate) state_dir: Option<std::path::PathBuf>,
    /// uturn: how long /ready waits for the first EndpointSlice list of each Service that a
    /// KUBERNETES cluster names; after it, ready anyway with a warning (0: do not wait).
    #[arg(long = "discovery-timeout", value_name = "SECONDS", default_value_t = uturn_control::DEFAULT_DISCOVERY_TIMEOUT.as_secs())]
    pub(crate) discovery_timeout: u64,
    /// uturn: allocations held by all clients together; more get 508 (0: no cap).
    #[arg(long = "max-allocations", value_name = "N", default_value_t = uturn_dataplane::proto::limits::DEFAULT_MAX_ALLOCATIONS)]
    pub(crate) max_allocations: usize,
    /// uturn: permissions (and channels) one allocation may hold; more get 508.
    #[arg(long = "max-permissions", value_name = "N", default_value_t = uturn_dataplane::proto::limits::DEFAULT_MAX_PERMISSIONS as u32, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_permissions: u32,
    /// uturn: 401/438 challenges per second per source IP, on every transport (UDP, TCP, TLS,
    /// DTLS), beyond which they are dropped and counted (0: no limit).
    #[arg(long = "challenge-rate", value_name = "N", default_value_t = uturn_dataplane::proto::limits::DEFAULT_CHALLENGE_RATE)]
    pub(crate) challenge_rate: u32,
    /// uturn: challenges a source IP may get at once before --challenge-rate applies.
    #[arg(long = "challenge-burst", value_name = "N", default_value_t = uturn_dataplane::proto::limits::DEFAULT_CHALLENGE_BURST, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) challenge_burst: u32,
    /// uturn: TCP/TLS connections whose client holds no allocation yet, over the whole
    /// process; more are closed at accept (0: no cap).
    #[arg(long = "max-unauthenticated-connections", value_name = "N", default_value_t = uturn_dataplane::io::admission::DEFAULT_MAX_UNAUTHENTICATED)]
    pub(crate) max_unauthenticated_connections: usize,
    /// uturn: the same, from one client IP address (0: no cap).
    #[arg(long = "max-unauthenticated-connections-per-ip", value_name = "N", default_value_t = uturn_dataplane::io::admission::DEFAULT_MAX_UNAUTHENTICATED_PER_IP)]
    pub(crate) max_unauthenticated_connections_per_ip: u32,
    /// Same as -l all:DEBUG.
    #[arg(short = 'v', long = "verbose")]
    pub(crate) verbose: bool,
    /// Refused (it only serves stunnerd's -c k8s; give -c the CDS address); ignored in the
    /// environment.
    #[arg(long = "cds-server-address", env = "CDS_SERVER_ADDR")]
    pub(crate) cds_server_address: Option<String>,
    /// Refused (it only serves stunnerd's -c k8s; give -c the CDS address); ignored in the
    /// environment.
    #[arg(long = "cds-server-namespace", env = "CDS_SERVER_NAMESPACE")]
    pub(crate) cds_server_namespace: Option<String>,
    /// Refused (it only serves stunnerd's -c k8s; give -c the CDS address).
    #[arg(long = "cds-server-port", default_value_t = 13478)]
    pub(crate) cds_server_port: u16,
    #[arg(
        long = "siblings",
        env = "UTURN_SIBLINGS",
        value_name = "SPEC",
        help = "uturn: second-chance forwarding between the pods of this gateway: a client \
                datagram that finds no allocation here goes to the sibling pod that holds it. \
                `k8s` (the pods of the Service named by --id, `<namespace>/<gateway>` under \
                STUNner's operator), `k8s:<namespace>/<service>`, or `static:<ip>,<ip>,…`. Off \
                by default"
    )]
    pub(crate) siblings: Option<SiblingsFlag>,
    /// uturn: the UDP port of shard 0's sibling socket (shard i: port + i), the same on every
    /// pod of the gateway.
    #[arg(
        long = "sibling-port",
        env = "UTURN_SIBLING_PORT",
        default_value_t = 13479
    )]
    pub(crate) sibling_port: u16,
    /// uturn: the file holding the key the gateway's pods share to authenticate forwarded
    /// datagrams (at least 16 bytes; a mounted Secret), and optionally on a second line the
    /// next key (accepted too); read again when it changes. Else env UTURN_SIBLING_KEY.
    #[arg(
        long = "sibling-key-file",
        env = "UTURN_SIBLING_KEY_FILE",
        value_name = "PATH"
    )]
    pub(crate) sibling_key_file: Option<String>,
    /// STUNner v2: on SIGTERM/SIGINT close everything and exit at once, without draining.
    #[arg(long = "no-graceful-shutdown")]
    pub(crate) no_graceful_shutdown: bool,
    /// STUNner v2: license JSON ({"license_config":{"key":…,"hmac":…}} or {"key":…,"hmac":…});
    /// it replaces admin.license_config in every config (uturn has no licensed features).
    #[arg(long = "license", value_name = "JSON")]
    pub(crate) license: Option<String>,
    /// STUNner v2 tunnel mode only: SNI for a TLS/DTLS upstream (tunnel mode is refused).
    #[arg(long = "sni")]
    pub(crate) sni: Option<String>,
    /// STUNner v2 tunnel mode only: accept a self-signed upstream (tunnel mode is refused).
    #[arg(long = "insecure")]
    pub(crate) insecure: bool,
    #[command(flatten)]
    pub(crate) kube: KubeFlags,
    #[arg(
        value_name = "TURN-URI",
        help = "turn://user:pass@host:port?transport=udp: run a built-in default config. \
                (STUNner v2's tunnel mode, three arguments <client-addr> <turn-server-addr> \
                <peer-addr>, is refused.)"
    )]
    pub(crate) positional: Vec<String>,
}

impl Cli {
    /// The TURN URI of the one-URI mode.
    pub(crate) fn turn_uri(&self) -> Option<&String> {
        match self.positional.as_slice() {
            [uri] => Some(uri),
            _ => None,
        }
    }

    /// Refuses what the positional arguments ask for beyond a TURN URI: STUNner v2's tunnel
    /// mode (three), or a count no mode takes.
    pub(crate) fn check_positional(&self) -> Result<(), String> {
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

/// `--io-engine`: which kernel interface the shards use for their sockets. (Not "engine" in
/// code: that word is the TURN engine.)
// No `///` on the variants: clap would print them as a second list in `--help`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IoBackendFlag {
    // io_uring where the probe passes, else epoll.
    Auto,
    // io_uring, or exit 1 naming why it cannot run.
    Uring,
    // epoll readiness, for hosts whose seccomp profile blocks io_uring.
    Epoll,
}

impl IoBackendFlag {
    /// The dataplane's selection request for this flag value.
    pub(crate) fn choice(self) -> BackendChoice {
        match self {
            IoBackendFlag::Auto => BackendChoice::Auto,
            IoBackendFlag::Uring => BackendChoice::Uring,
            IoBackendFlag::Epoll => BackendChoice::Epoll,
        }
    }
}

/// Parses the command line (exiting on a usage error) and keeps the matches, which say where
/// each value came from. A value a mode flag (`--offload`, `--siblings`) does not know exits
/// 1, as a config this process cannot run does; other usage errors exit as clap decides.
pub(crate) fn parse() -> (Cli, clap::ArgMatches) {
    let matches = Cli::command()
        .try_get_matches()
        .unwrap_or_else(|e| exit_on(e));
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    (cli, matches)
}

/// Prints a usage error and exits with its code: 1 for a mode flag's unknown value.
fn exit_on(error: clap::Error) -> ! {
    let mode_flag = error.kind() == ErrorKind::ValueValidation
        && matches!(
            error.get(ContextKind::InvalidArg),
            Some(ContextValue::String(arg))
                if arg.starts_with("--offload ") || arg.starts_with("--siblings ")
        );
    if mode_flag {
        let _ = error.print();
        std::process::exit(1);
    }
    error.exit()
}
