//! A client of STUNner's config discovery service (stunnerd.md §8), as stunnerd speaks it:
//! one HTTP GET for a one-shot load, or a WebSocket watch that receives a full config per
//! change, pings every 5 s, gives up on a connection silent for 8 s and reconnects every
//! second, forever.

use super::cds_message::{parse_message, CdsMessage};
use crate::outbox::Outbox;
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Empty};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use std::time::Duration;
use tokio::time::{sleep, sleep_until, timeout, Instant};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;
use uturn_shared::config::{parse_config, StunnerConfig};

/// The default CDS port.
pub const DEFAULT_PORT: u16 = 13478;
const PING_PERIOD: Duration = Duration::from_secs(5);
const READ_DEADLINE: Duration = Duration::from_secs(8);
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
const RETRY_PERIOD: Duration = Duration::from_secs(1);
const HTTP_TIMEOUT: Duration = Duration::from_secs(10);

/// Which config to ask which CDS server for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdsTarget {
    /// `host:port` of the server (an empty host is localhost, as in Go).
    pub authority: String,
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
        let rest = ["http://", "ws://"]
            .iter()
            .find_map(|scheme| origin.strip_prefix(scheme))
            .ok_or_else(|| {
                format!(
                    "config origin {origin:?}: uturn speaks plain http:// and ws:// to the config \
                     discovery service (https/wss are not supported yet); use http://HOST:PORT"
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
        let (namespace, name) = id.split_once('/').ok_or_else(|| {
            format!(
                "instance id {id:?} is not <namespace>/<name>: set --id or STUNNER_NAMESPACE and STUNNER_NAME"
            )
        })?;
        Ok(CdsTarget {
            authority: format!("{host}:{port}"),
            namespace: namespace.to_string(),
            name: name.to_string(),
            node: node.filter(|n| !n.is_empty()).map(str::to_string),
        })
    }

    /// The path and query of this gateway's config, query keys sorted as stunnerd sends them.
    pub fn path(&self, watch: bool) -> String {
        let mut query = Vec::new();
        if let Some(node) = &self.node {
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
        format!("ws://{}{}", self.authority, self.path(true))
    }
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

/// One HTTP GET of the gateway's config; exactly one valid config is expected.
pub async fn fetch(target: &CdsTarget) -> Result<StunnerConfig, String> {
    let url = format!("http://{}{}", target.authority, target.path(false));
    let body = timeout(HTTP_TIMEOUT, get(target, &target.path(false)))
        .await
        .map_err(|_| format!("config discovery server at {url} did not answer in time"))??;
    match body {
        (200, text) => parse_config(&text)
            .map_err(|e| format!("invalid config from config discovery server at {url}: {e}")),
        (status, text) => Err(format!(
            "config discovery server at {url} answered HTTP {status}: {}",
            text.trim()
        )),
    }
}

async fn get(target: &CdsTarget, path: &str) -> Result<(u16, String), String> {
    let stream = tokio::net::TcpStream::connect(&target.authority)
        .await
        .map_err(|e| {
            format!(
                "cannot reach config discovery server at {}: {e}",
                target.authority
            )
        })?;
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
    let origin = HeaderValue::from_str(&format!("http://{}", target.authority))
        .map_err(|e| e.to_string())?;
    request.headers_mut().insert("Origin", origin);
    let (mut socket, _) = timeout(HTTP_TIMEOUT, tokio_tungstenite::connect_async(request))
        .await
        .map_err(|_| "connection timed out".to_string())?
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
                    Message::Text(text) => handle_frame(text.as_str(), url, configs),
                    Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => {}
                    Message::Close(_) => return Err("connection closed by the server".into()),
                    Message::Binary(_) => return Err("unexpected binary frame".into()),
                }
            }
        }
    }
}

fn handle_frame(text: &str, url: &str, configs: &Outbox<Box<StunnerConfig>>) {
    match parse_message(text) {
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
            "ws://127.0.0.1:13478/api/v1/configs/stunner/udp-gateway?node=node-1&watch=true"
        );
        assert_eq!(
            t.path(false),
            "/api/v1/configs/stunner/udp-gateway?node=node-1"
        );
        let t = CdsTarget::new("ws://cds.stunner-system:9000/x", "a/b", None).unwrap();
        assert_eq!(t.authority, "cds.stunner-system:9000");
        assert_eq!(t.path(true), "/api/v1/configs/a/b?watch=true");
        let t = CdsTarget::new("http://a", "a/b", Some("node 1/é~x")).unwrap();
        assert_eq!(
            t.path(false),
            "/api/v1/configs/a/b?node=node%201%2F%C3%A9~x"
        );
        let t = CdsTarget::new("http://stunner-cds", "a/b", Some("")).unwrap();
        assert_eq!(t.authority, "stunner-cds:13478");
        assert!(CdsTarget::new("https://x:1", "a/b", None)
            .unwrap_err()
            .contains("https"));
        assert!(CdsTarget::new("http://x:1", "nons", None)
            .unwrap_err()
            .contains("--id"));
    }
}
