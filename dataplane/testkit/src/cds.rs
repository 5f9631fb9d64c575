//! A local config discovery server speaking the protocol of STUNner's gateway operator
//! (stunnerd.md §8): `GET /api/v1/configs/<ns>/<name>` answers one config as JSON (404 with the
//! operator's body when unknown); with `watch=true` the request is a WebSocket on which the
//! current config is pushed at once and again on every change, as a text frame; pings are
//! answered with pongs. It records every request target, `Origin` header and ping payload.
//! [`FakeCds::start_tls`] serves the same over TLS (an `https://` / `wss://` origin).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tungstenite::handshake::server::{Request, Response};
use tungstenite::Message;

/// How long a TLS handshake may wait for the client's next flight.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(5);
/// How often a connection being served looks at the stop flag.
const SERVE_POLL: Duration = Duration::from_millis(50);

#[derive(Default)]
struct State {
    /// Configs pushed so far, by `<ns>/<name>`; the last one is current.
    configs: std::collections::BTreeMap<String, Vec<String>>,
    requests: Vec<String>,
    origins: Vec<String>,
    pings: Vec<Vec<u8>>,
}

/// A running fake CDS server; it stops (closing every connection) when dropped.
pub struct FakeCds {
    state: Arc<Mutex<State>>,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl FakeCds {
    /// Starts on `addr` (port 0 for a free one).
    pub fn start(addr: &str) -> FakeCds {
        FakeCds::start_with(addr, None)
    }

    /// Starts on `addr`, speaking TLS with the PEM certificate and key files given.
    pub fn start_tls(addr: &str, cert: &std::path::Path, key: &std::path::Path) -> FakeCds {
        use openssl::ssl::{SslAcceptor, SslFiletype, SslMethod};
        let mut acceptor = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls()).unwrap();
        acceptor.set_certificate_chain_file(cert).unwrap();
        acceptor
            .set_private_key_file(key, SslFiletype::PEM)
            .unwrap();
        FakeCds::start_with(addr, Some(Arc::new(acceptor.build())))
    }

