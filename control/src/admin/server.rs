//! The admin servers' sockets and connections: a dual-stack bind for wildcard endpoints, and
//! hyper serving HTTP/1.1 on each accepted connection (request parsing, keep-alive, the head's
//! size limit and read timeout), answering each request with what the handler makes of its
//! path ([`super::routes`]).

use super::routes::Answer;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

/// Maps a request path (without its query) to its answer.
pub(crate) type Handler = Arc<dyn Fn(&str) -> Answer + Send + Sync>;

/// What a client may send and how long it may take.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// How long a request head may take to arrive; an idle keep-alive connection waiting for
    /// the next head is closed after as long.
    pub(crate) header_read_timeout: Duration,
    /// The largest request head (request line and headers); a longer one is answered 431 and
    /// the connection closes. Also bounds a connection's read buffer.
    pub(crate) max_head: usize,
}

/// A probe or scrape sends a head of a few hundred bytes at once: 8 KiB within 5 s leaves room
/// for any real client and keeps a slow or oversized one from holding a connection.
pub(crate) const LIMITS: Limits = Limits {
    header_read_timeout: Duration::from_secs(5),
    // hyper's smallest read buffer (it panics below 8 KiB).
    max_head: 8 << 10,
};

/// Opens the listening socket of an admin server on `addr`. A wildcard address (an empty host,
/// `0.0.0.0` or `[::]`) listens dual-stack on `[::]` with IPV6_V6ONLY off, as Go's
/// `net.Listen("tcp", ":8086")` does in stunnerd, so that kubelet probes reach it on IPv4-only,
/// dual-stack and IPv6-only clusters alike; where the host has no IPv6 it falls back to
/// `0.0.0.0`. Returns the socket and the address it is bound to.
pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<(std::net::TcpListener, SocketAddr)> {
    if addr.ip().is_unspecified() {
        let any6 = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), addr.port());
        match bind_socket(any6, Some(false)) {
            Ok(listener) => return Ok((listener, any6)),
            // Only a missing IPv6 stack falls back: a port in use is in use on both.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL | libc::EPROTONOSUPPORT)
                ) =>
            {
                tracing::debug!(target: "stunnerd", "no IPv6 for {any6} ({e}): listening on IPv4 only");
            }
            Err(e) => return Err(e),
        }
        let any4 = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), addr.port());
        return bind_socket(any4, None).map(|l| (l, any4));
    }
    bind_socket(addr, None).map(|l| (l, addr))
}

fn bind_socket(addr: SocketAddr, only_v6: Option<bool>) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if let Some(only_v6) = only_v6 {
        socket.set_only_v6(only_v6)?;
    }
    // As Go's listeners: a restarted server rebinds a port with connections in TIME_WAIT.
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(128)?;
    Ok(socket.into())
}

/// Serves `handler` on `listener` with [`LIMITS`] until the task is dropped, which also
/// closes the connections it accepted.
pub(crate) async fn serve(listener: TcpListener, handler: Handler) {
    serve_with(listener, handler, LIMITS).await
}

/// [`serve`] with other limits.
pub(crate) async fn serve_with(listener: TcpListener, handler: Handler, limits: Limits) {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_header_size(limits.max_head)
        .max_buf_size(limits.max_head);
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next() => continue,
        };
        let Ok((stream, _)) = accepted else {
            // Out of file descriptors, most likely: wait for some to close.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let handler = handler.clone();
        let service = service_fn(move |request: Request<Incoming>| {
            std::future::ready(Ok::<_, Infallible>(response(handler(request.uri().path()))))
        });
        let connection = http.serve_connection(TokioIo::new(stream), service);
        connections.spawn(async move {
            // A client that breaks the protocol or goes away only ends its own connection.
            let _ = connection.await;
        });
    }
}

fn response(answer: Answer) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(answer.body)));
    *response.status_mut() =
        StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(answer.content_type));
    response
}

#[cfg(test)]
mod tests {
    use super::super::routes::{health_route, NOT_FOUND_BODY, NOT_READY_BODY};
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::time::timeout;

    /// A health server that is not ready, on a free loopback port.
    fn start(limits: Limits) -> SocketAddr {
        let (listener, addr) = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = TcpListener::from_std(listener).unwrap();
        let port = listener.local_addr().unwrap().port();
        let handler: Handler =
            Arc::new(|path| health_route(path, || false, || "{\"status\":\"x\"}".into()));
        tokio::spawn(serve_with(listener, handler, limits));
        SocketAddr::new(addr.ip(), port)
    }

