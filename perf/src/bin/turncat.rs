//! turncat: a UDP port-forward through a TURN server, a stand-in for STUNner's turncat.
//! `turncat [options] <client-addr> <turn-server-uri> <peer-addr>`.

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};
use uturn_perf::turncat::{log, Args, Tunnel};

#[derive(Parser, Debug)]
#[command(
    name = "turncat",
    version,
    about = "Relay UDP datagrams to a peer through a TURN server",
    after_help = "Examples:\n  turncat udp://127.0.0.1:5000 turn://user:pass@192.0.2.1:3478 udp://192.0.2.2:53\n  \
                  turncat -i - 'turns://user:pass@turn.example.com:443?transport=udp' udp://10.0.0.1:9001"
)]
struct Cli {
    /// Where clients send: udp://IP:PORT (each client address is one flow) or - (stdin/stdout).
    client_addr: String,
    /// turn://USER:PASS@HOST or turn://USER:PASS@HOST:PORT, optionally ending in
    /// ?transport=udp|tcp|tls|dtls; or turns://… (TLS; DTLS with transport=udp).
    turn_server_uri: String,
    /// The peer, udp://IP:PORT.
    peer_addr: String,
    /// Accept any server certificate (self-signed ones included), for TLS and DTLS.
    #[arg(short = 'i', long)]
    insecure: bool,
    /// The TLS/DTLS server name to send and verify (default: the URI host).
    #[arg(long)]
    sni: Option<String>,
    /// Mint TURN REST credentials (1 h lifetime) from this shared secret; the URI's user part
    /// is then the user id.
    #[arg(long)]
    secret: Option<String>,
    /// A PEM bundle of CA certificates to verify the server with (default: the system's).
    #[arg(long, value_name = "FILE")]
    ca: Option<PathBuf>,
    /// Log level spec, e.g. all:INFO,turncat:DEBUG.
    #[arg(short = 'l', long, default_value = "all:WARN")]
    log: String,
    /// Verbose logging (all:DEBUG).
    #[arg(short = 'v', long)]
    verbose: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    log::configure(&cli.log, cli.verbose);
    let args = Args {
        client: cli.client_addr,
        server: cli.turn_server_uri,
        peer: cli.peer_addr,
        insecure: cli.insecure,
        sni: cli.sni,
        secret: cli.secret,
        ca_file: cli.ca,
    };
    let now_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let result = Tunnel::resolve(&args, now_unix).and_then(Tunnel::run);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("turncat: error: {error}");
            ExitCode::FAILURE
        }
    }
}
