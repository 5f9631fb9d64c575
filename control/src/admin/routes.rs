//! What the admin servers answer for a request path, without IO: the health-check routes
//! (stunnerd.md §5) and the metrics page. hyper parses the request ([`super::server`]); the
//! path it hands over has no query.
//!
//! Kept free of any dependency (the `admin_http` fuzz target compiles this file on its own).

/// An answer: status code, content type and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Answer {
    /// The HTTP status code.
    pub(crate) status: u16,
    /// The `Content-Type` header.
    pub(crate) content_type: &'static str,
    /// The body.
    pub(crate) body: String,
}

/// The content type of a JSON answer.
pub(crate) const JSON: &str = "application/json; charset=utf-8";
/// The content type of a plain-text answer.
pub(crate) const TEXT: &str = "text/plain; charset=utf-8";
/// The content type of the Prometheus text exposition format.
pub(crate) const PROMETHEUS: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The body of the 404 stunnerd (Go's mux) answers.
pub(crate) const NOT_FOUND_BODY: &str = "404 page not found\n";
/// The body of `/live`.
pub(crate) const LIVE_BODY: &str = "{}\n";
/// The body of `/ready` when ready.
pub(crate) const READY_BODY: &str = "{\"status\":200,\"message\":\"READY\"}\n";
/// The body of `/ready` when not ready.
pub(crate) const NOT_READY_BODY: &str = "{\"status\":503,\"message\":\"stunnerd not ready\"}\n";

impl Answer {
    fn new(status: u16, content_type: &'static str, body: impl Into<String>) -> Answer {
        Answer {
            status,
            content_type,
            body: body.into(),
        }
    }
}

/// The 404 stunnerd (Go's mux) answers.
pub(crate) fn not_found() -> Answer {
    Answer::new(404, TEXT, NOT_FOUND_BODY)
}

/// The health-check routes (stunnerd.md §5): paths match exactly, any method.
pub(crate) fn health_route(
    path: &str,
    ready: impl FnOnce() -> bool,
    status: impl FnOnce() -> String,
) -> Answer {
    match path {
        "/live" => Answer::new(200, JSON, LIVE_BODY),
        "/ready" if ready() => Answer::new(200, JSON, READY_BODY),
        "/ready" => Answer::new(503, JSON, NOT_READY_BODY),
        "/status" => Answer::new(200, JSON, status() + "\n"),
        _ => not_found(),
    }
}

/// The metrics page: `render` at exactly `metrics_path`, any method; a 404 elsewhere.
pub(crate) fn metrics_route(
    path: &str,
    metrics_path: &str,
    render: impl FnOnce() -> String,
) -> Answer {
    if path == metrics_path {
        Answer::new(200, PROMETHEUS, render())
    } else {
        not_found()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_route_exactly() {
        assert_eq!(health_route("/ready", || false, String::new).status, 503);
        assert_eq!(
            health_route("/ready", || true, String::new).body,
            READY_BODY
        );
        assert_eq!(health_route("/live/", || true, String::new).status, 404);
        assert_eq!(
            health_route("/status", || true, || "{}".into()).body,
            "{}\n"
        );
        assert_eq!(
            metrics_route("/metrics", "/metrics", String::new).status,
            200
        );
        assert_eq!(metrics_route("/", "/metrics", String::new), not_found());
    }
}
