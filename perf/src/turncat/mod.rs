//! turncat: a UDP port-forward through a TURN server, as STUNner's `turncat` (stunnerd.md §9):
//! each client flow (a UDP source address, or stdin/stdout) gets its own allocation over the
//! chosen transport, a permission and channel to the peer, and is relayed both ways with
//! ChannelData until the process ends.
//!
//! [`Args`] is what the command line says; [`Tunnel::resolve`] checks and resolves it, and
//! [`Tunnel::run`] serves it. The TURN client logic is the sans-IO [`session::Session`]; the
//! threads and sockets live in [`flow`] and [`transport`].

pub mod flow;
pub mod log;
pub mod secure;
pub mod session;
pub mod transport;

use std::io::{self, Read};
use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use uturn_shared::auth::{ephemeral_password, ephemeral_username};
use uturn_shared::config::{parse_turn_uri, ListenerProtocol};
use uturn_shared::logspec::Level;

use crate::client::roomy;
use flow::{ClientSide, Flow, FlowConfig, Forwarded, FRAME_ROOM};
use secure::Trust;
use session::SessionConfig;
use transport::{Connector, Protocol, Security};

/// Lifetime of credentials minted from `--secret`, as STUNner's turncat mints them.
pub const EPHEMERAL_LIFETIME: Duration = Duration::from_secs(3600);
/// stdin is read in chunks of at most this many bytes, each sent as one datagram.
pub const STDIN_CHUNK: usize = 1200;
/// After stdin ends, turncat waits until the peer has been quiet this long…
const LINGER_QUIET: Duration = Duration::from_millis(500);
/// …but no longer than this.
const LINGER_MAX: Duration = Duration::from_secs(5);

/// The command line, as given.
#[derive(Debug, Clone, Default)]
pub struct Args {
    /// `udp://IP:PORT` or `-`.
    pub client: String,
    /// `turn://…` or `turns://…`.
    pub server: String,
    /// `udp://IP:PORT`.
    pub peer: String,
    /// Accept any server certificate.
    pub insecure: bool,
    /// The TLS/DTLS server name; default: the URI host.
    pub sni: Option<String>,
    /// Mint TURN REST credentials from this shared secret.
    pub secret: Option<String>,
    /// A PEM bundle of CA certificates.
    pub ca_file: Option<std::path::PathBuf>,
}

/// Where client datagrams come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAddr {
    /// A UDP socket bound here; each source address is one flow.
    Listen(SocketAddr),
    /// stdin and stdout: one flow.
    Stdio,
}

/// A checked, resolved turncat invocation.
pub struct Tunnel {
    /// Where client datagrams come from.
    pub client: ClientAddr,
    /// How each flow reaches the server and the peer.
    pub flow: Arc<FlowConfig>,
}