    fn start_with(addr: &str, tls: Option<Arc<openssl::ssl::SslAcceptor>>) -> FakeCds {
        let listener = loop {
            match TcpListener::bind(addr) {
                Ok(l) => break l,
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (state2, stop2) = (state.clone(), stop.clone());
        let accept = std::thread::spawn(move || {
            let mut connections = Vec::new();
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let (state, stop, tls) = (state2.clone(), stop2.clone(), tls.clone());
                        connections.push(std::thread::spawn(move || {
                            let _ = stream.set_nonblocking(false);
                            // The handshake may wait for a busy client (a loaded CI machine)
                            // far longer than a poll; serving then polls the stop flag.
                            let _ = stream.set_read_timeout(Some(HANDSHAKE_WAIT));
                            let poll = |s: &TcpStream| s.set_read_timeout(Some(SERVE_POLL));
                            let _ = match tls {
                                None => {
                                    let _ = poll(&stream);
                                    serve(stream, &state, &stop)
                                }
                                Some(acceptor) => match acceptor.accept(stream) {
                                    Ok(stream) => {
                                        let _ = poll(stream.get_ref());
                                        serve(stream, &state, &stop)
                                    }
                                    Err(_) => Ok(()),
                                },
                            };
                        }));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
            for c in connections {
                let _ = c.join();
            }
        });
        FakeCds {
            state,
            addr,
            stop,
            accept: Some(accept),
        }
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets (and pushes to watchers) the config of gateway `id` (`<ns>/<name>`).
    pub fn push(&self, id: &str, config_json: &str) {
        let mut s = self.state.lock().unwrap();
        s.configs
            .entry(id.to_string())
            .or_default()
            .push(config_json.to_string());
    }

    /// Sets the configs of gateway `id` one after the other, pushed to watchers back to back
    /// in one write (so a client reads them together).
    pub fn push_many(&self, id: &str, configs_json: &[&str]) {
        let mut s = self.state.lock().unwrap();
        let configs = s.configs.entry(id.to_string()).or_default();
        configs.extend(configs_json.iter().map(|c| c.to_string()));
    }

    /// Request targets seen so far.
    pub fn requests(&self) -> Vec<String> {
        self.state.lock().unwrap().requests.clone()
    }

    /// `Origin` headers of the WebSocket requests seen so far.
    pub fn origins(&self) -> Vec<String> {
        self.state.lock().unwrap().origins.clone()
    }

    /// Payloads of the pings received so far.
    pub fn pings(&self) -> Vec<Vec<u8>> {
        self.state.lock().unwrap().pings.clone()
    }

    /// Stops the server and closes every connection.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

impl Drop for FakeCds {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn id_of(target: &str) -> Option<String> {
    let path = target.split('?').next()?;
    let rest = path.strip_prefix("/api/v1/configs/")?;
    let (ns, name) = rest.split_once('/')?;
    Some(format!("{ns}/{name}"))
}

/// A stream whose first bytes are `head` (already read off `inner`).
struct Replay<S> {
    head: Vec<u8>,
    read: usize,
    inner: S,
}

impl<S: Read> Read for Replay<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.read < self.head.len() {
            let n = buf.len().min(self.head.len() - self.read);
            buf[..n].copy_from_slice(&self.head[self.read..self.read + n]);
            self.read += n;
            return Ok(n);
        }
        self.inner.read(buf)
    }
}

impl<S: Write> Write for Replay<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Reads the request head (up to the blank line) off `stream`.
fn read_head(stream: &mut impl Read, stop: &AtomicBool) -> std::io::Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 8192 {
        match stream.read(&mut byte) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => head.push(byte[0]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) && !stop.load(Ordering::Relaxed) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(head)
}

#[allow(clippy::result_large_err)] // the handshake callback type is tungstenite's
fn serve<S: Read + Write>(
    mut stream: S,
    state: &Mutex<State>,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    // The request head tells a WebSocket watch from a plain GET.
    let head = read_head(&mut stream, stop)?;
    let text = String::from_utf8_lossy(&head).to_string();
    let target = text
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("/")
        .to_string();
    state.lock().unwrap().requests.push(target.clone());
    let id = id_of(&target);
    if !target.contains("watch=true") {
        let found = id
            .as_ref()
            .and_then(|id| state.lock().unwrap().configs.get(id)?.last().cloned());
        let (status, body) = match found {
            Some(config) => ("200 OK", config),
            None => (
                "404 Not Found",
                format!(
                    "{{\"code\":404,\"message\":\"Config not found for ID {}\"}}",
                    id.unwrap_or_default()
                ),
            ),
        };
        let response = format!(
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(response.as_bytes())?;
        return stream.flush();
    }
    let stream = Replay {
        head,
        read: 0,
        inner: stream,
    };
    let mut socket = tungstenite::accept_hdr(stream, |request: &Request, response: Response| {
        if let Some(origin) = request.headers().get("Origin") {
            state
                .lock()
                .unwrap()
                .origins
                .push(origin.to_str().unwrap_or_default().to_string());
        }
        Ok(response)
    })
    .map_err(|e| std::io::Error::other(e.to_string()))?;
    let id = id.unwrap_or_default();
    // A new subscriber gets the current config, then every later one.
    let mut next = state
        .lock()
        .unwrap()
        .configs
        .get(&id)
        .map_or(0, |c| c.len().saturating_sub(1));
    while !stop.load(Ordering::Relaxed) {
        let pending: Vec<String> = state
            .lock()
            .unwrap()
            .configs
            .get(&id)
            .map(|c| c[next.min(c.len())..].to_vec())
            .unwrap_or_default();
        let any = !pending.is_empty();
        for config in pending {
            next += 1;
            if socket.write(Message::Text(config.into())).is_err() {
                return Ok(());
            }
        }
        if any && socket.flush().is_err() {
            return Ok(());
        }
        match socket.read() {
            Ok(Message::Ping(payload)) => {
                state.lock().unwrap().pings.push(payload.to_vec());
                let _ = socket.flush();
            }
            Ok(Message::Close(_)) => return Ok(()),
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Ok(()),
        }
    }
    // Going away: drop the TCP connection without a close handshake, as a killed pod would.
    Ok(())
}
