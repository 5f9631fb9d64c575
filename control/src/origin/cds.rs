//! A client of STUNner's config discovery service (stunnerd.md §8, stunnerd-v2.md §8), as
//! stunnerd speaks it: one HTTP GET for a one-shot load, or a WebSocket watch that receives a
//! full config per change, pings every 5 s, gives up on a connection silent for 8 s and
//! reconnects every second, forever. `https://` and `wss://` origins speak TLS (both watch over
//! `wss`, as STUNner v2 does), verifying the server against the system's roots
//! (`SSL_CERT_FILE` / `SSL_CERT_DIR` name others). The node is reported both ways the
//! operators read it: `node=<node>` (v1 and early v2) and `label=node=<node>` (later v2).

use super::cds_message::{parse_message_for, CdsMessage};
use crate::outbox::Outbox;
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Empty};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use std::time::Duration;
use tokio::time::{sleep, sleep_until, timeout, Instant};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use uturn_shared::config::StunnerConfig;

/// The default CDS port.
pub const DEFAULT_PORT: u16 = 13478;
const PING_PERIOD: Duration = Duration::from_secs(5);
const READ_DEADLINE: Duration = Duration::from_secs(8);
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
const RETRY_PERIOD: Duration = Duration::from_secs(1);
const HTTP_TIMEOUT: Duration = Duration::from_secs(10);
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// Which config to ask which CDS server for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdsTarget {
    /// `host:port` of the server (an empty host is localhost, as in Go).
    pub authority: String,
    /// The server's host name (for TLS: the name its certificate must carry).
    pub host: String,
    /// Speak TLS (`https://` or `wss://` origins).
    pub tls: bool,
    /// The gateway's namespace (from `--id`).
    pub namespace: String,
    /// The gateway's name (from `--id`).
    pub name: String,
    /// The node name sent as `node=` so the operator can patch node addresses.
    pub node: Option<String>,
}

impl CdsTarget {
    /// Builds the target from an origin URL (`http://HOST:PORT`, `ws://…`, a bare `HOST:PORT`
    /// is already `http://` here) and the instance id `<namespace>/<name>`.
    pub fn new(origin: &str, id: &str, node: Option<&str>) -> Result<CdsTarget, String> {
        let (tls, rest) = [
            ("http://", false),
            ("ws://", false),
            ("https://", true),
            ("wss://", true),
        ]
        .iter()
        .find_map(|(scheme, tls)| origin.strip_prefix(scheme).map(|rest| (*tls, rest)))
        .ok_or_else(|| {
            format!(
                "config origin {origin:?}: the config discovery service is reached over \
                 http://, https://, ws:// or wss://; use http://HOST:PORT"
            )
        })?;
        let authority = rest.split('/').next().unwrap_or_default();
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) if !port.contains(']') => {
                let port = port.parse::<u16>().map_err(|_| {
                    format!("config origin {origin:?}: port {port:?} is not a number; use http://HOST:PORT")
                })?;
                (host, port)
            }
            _ => (authority, DEFAULT_PORT),
        };
        let host = if host.is_empty() { "127.0.0.1" } else { host };
        let bare_host = host.trim_start_matches('[').trim_end_matches(']');
        let (namespace, name) = id.split_once('/').ok_or_else(|| {
            format!(
                "instance id {id:?} is not <namespace>/<name>: set --id or STUNNER_NAMESPACE and STUNNER_NAME"
            )
        })?;
        Ok(CdsTarget {
            authority: format!("{host}:{port}"),
            host: bare_host.to_string(),
            tls,
            namespace: namespace.to_string(),
            name: name.to_string(),
            node: node.filter(|n| !n.is_empty()).map(str::to_string),
        })
    }

    /// The path and query of this gateway's config, query keys sorted as stunnerd sends them;
    /// the node both as `label=node=<node>` (STUNner v2's label form) and `node=<node>`.
    pub fn path(&self, watch: bool) -> String {
        let mut query = Vec::new();
        if let Some(node) = &self.node {
            query.push(format!("label={}", encode_query(&format!("node={node}"))));
            query.push(format!("node={}", encode_query(node)));
        }
        if watch {
            query.push("watch=true".to_string());
        }
        let mut path = format!("/api/v1/configs/{}/{}", self.namespace, self.name);
        if !query.is_empty() {
            path.push('?');
            path.push_str(&query.join("&"));
        }
        path
    }

    /// The WebSocket URL of the watch.
    pub fn watch_url(&self) -> String {
        let scheme = if self.tls { "wss" } else { "ws" };
        format!("{scheme}://{}{}", self.authority, self.path(true))
    }

    /// The HTTP URL of the config (for messages).
    fn http_url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}{}", self.authority, self.path(false))
    }

    /// The instance id, `<namespace>/<name>`.
    fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// A byte stream to the server: TCP, or TLS over TCP.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// Connects to the server, with TLS for an https/wss origin.