impl Tunnel {
    /// Checks and resolves `args`; `now_unix` dates credentials minted from a secret.
    pub fn resolve(args: &Args, now_unix: u64) -> Result<Tunnel, String> {
        let client = parse_client_addr(&args.client)?;
        let peer = parse_udp_addr("peer-addr", &args.peer)?;

        let uri = match &args.secret {
            Some(_) => with_password_placeholder(&args.server),
            None => args.server.clone(),
        };
        let turn = parse_turn_uri(&uri).map_err(|e| e.to_string())?;
        let protocol = match turn.protocol {
            // RFC 7065 §3: without a transport parameter, turns means TLS over TCP (the
            // shared parser, following stunnerd, reads it as DTLS).
            ListenerProtocol::TurnDtls if is_turns_without_transport(&uri) => Protocol::Tls,
            ListenerProtocol::TurnUdp => Protocol::Udp,
            ListenerProtocol::TurnTcp => Protocol::Tcp,
            ListenerProtocol::TurnTls => Protocol::Tls,
            ListenerProtocol::TurnDtls => Protocol::Dtls,
            other => {
                return Err(format!(
                    "turn-server-uri {:?}: protocol {other:?} is not a TURN transport: use \
                     ?transport=udp|tcp|tls|dtls",
                    args.server
                ))
            }
        };
        if turn.host.is_empty() {
            return Err(format!(
                "turn-server-uri: no host: write it as turn://USER:PASS@HOST:PORT (got {:?})",
                uri_without_password(&args.server)
            ));
        }
        let server = resolve_one(&turn.host, turn.port).map_err(|e| {
            format!(
                "turn-server-uri host {:?}: cannot resolve: {e}: give an IP address or a \
                 resolvable name",
                turn.host
            )
        })?;
        let (username, password) = match &args.secret {
            Some(secret) => {
                let username =
                    ephemeral_username(now_unix + EPHEMERAL_LIFETIME.as_secs(), &turn.username);
                let password = ephemeral_password(secret, &username);
                (username, password)
            }
            None => (turn.username, turn.password),
        };

        let trust = Trust {
            insecure: args.insecure,
            ca_file: args.ca_file.clone(),
        };
        let security = match protocol {
            Protocol::Udp | Protocol::Tcp => Security::Plain,
            Protocol::Tls => Security::Tls(secure::tls_config(&trust)?),
            Protocol::Dtls => Security::Dtls {
                connector: secure::dtls_connector(&trust)?,
                verify: !args.insecure,
            },
        };
        let connector = Connector {
            protocol,
            server,
            server_name: args.sni.clone().unwrap_or(turn.host),
            security,
        };
        let session = SessionConfig {
            username,
            password,
            peer,
            reliable: protocol.is_stream(),
        };
        Ok(Tunnel {
            client,
            flow: Arc::new(FlowConfig { connector, session }),
        })
    }

    /// Serves the tunnel: forever for a UDP listener, until stdin ends for `-`.
    pub fn run(self) -> Result<(), String> {
        match self.client {
            ClientAddr::Listen(addr) => serve_udp(addr, &self.flow),
            ClientAddr::Stdio => serve_stdio(&self.flow),
        }
    }
}

/// `udp://IP:PORT`, or `-` / `file://-` for stdin and stdout.
pub fn parse_client_addr(text: &str) -> Result<ClientAddr, String> {
    if text == "-" || text == "file://-" {
        return Ok(ClientAddr::Stdio);
    }
    parse_udp_addr("client-addr", text)
        .map(ClientAddr::Listen)
        .map_err(|e| {
            if text.contains("://") && !text.to_ascii_lowercase().starts_with("udp://") {
                format!(
                    "client-addr {text:?}: only udp://IP:PORT and - (stdin/stdout) are supported"
                )
            } else {
                e
            }
        })
}

/// `udp://HOST:PORT`, resolved to one address.
pub fn parse_udp_addr(field: &str, text: &str) -> Result<SocketAddr, String> {
    let form = || format!("{field} {text:?}: write it as udp://IP:PORT");
    let Some(rest) = text
        .get(..6)
        .filter(|scheme| scheme.eq_ignore_ascii_case("udp://"))
        .map(|_| &text[6..])
    else {
        return Err(form());
    };
    let rest = rest.trim_end_matches('/');
    if let Ok(addr) = rest.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let Some((host, port)) = rest.rsplit_once(':') else {
        return Err(form());
    };
    let Ok(port) = port.parse::<u16>() else {
        return Err(form());
    };
    resolve_one(host.trim_start_matches('[').trim_end_matches(']'), port)
        .map_err(|e| format!("{field} {text:?}: cannot resolve {host:?}: {e}"))
}

fn resolve_one(host: &str, port: u16) -> io::Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"))
}

/// With `--secret` the URI names only the user id: `turn://user@host` gets a password for
/// the parser to find (the real one is minted).
fn with_password_placeholder(uri: &str) -> String {
    let Some(scheme_end) = uri.find("://").map(|i| i + 3) else {
        return uri.to_owned();
    };
    let rest = &uri[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) if !rest[..at].contains(':') => {
            format!("{}:-{}", &uri[..scheme_end + at], &uri[scheme_end + at..])
        }
        _ => uri.to_owned(),
    }
}

