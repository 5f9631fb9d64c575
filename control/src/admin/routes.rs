//! The admin servers' HTTP/1.1 subset, without IO: find the request head in what a client sent
//! so far, take its path, route it, and write the answer. [`super::server`] owns the sockets.
//!
//! Kept free of any dependency (the fuzz targets compile this file on its own).

/// An answer: status code, content type and body.
pub type Answer = (u16, &'static str, String);

/// The content type of a JSON answer.
pub const JSON: &str = "application/json; charset=utf-8";
/// The content type of a plain-text answer.
pub const TEXT: &str = "text/plain; charset=utf-8";
/// The content type of the Prometheus text exposition format.
pub const PROMETHEUS: &str = "text/plain; version=0.0.4; charset=utf-8";
/// The largest request head a client may send; a longer one closes the connection unanswered.
pub const MAX_REQUEST: usize = 8 << 10;

/// What the bytes received so far are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request<'a> {
    /// No end of the head (`\r\n\r\n`) yet: read more.
    Incomplete,
    /// The head did not end within [`MAX_REQUEST`] bytes: close without answering.
    TooLarge,
    /// A complete head; `path` is the request target without its query: empty, or a range of
    /// the input.
    Complete {
        /// The path (may be empty or anything the client wrote: routing decides).
        path: &'a [u8],
    },
}

/// Looks at the first bytes a client sent (everything received so far).
pub fn parse_request(received: &[u8]) -> Request<'_> {
    let window = &received[..received.len().min(MAX_REQUEST)];
    let Some(end) = window.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if received.len() >= MAX_REQUEST {
            Request::TooLarge
        } else {
            Request::Incomplete
        };
    };
    let head = &window[..end];
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let target = line.split(|&b| b == b' ').nth(1).unwrap_or_default();
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    Request::Complete { path }
}

/// The 404 stunnerd (Go's mux) answers.
pub fn not_found() -> Answer {
    (404, TEXT, "404 page not found\n".to_string())
}

/// The health-check routes (stunnerd.md §5): paths match exactly, any method.
pub fn health_route(
    path: &[u8],
    ready: impl FnOnce() -> bool,
    status: impl FnOnce() -> String,
) -> Answer {
    match path {
        b"/live" => (200, JSON, "{}\n".to_string()),
        b"/ready" if ready() => (
            200,
            JSON,
            "{\"status\":200,\"message\":\"READY\"}\n".to_string(),
        ),
        b"/ready" => (
            503,
            JSON,
            "{\"status\":503,\"message\":\"stunnerd not ready\"}\n".to_string(),
        ),
        b"/status" => (200, JSON, status() + "\n"),
        _ => not_found(),
    }
}

/// The bytes of `answer` as an HTTP/1.1 response that closes the connection.
pub fn render_response(answer: &Answer) -> Vec<u8> {
    let (status, content_type, body) = answer;
    let reason = match status {
        200 => "OK",
        503 => "Service Unavailable",
        _ => "Not Found",
    };
    format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_taken_apart_like_before() {
        assert_eq!(
            parse_request(b"GET /ready HTTP/1.1\r\n"),
            Request::Incomplete
        );
        assert_eq!(
            parse_request(b"GET /ready?x=1 HTTP/1.1\r\nHost: a\r\n\r\n"),
            Request::Complete { path: b"/ready" }
        );
        assert_eq!(parse_request(b"\r\n\r\n"), Request::Complete { path: b"" });
        let mut long = b"GET /".to_vec();
        long.resize(MAX_REQUEST, b'a');
        assert_eq!(parse_request(&long), Request::TooLarge);
        long.truncate(MAX_REQUEST - 4);
        long.extend_from_slice(b"\r\n\r\n");
        assert!(matches!(parse_request(&long), Request::Complete { .. }));
        assert_eq!(health_route(b"/ready", || false, String::new).0, 503);
        assert_eq!(health_route(b"/live/", || true, String::new).0, 404);
    }
}
