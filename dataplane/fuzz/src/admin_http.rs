//! `admin_http`: the request handling of the health-check, status and metrics servers
//! (`control/src/admin/routes.rs`, compiled here on its own so the instrumented build carries no tokio
//! or kube): finding the request head, taking its path, routing it, writing the answer.
//!
//! Input: `[flags: u8][chunk sizes: u8 × 4][request bytes]`. Flags bit 0: whether `/ready` is
//! ready. The request is fed as the server reads it, in chunks of the given sizes (0 = 1 byte)
//! and then 1024-byte reads, stopping at the first complete or oversized head.
//!
//! Checks: never panics; reading in chunks gives the same outcome as the whole input at once;
//! a path is a range of the head's first line with no space, `?` or CR; only an input of
//! `MAX_REQUEST` bytes or more is too large; every answer is 200, 404 or 503 (503 only for an
//! unready `/ready`), and its rendering parses back with a `Content-Length` equal to the body.

#[allow(dead_code)]
#[path = "../../../control/src/admin/routes.rs"]
mod http;

use crate::input::Input;
use http::{health_route, parse_request, render_response, Request, MAX_REQUEST};

/// The fuzz target.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let ready = input.u8() & 1 == 1;
    let chunks = input.array::<4>();
    let request = input.rest();

    let whole = parse_request(request);
    let mut received = Vec::new();
    let mut sizes = chunks
        .iter()
        .map(|&c| usize::from(c).max(1))
        .chain(std::iter::repeat(1024));
    let incremental = loop {
        match parse_request(&received) {
            Request::Incomplete if received.len() < request.len() => {
                let n = sizes
                    .next()
                    .unwrap_or(1024)
                    .min(request.len() - received.len());
                received.extend_from_slice(&request[received.len()..received.len() + n]);
            }
            outcome => break outcome_of(outcome),
        }
    };
    assert_eq!(
        incremental,
        outcome_of(whole),
        "chunked reading changed the outcome"
    );

    match whole {
        Request::Incomplete => assert!(request.len() < MAX_REQUEST),
        Request::TooLarge => assert!(request.len() >= MAX_REQUEST),
        Request::Complete { path } => {
            assert!(path.len() < MAX_REQUEST);
            assert!(
                !path.iter().any(|b| matches!(b, b' ' | b'?' | b'\r')),
                "{path:?}"
            );
            if !path.is_empty() {
                let start = (path.as_ptr() as usize).wrapping_sub(request.as_ptr() as usize);
                assert!(
                    start + path.len() <= request.len(),
                    "the path is not in the input"
                );
            }
            let answer = health_route(path, || ready, || "{\"status\":\"READY\"}".to_string());
            match answer.0 {
                200 => assert!(path != b"/ready" || ready),
                503 => assert!(path == b"/ready" && !ready),
                404 => assert!(!matches!(path, b"/live" | b"/ready" | b"/status")),
                other => panic!("status {other}"),
            }
            check_rendering(&answer);
        }
    }
}

/// The outcome without the borrowed path, for comparing the two readings.
fn outcome_of(request: Request<'_>) -> (u8, Vec<u8>) {
    match request {
        Request::Incomplete => (0, Vec::new()),
        Request::TooLarge => (1, Vec::new()),
        Request::Complete { path } => (2, path.to_vec()),
    }
}

fn check_rendering(answer: &http::Answer) {
    let bytes = render_response(answer);
    let text = std::str::from_utf8(&bytes).expect("a response is UTF-8");
    let (head, body) = text.split_once("\r\n\r\n").expect("a response has a head");
    assert!(
        head.starts_with(&format!("HTTP/1.1 {} ", answer.0)),
        "{head}"
    );
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .and_then(|v| v.parse().ok())
        .expect("a Content-Length");
    assert_eq!(length, body.len());
    assert_eq!(body, answer.2);
}