fn is_turns_without_transport(uri: &str) -> bool {
    let secure = uri
        .get(..8)
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("turns://"));
    let query = uri
        .split_once('?')
        .map_or("", |(_, query)| query.split('#').next().unwrap_or(""));
    secure && !query.split('&').any(|pair| pair.starts_with("transport="))
}

fn uri_without_password(uri: &str) -> String {
    match parse_turn_uri(uri) {
        Ok(turn) => format!("{}@{}:{}", turn.username, turn.host, turn.port),
        Err(_) => "(unparsable)".to_owned(),
    }
}

fn serve_udp(addr: SocketAddr, config: &Arc<FlowConfig>) -> Result<(), String> {
    let socket = UdpSocket::bind(addr).map_err(|e| {
        format!("client-addr udp://{addr}: cannot listen: {e}: pick a free local address")
    })?;
    roomy(&socket);
    let socket = Arc::new(socket);
    log::log(
        Level::Info,
        format_args!(
            "listening on udp://{addr}, relaying through {} {} to {}",
            config.connector.protocol, config.connector.server, config.session.peer
        ),
    );
    let mut flows: std::collections::HashMap<SocketAddr, Arc<Flow>> = Default::default();
    let mut buf = vec![0u8; FRAME_ROOM];
    loop {
        let (len, client) = match socket.recv_from(flow::payload_space(&mut buf)) {
            Ok(received) => received,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::ConnectionRefused
                        | io::ErrorKind::ConnectionReset
                ) =>
            {
                continue
            }
            Err(e) => return Err(format!("client-addr udp://{addr}: receive failed: {e}")),
        };
        let start_flow = || {
            let side = ClientSide::Udp {
                socket: socket.clone(),
                client,
            };
            Flow::spawn(config.clone(), side, false)
        };
        let flow = flows.entry(client).or_insert_with(start_flow);
        if flow.forward(&mut buf, len) == Forwarded::Closed {
            // The last flow of this client failed; this datagram starts a new one.
            *flow = start_flow();
            flow.forward(&mut buf, len);
        }
    }
}

