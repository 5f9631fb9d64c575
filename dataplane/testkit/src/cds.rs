//! A local config discovery server speaking the protocol of STUNner's gateway operator
//! (stunnerd.md §8): `GET /api/v1/configs/<ns>/<name>` answers one config as JSON (404 with the
//! operator's body when unknown); with `watch=true` the request is a WebSocket on which the
//! current config is pushed at once and again on every change, as a text frame; pings are
//! answered with pongs. It records every request target, `Origin` header and ping payload.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tungstenite::handshake::server::{Request, Response};
use tungstenite::Message;

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
                        let (state, stop) = (state2.clone(), stop2.clone());
                        connections.push(std::thread::spawn(move || {
                            let _ = serve(stream, &state, &stop);
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

#[allow(clippy::result_large_err)] // the handshake callback type is tungstenite's
fn serve(stream: TcpStream, state: &Mutex<State>, stop: &AtomicBool) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    // Peek at the request line to tell a WebSocket watch from a plain GET.
    let mut head = [0u8; 2048];
    let n = loop {
        let n = stream.peek(&mut head)?;
        if n == 0 || head[..n].windows(4).any(|w| w == b"\r\n\r\n") || n == head.len() {
            break n;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let text = String::from_utf8_lossy(&head[..n]).to_string();
    let target = text
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("/")
        .to_string();
    state.lock().unwrap().requests.push(target.clone());
    let id = id_of(&target);
    if !target.contains("watch=true") {
        let mut stream = stream;
        let mut buf = vec![0u8; n];
        std::io::Read::read_exact(&mut stream, &mut buf)?;
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
        return std::io::Write::write_all(&mut stream, response.as_bytes());
    }
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
    socket
        .get_mut()
        .set_read_timeout(Some(Duration::from_millis(50)))?;
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
