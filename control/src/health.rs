//! The admin HTTP servers: health checks at `admin.healthcheck_endpoint` (`/live`, `/ready`,
//! `/status`, byte for byte as stunnerd answers them, stunnerd.md §5: paths match exactly and
//! accept any method, anything else is a 404) and Prometheus metrics at
//! `admin.metrics_endpoint`. One small HTTP/1.1 responder serves both; every answer closes the
//! connection.

use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the health server reports; filled in by the control loop.
pub trait HealthSource: Send + Sync {
    /// Whether `/ready` answers 200.
    fn ready(&self) -> bool;
    /// The `/status` body.
    fn status_json(&self) -> String;
}

/// An answer: status code, content type and body.
pub type Answer = (u16, &'static str, String);

/// Maps a request path (query stripped) to its answer.
pub type Handler = Arc<dyn Fn(&[u8]) -> Answer + Send + Sync>;

const JSON: &str = "application/json; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";
/// The content type of the Prometheus text exposition format.
pub const PROMETHEUS: &str = "text/plain; version=0.0.4; charset=utf-8";
const MAX_REQUEST: usize = 8 << 10;

/// The 404 stunnerd (Go's mux) answers.
pub fn not_found() -> Answer {
    (404, TEXT, "404 page not found\n".to_string())
}

/// The health-check routes over `source`.
pub fn health_handler(source: Arc<dyn HealthSource>) -> Handler {
    Arc::new(move |path| match path {
        b"/live" => (200, JSON, "{}\n".to_string()),
        b"/ready" if source.ready() => (
            200,
            JSON,
            "{\"status\":200,\"message\":\"READY\"}\n".to_string(),
        ),
        b"/ready" => (
            503,
            JSON,
            "{\"status\":503,\"message\":\"stunnerd not ready\"}\n".to_string(),
        ),
        b"/status" => (200, JSON, source.status_json() + "\n"),
        _ => not_found(),
    })
}

/// Serves `handler` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, handler: Handler) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let handler = handler.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), answer(stream, &*handler)).await;
        });
    }
}

async fn answer(
    mut stream: TcpStream,
    handler: &(dyn Fn(&[u8]) -> Answer + Send + Sync),
) -> std::io::Result<()> {
    let mut request = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 || request.len() + n > MAX_REQUEST {
            return Ok(());
        }
        request.extend_from_slice(&buf[..n]);
    }
    let line = request.split(|&b| b == b'\r').next().unwrap_or_default();
    let target = line.split(|&b| b == b' ').nth(1).unwrap_or_default();
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    let (status, content_type, body) = handler(path);
    let reason = match status {
        200 => "OK",
        503 => "Service Unavailable",
        _ => "Not Found",
    };
    let response = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}