fn serve_stdio(config: &Arc<FlowConfig>) -> Result<(), String> {
    let flow = Flow::spawn(config.clone(), ClientSide::Stdout, true);
    flow.wait_ready()?;
    let mut stdin = io::stdin().lock();
    let mut buf = vec![0u8; FRAME_ROOM];
    loop {
        let space = flow::payload_space(&mut buf);
        let len = match stdin.read(&mut space[..STDIN_CHUNK]) {
            Ok(0) => break,
            Ok(len) => len,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("reading stdin: {e}")),
        };
        if flow.forward(&mut buf, len) == Forwarded::Closed {
            return Err("the TURN flow ended".to_owned());
        }
    }
    // Let replies to the last datagrams arrive before the process (and the allocation) ends.
    let eof_at = Instant::now();
    while eof_at.elapsed() < LINGER_MAX && flow.last_delivery().max(eof_at).elapsed() < LINGER_QUIET
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_and_peer_addresses_parse_or_say_what_to_write() {
        assert_eq!(parse_client_addr("-"), Ok(ClientAddr::Stdio));
        assert_eq!(parse_client_addr("file://-"), Ok(ClientAddr::Stdio));
        assert_eq!(
            parse_client_addr("udp://127.0.0.1:5000"),
            Ok(ClientAddr::Listen("127.0.0.1:5000".parse().unwrap()))
        );
        assert_eq!(
            parse_udp_addr("peer-addr", "UDP://[::1]:53"),
            Ok("[::1]:53".parse().unwrap())
        );
        assert_eq!(
            parse_udp_addr("peer-addr", "udp://localhost:53").map(|a| a.port()),
            Ok(53)
        );
        let tcp = parse_client_addr("tcp://127.0.0.1:5000").unwrap_err();
        assert!(tcp.contains("only udp://"), "{tcp}");
        for bad in [
            "127.0.0.1:53",
            "udp://127.0.0.1",
            "udp://127.0.0.1:99999",
            "udp:/x",
        ] {
            let error = parse_udp_addr("peer-addr", bad).unwrap_err();
            assert!(error.contains("peer-addr"), "{error}");
        }
    }

    #[test]
    fn turn_uris_pick_the_transport_and_the_default_ports() {
        let cases = [
            ("turn://u:p@127.0.0.1", Protocol::Udp, 3478),
            (
                "turn://u:p@127.0.0.1:5000?transport=tcp",
                Protocol::Tcp,
                5000,
            ),
            ("turn://u:p@127.0.0.1?transport=tls", Protocol::Tls, 443),
            ("turn://u:p@127.0.0.1?transport=dtls", Protocol::Dtls, 443),
            ("turns://u:p@127.0.0.1", Protocol::Tls, 443),
            (
                "turns://u:p@127.0.0.1:5349?transport=udp",
                Protocol::Dtls,
                5349,
            ),
            ("turns://u:p@127.0.0.1?transport=tcp", Protocol::Tls, 443),
        ];
        for (uri, protocol, port) in cases {
            let args = Args {
                client: "-".into(),
                server: uri.into(),
                peer: "udp://127.0.0.1:9".into(),
                insecure: true,
                ..Args::default()
            };
            let tunnel = Tunnel::resolve(&args, 0).unwrap_or_else(|e| panic!("{uri}: {e}"));
            assert_eq!(tunnel.flow.connector.protocol, protocol, "{uri}");
            assert_eq!(tunnel.flow.connector.server.port(), port, "{uri}");
            assert_eq!(tunnel.flow.connector.server_name, "127.0.0.1");
            assert_eq!(tunnel.flow.session.username, "u");
            assert_eq!(tunnel.flow.session.reliable, protocol.is_stream());
        }
    }

    #[test]
    fn a_secret_mints_ephemeral_credentials_for_the_user_id() {
        let args = Args {
            client: "-".into(),
            server: "turn://alice@127.0.0.1:3478".into(),
            peer: "udp://127.0.0.1:9".into(),
            secret: Some("s3cr3t".into()),
            sni: Some("turn.example.com".into()),
            ..Args::default()
        };
        let tunnel = Tunnel::resolve(&args, 1_000).unwrap();
        let session = &tunnel.flow.session;
        assert_eq!(session.username, "4600:alice");
        assert_eq!(session.password, ephemeral_password("s3cr3t", "4600:alice"));
        assert_eq!(tunnel.flow.connector.server_name, "turn.example.com");
        assert_eq!(
            with_password_placeholder("turn://alice:x@h"),
            "turn://alice:x@h"
        );
    }

    #[test]
    fn bad_uris_name_the_field() {
        let args = |server: &str| Args {
            client: "-".into(),
            server: server.into(),
            peer: "udp://127.0.0.1:9".into(),
            ..Args::default()
        };
        for bad in [
            "http://u:p@127.0.0.1",
            "turn://127.0.0.1",
            "turn://u:p@127.0.0.1?transport=sctp",
            "turn://u:p@:3478",
        ] {
            let error = Tunnel::resolve(&args(bad), 0).err().unwrap();
            assert!(
                error.contains("TURN-URI") || error.contains("turn-server-uri"),
                "{error}"
            );
            assert!(
                !error.contains(":p@"),
                "the password is not echoed: {error}"
            );
        }
        let missing_ca = Args {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..args("turns://u:p@127.0.0.1")
        };
        let error = Tunnel::resolve(&missing_ca, 0).err().unwrap();
        assert!(error.starts_with("--ca"), "{error}");
    }
}
