//! The health-check server at `admin.healthcheck_endpoint`: `/live`, `/ready` and `/status`,
//! byte for byte as stunnerd answers them (stunnerd.md §5). Paths match exactly and accept any
//! method; anything else is a 404.

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

const MAX_REQUEST: usize = 8 << 10;

/// Serves health checks on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, source: Arc<dyn HealthSource>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let source = source.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), answer(stream, &*source)).await;
        });
    }
}

async fn answer(mut stream: TcpStream, source: &dyn HealthSource) -> std::io::Result<()> {
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
    let (status, body) = match path {
        b"/live" => (200, "{}\n".to_string()),
        b"/ready" if source.ready() => {
            (200, "{\"status\":200,\"message\":\"READY\"}\n".to_string())
        }
        b"/ready" => (
            503,
            "{\"status\":503,\"message\":\"stunnerd not ready\"}\n".to_string(),
        ),
        b"/status" => (200, source.status_json() + "\n"),
        _ => (404, "404 page not found\n".to_string()),
    };
    let reason = match status {
        200 => "OK",
        503 => "Service Unavailable",
        _ => "Not Found",
    };
    let content_type = if status == 404 {
        "text/plain; charset=utf-8"
    } else {
        "application/json; charset=utf-8"
    };
    let response = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}
