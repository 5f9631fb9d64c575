//! turncat through uturn's own four listener kinds (TURN-UDP, TURN-TCP, TURN-TLS, TURN-DTLS)
//! to a UDP echo peer: 10 000 datagrams each, every byte back, in order.
//!
//! The server is the workspace's `stunnerd` binary, found beside `turncat` in the target
//! directory (`cargo test --workspace` builds every binary before it runs any test).

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;
use uturn_testkit::stunnerd::{free_port, stunnerd_binary, temp_dir, wait_for_tcp, Killed};
use uturn_testkit::tls::self_signed_cert;
use uturn_testkit::turncat::relay_through;

/// A stunnerd with one listener of each kind; ports: (udp and tcp, tls and dtls).
struct Uturn {
    udp_tcp: u16,
    secure: u16,
    dir: PathBuf,
    child: Option<Killed>,
}

impl Drop for Uturn {
    fn drop(&mut self) {
        drop(self.child.take());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn uturn() -> Uturn {
    use base64::Engine as _;
    let dir = temp_dir("turncat-uturn");
    let certificate = self_signed_cert(&dir);
    let b64 = |path: &PathBuf| {
        base64::engine::general_purpose::STANDARD.encode(std::fs::read(path).unwrap())
    };
    let (cert, key) = (b64(&certificate.cert), b64(&certificate.key));
    let (udp_tcp, secure) = (free_port(), free_port());
    let config = dir.join("stunnerd.yaml");
    let route = "address: 127.0.0.1, routes: [echo]";
    std::fs::write(
        &config,
        format!(
            "version: v1\nadmin: {{healthcheck_endpoint: \"\", loglevel: \"all:WARN\"}}\n\
             auth: {{type: static, credentials: {{username: user1, password: pass1}}}}\n\
             listeners:\n\
             - {{name: udp, protocol: TURN-UDP, port: {udp_tcp}, {route}}}\n\
             - {{name: tcp, protocol: TURN-TCP, port: {udp_tcp}, {route}}}\n\
             - {{name: tls, protocol: TURN-TLS, port: {secure}, {route}, cert: \"{cert}\", key: \"{key}\"}}\n\
             - {{name: dtls, protocol: TURN-DTLS, port: {secure}, {route}, cert: \"{cert}\", key: \"{key}\"}}\n\
             clusters: [{{name: echo, endpoints: [\"127.0.0.1\"]}}]\n"
        ),
    )
    .unwrap();
    let child = Command::new(stunnerd_binary())
        .arg("-c")
        .arg(format!("file://{}", config.display()))
        .env("UTURN_SHARDS", "2")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start stunnerd");
    let mut child = Killed(child);
    for port in [udp_tcp, secure] {
        if let Err(e) = wait_for_tcp(
            format!("127.0.0.1:{port}").parse().unwrap(),
            Duration::from_secs(10),
        ) {
            let _ = child.0.kill();
            let mut log = String::new();
            if let Some(mut out) = child.0.stdout.take() {
                let _ = out.read_to_string(&mut log);
            }
            panic!("stunnerd did not listen on {port}: {e}\n{log}");
        }
    }
    Uturn {
        udp_tcp,
        secure,
        dir,
        child: Some(child),
    }
}

#[test]
fn turncat_through_uturn_udp() {
    let s = uturn();
    relay_through(
        &format!("turn://user1:pass1@127.0.0.1:{}?transport=udp", s.udp_tcp),
        &[],
    );
}

#[test]
fn turncat_through_uturn_tcp() {
    let s = uturn();
    relay_through(
        &format!("turn://user1:pass1@127.0.0.1:{}?transport=tcp", s.udp_tcp),
        &[],
    );
}

#[test]
fn turncat_through_uturn_tls() {
    let s = uturn();
    relay_through(
        &format!("turns://user1:pass1@127.0.0.1:{}?transport=tcp", s.secure),
        &["-i"],
    );
}

#[test]
fn turncat_through_uturn_dtls() {
    let s = uturn();
    relay_through(
        &format!("turns://user1:pass1@127.0.0.1:{}?transport=udp", s.secure),
        &["-i"],
    );
}
