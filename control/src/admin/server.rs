//! The admin servers' sockets: a dual-stack bind for wildcard endpoints, and the accept loop
//! that answers each request with what the handler makes of its path ([`super::routes`]).

use super::routes::{parse_request, render_response, Answer, Request};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Maps a request path (query stripped) to its answer.
pub(crate) type Handler = Arc<dyn Fn(&[u8]) -> Answer + Send + Sync>;

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

/// Serves `handler` on `listener` until the task is dropped.
pub(crate) async fn serve(listener: TcpListener, handler: Handler) {
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
    let path = loop {
        match parse_request(&request) {
            Request::Complete { path } => break path,
            Request::TooLarge => return Ok(()),
            Request::Incomplete => {}
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        request.extend_from_slice(&buf[..n]);
    };
    let response = render_response(&handler(path));
    stream.write_all(&response).await?;
    stream.shutdown().await
}