async fn connect(target: &CdsTarget) -> Result<Box<dyn Io>, String> {
    let stream = timeout(
        DIAL_TIMEOUT,
        tokio::net::TcpStream::connect(&target.authority),
    )
    .await
    .map_err(|_| format!("connecting to {} timed out", target.authority))?
    .map_err(|e| {
        format!(
            "cannot reach config discovery server at {}: {e}",
            target.authority
        )
    })?;
    if !target.tls {
        return Ok(Box::new(stream));
    }
    let name = rustls::pki_types::ServerName::try_from(target.host.clone())
        .map_err(|e| format!("{:?} is not a TLS server name: {e}", target.host))?;
    let tls = tokio_rustls::TlsConnector::from(tls_client_config()?)
        .connect(name, stream)
        .await
        .map_err(|e| format!("TLS with {} failed: {e}", target.authority))?;
    Ok(Box::new(tls))
}

/// A TLS client that trusts the system's roots (and `SSL_CERT_FILE` / `SSL_CERT_DIR`).
fn tls_client_config() -> Result<std::sync::Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for cert in found.certs {
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        return Err(format!(
            "no trusted root certificates found ({:?}): install ca-certificates or point \
             SSL_CERT_FILE at the CA of the config discovery server",
            found.errors.first().map(ToString::to_string)
        ));
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(std::sync::Arc::new(config))
}

/// What a query value keeps unescaped: RFC 3986's unreserved characters, as stunnerd's Go
/// client (`url.Values.Encode`) does for a node name.
const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

fn encode_query(value: &str) -> String {
    utf8_percent_encode(value, QUERY_VALUE).to_string()
}

/// One HTTP GET of the gateway's config; exactly one valid config is expected (a list of
/// configs counts if exactly one is this gateway's).
pub async fn fetch(target: &CdsTarget) -> Result<StunnerConfig, String> {
    let url = target.http_url();
    let body = timeout(HTTP_TIMEOUT, get(target, &target.path(false)))
        .await
        .map_err(|_| format!("config discovery server at {url} did not answer in time"))??;
    match body {
        (200, text) => match parse_message_for(&text, Some(&target.id())) {
            CdsMessage::Config(config) => Ok(*config),
            CdsMessage::Delete => Ok(StunnerConfig::zero(&target.id())),
            CdsMessage::Empty => Err(format!(
                "config discovery server at {url} answered with an empty config"
            )),
            CdsMessage::Invalid(e) => Err(format!(
                "invalid config from config discovery server at {url}: {e}"
            )),
        },
        (status, text) => Err(format!(
            "config discovery server at {url} answered HTTP {status}: {}",
            text.trim()
        )),
    }
}

async fn get(target: &CdsTarget, path: &str) -> Result<(u16, String), String> {
    let stream = connect(target).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP handshake with {} failed: {e}", target.authority))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let request = hyper::Request::get(path)
        .header(hyper::header::HOST, &target.authority)
        .header(hyper::header::ACCEPT, "application/json")
        .body(Empty::<hyper::body::Bytes>::new())
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("GET {path} from {} failed: {e}", target.authority))?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("reading the answer of {} failed: {e}", target.authority))?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Watches the gateway's config over a WebSocket and sends every valid one, reconnecting
/// every second on any error, until the receiver goes away.
pub async fn watch(target: CdsTarget, configs: Outbox<Box<StunnerConfig>>) {
    let url = target.watch_url();
    while !configs.is_closed() {
        if let Err(e) = watch_once(&target, &url, &configs).await {
            tracing::warn!(target: "cds-client", "config discovery watch on {url}: {e}; retrying in 1s");
        }
        sleep(RETRY_PERIOD).await;
    }
}

