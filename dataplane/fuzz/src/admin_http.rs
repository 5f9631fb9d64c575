//! `admin_http`: what the health-check, status and metrics servers answer for a request path
//! (`control/src/admin/routes.rs`, compiled here on its own so the instrumented build carries no
//! tokio, hyper or kube). hyper parses the requests and enforces the head's size and time
//! limits; the routing is what stays uturn's own.
//!
//! Input: `[flags: u8][metrics path: u16 length, bytes][request path: the rest]`. Flags bit 0:
//! whether `/ready` is ready. Both paths are taken as (lossy) UTF-8, as hyper hands them over.
//!
//! Checks: never panics; the health routes answer exactly as stunnerd (stunnerd.md §5): `/live`,
//! `/ready` (200 or 503) and `/status` with their bodies and JSON content type, and Go's 404
//! for every other path; the metrics route answers the scrape only at exactly the metrics path,
//! with the Prometheus content type, and a 404 elsewhere; readiness, status and metrics are
//! computed only for the path that shows them.

#[allow(dead_code)]
#[path = "../../../control/src/admin/routes.rs"]
mod routes;

use crate::input::Input;
use routes::{health_route, metrics_route, Answer};
use std::cell::Cell;

const JSON: &str = "application/json; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";
const PROMETHEUS: &str = "text/plain; version=0.0.4; charset=utf-8";
const STATUS_DOC: &str = "{\"status\":\"READY\",\"allocationCount\":0}";
const SCRAPE: &str = "# TYPE stunner_allocations_active gauge\nstunner_allocations_active 0\n";

/// The fuzz target.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let ready = input.u8() & 1 == 1;
    let metrics_path = String::from_utf8_lossy(input.len_prefixed(usize::MAX)).into_owned();
    let path = String::from_utf8_lossy(input.rest()).into_owned();

    let (asked_ready, asked_status) = (Cell::new(0), Cell::new(0));
    let health = health_route(
        &path,
        || {
            asked_ready.set(asked_ready.get() + 1);
            ready
        },
        || {
            asked_status.set(asked_status.get() + 1);
            STATUS_DOC.to_string()
        },
    );
    let expected = match path.as_str() {
        "/live" => (200, JSON, "{}\n".to_string()),
        "/ready" if ready => (200, JSON, "{\"status\":200,\"message\":\"READY\"}\n".into()),
        "/ready" => (
            503,
            JSON,
            "{\"status\":503,\"message\":\"stunnerd not ready\"}\n".into(),
        ),
        "/status" => (200, JSON, format!("{STATUS_DOC}\n")),
        _ => not_found(),
    };
    check(&health, expected, &path);
    assert_eq!(asked_ready.get(), usize::from(path == "/ready"), "{path:?}");
    assert_eq!(
        asked_status.get(),
        usize::from(path == "/status"),
        "{path:?}"
    );

    let rendered = Cell::new(0);
    let metrics = metrics_route(&path, &metrics_path, || {
        rendered.set(rendered.get() + 1);
        SCRAPE.to_string()
    });
    let expected = if path == metrics_path {
        (200, PROMETHEUS, SCRAPE.to_string())
    } else {
        not_found()
    };
    check(&metrics, expected, &path);
    assert_eq!(
        rendered.get(),
        usize::from(path == metrics_path),
        "{path:?}"
    );
}

/// Go's mux's 404.
fn not_found() -> (u16, &'static str, String) {
    (404, TEXT, "404 page not found\n".to_string())
}

fn check(answer: &Answer, expected: (u16, &'static str, String), path: &str) {
    let (status, content_type, body) = expected;
    assert_eq!(answer.status, status, "{path:?}");
    assert_eq!(answer.content_type, content_type, "{path:?}");
    assert_eq!(answer.body, body, "{path:?}");
}