    /// Everything the server sends until it closes the connection (at most 2 s).
    async fn read_all(stream: &mut TcpStream) -> String {
        let mut received = Vec::new();
        let _ = timeout(Duration::from_secs(2), stream.read_to_end(&mut received)).await;
        String::from_utf8_lossy(&received).into_owned()
    }

    async fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request).await.unwrap();
        read_all(&mut stream).await
    }

    fn status_of(response: &str) -> Option<u16> {
        response.split_whitespace().nth(1)?.parse().ok()
    }

    fn header<'a>(response: &'a str, name: &str) -> Option<&'a str> {
        let head = response.split_once("\r\n\r\n")?.0;
        head.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.eq_ignore_ascii_case(name).then(|| value.trim())
        })
    }

    fn body_of(response: &str) -> &str {
        response.split_once("\r\n\r\n").map_or("", |(_, body)| body)
    }

    #[tokio::test]
    async fn paths_route_exactly_whatever_the_method_and_query() {
        let addr = start(LIMITS);
        let ready = exchange(
            addr,
            b"GET /ready?x=1 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert_eq!(status_of(&ready), Some(503), "{ready}");
        assert_eq!(body_of(&ready), NOT_READY_BODY);
        assert_eq!(
            header(&ready, "content-type"),
            Some("application/json; charset=utf-8")
        );
        let length = header(&ready, "content-length").and_then(|l| l.parse().ok());
        assert_eq!(length, Some(NOT_READY_BODY.len()));
        let live = exchange(addr, b"BREW /live HTTP/1.1\r\nConnection: close\r\n\r\n").await;
        assert_eq!(status_of(&live), Some(200), "{live}");
        let status = exchange(addr, b"POST /status HTTP/1.0\r\n\r\n").await;
        assert_eq!(body_of(&status), "{\"status\":\"x\"}\n");
        let other = exchange(addr, b"GET /live/ HTTP/1.1\r\nConnection: close\r\n\r\n").await;
        assert_eq!(status_of(&other), Some(404), "{other}");
        assert_eq!(body_of(&other), NOT_FOUND_BODY);
        assert_eq!(
            header(&other, "content-type"),
            Some("text/plain; charset=utf-8")
        );
    }

    #[tokio::test]
    async fn a_head_is_answered_once_complete_and_the_connection_kept() {
        let addr = start(LIMITS);
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(b"GET /live HTTP/1.1\r\n").await.unwrap();
        let mut byte = [0u8; 1];
        let early = timeout(Duration::from_millis(100), stream.read(&mut byte)).await;
        assert!(early.is_err(), "answered an incomplete head");
        stream.write_all(b"Host: a\r\n\r\n").await.unwrap();
        stream
            .write_all(b"GET /ready HTTP/1.1\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let both = read_all(&mut stream).await;
        assert_eq!(both.matches("HTTP/1.1 200 OK").count(), 1, "{both}");
        assert_eq!(both.matches("HTTP/1.1 503 ").count(), 1, "{both}");
    }

    #[tokio::test]
    async fn a_head_of_8_kib_is_answered_and_a_longer_one_refused() {
        let addr = start(LIMITS);
        let fitting = head_of(LIMITS.max_head, "/live");
        let answer = exchange(addr, &fitting).await;
        assert_eq!(status_of(&answer), Some(200), "{answer}");
        let too_long = head_of(LIMITS.max_head + 1, "/live");
        let answer = exchange(addr, &too_long).await;
        assert_eq!(status_of(&answer), Some(431), "{answer}");
        // A head that never ends is cut at the limit, not read on.
        let mut endless = b"GET /live HTTP/1.1\r\nX: ".to_vec();
        endless.resize(LIMITS.max_head * 2, b'a');
        let answer = exchange(addr, &endless).await;
        assert_eq!(status_of(&answer), Some(431), "{answer}");
    }

    /// A complete `GET path` head of exactly `len` bytes, padded with one header.
    fn head_of(len: usize, path: &str) -> Vec<u8> {
        let mut head = format!("GET {path} HTTP/1.1\r\nConnection: close\r\nX: ").into_bytes();
        head.resize(len - 4, b'a');
        head.extend_from_slice(b"\r\n\r\n");
        head
    }

    #[tokio::test]
    async fn a_slow_head_is_cut_off() {
        let limits = Limits {
            header_read_timeout: Duration::from_millis(200),
            ..LIMITS
        };
        let addr = start(limits);
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(b"GET /live HTTP/1.1\r\n").await.unwrap();
        let answer = read_all(&mut stream).await;
        assert_eq!(status_of(&answer), None, "{answer}");
        let mut byte = [0u8; 1];
        let closed = timeout(Duration::from_millis(100), stream.read(&mut byte)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "not closed");
    }
}