async fn watch_once(
    target: &CdsTarget,
    url: &str,
    configs: &Outbox<Box<StunnerConfig>>,
) -> Result<(), String> {
    let mut request = url.into_client_request().map_err(|e| e.to_string())?;
    let scheme = if target.tls { "https" } else { "http" };
    let origin = HeaderValue::from_str(&format!("{scheme}://{}", target.authority))
        .map_err(|e| e.to_string())?;
    request.headers_mut().insert("Origin", origin);
    let stream = connect(target).await?;
    let (mut socket, _) = timeout(
        HTTP_TIMEOUT,
        tokio_tungstenite::client_async(request, stream),
    )
    .await
    .map_err(|_| "WebSocket handshake timed out".to_string())?
    .map_err(|e| format!("cannot connect: {e}"))?;
    tracing::info!(target: "cds-client", "connection successfully opened to config discovery server at {url}");
    let mut ping = tokio::time::interval(PING_PERIOD);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut deadline = Instant::now() + READ_DEADLINE;
    loop {
        tokio::select! {
            _ = ping.tick() => {
                timeout(WRITE_TIMEOUT, socket.send(Message::Ping("keepalive".into())))
                    .await
                    .map_err(|_| "write timed out".to_string())?
                    .map_err(|e| format!("ping failed: {e}"))?;
            }
            _ = sleep_until(deadline) => {
                return Err("no frame for 8s: connection lost".into());
            }
            frame = socket.next() => {
                let Some(frame) = frame else {
                    return Err("connection closed by the server".into());
                };
                let frame = frame.map_err(|e| format!("read failed: {e}"))?;
                deadline = Instant::now() + READ_DEADLINE;
                match frame {
                    Message::Text(text) => handle_frame(text.as_str(), &target.id(), url, configs),
                    Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => {}
                    Message::Close(_) => return Err("connection closed by the server".into()),
                    Message::Binary(_) => return Err("unexpected binary frame".into()),
                }
            }
        }
    }
}

fn handle_frame(text: &str, id: &str, url: &str, configs: &Outbox<Box<StunnerConfig>>) {
    match parse_message_for(text, Some(id)) {
        CdsMessage::Empty => {
            tracing::debug!(target: "cds-client", "ignoring zero-length config");
        }
        CdsMessage::Delete => {
            tracing::info!(target: "cds-client", "Ignoring delete configuration update from {url}");
        }
        CdsMessage::Config(config) => {
            let _ = configs.send(config);
        }
        CdsMessage::Invalid(e) => tracing::warn!(
            target: "cds-client",
            "ignoring invalid config from {url} (the running config stays): {e}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_built_like_stunnerd() {
        let t = CdsTarget::new("http://:13478", "stunner/udp-gateway", Some("node-1")).unwrap();
        assert_eq!(t.authority, "127.0.0.1:13478");
        assert_eq!(
            t.watch_url(),
            "ws://127.0.0.1:13478/api/v1/configs/stunner/udp-gateway?label=node%3Dnode-1&node=node-1&watch=true"
        );
        assert_eq!(
            t.path(false),
            "/api/v1/configs/stunner/udp-gateway?label=node%3Dnode-1&node=node-1"
        );
        let t = CdsTarget::new("ws://cds.stunner-system:9000/x", "a/b", None).unwrap();
        assert_eq!(t.authority, "cds.stunner-system:9000");
        assert_eq!(t.path(true), "/api/v1/configs/a/b?watch=true");
        let t = CdsTarget::new("http://a", "a/b", Some("node 1/é~x")).unwrap();
        assert_eq!(
            t.path(false),
            "/api/v1/configs/a/b?label=node%3Dnode%201%2F%C3%A9~x&node=node%201%2F%C3%A9~x"
        );
        let t = CdsTarget::new("http://stunner-cds", "a/b", Some("")).unwrap();
        assert_eq!(t.authority, "stunner-cds:13478");
        // https and wss origins watch over wss, as STUNner v2 does.
        for origin in ["https://cds.example:8443", "wss://cds.example:8443"] {
            let t = CdsTarget::new(origin, "a/b", None).unwrap();
            assert!(t.tls && t.host == "cds.example", "{t:?}");
            assert_eq!(
                t.watch_url(),
                "wss://cds.example:8443/api/v1/configs/a/b?watch=true"
            );
        }
        assert!(CdsTarget::new("ftp://x:1", "a/b", None)
            .unwrap_err()
            .contains("https://"));
        assert!(CdsTarget::new("http://x:1", "nons", None)
            .unwrap_err()
            .contains("--id"));
    }
}
