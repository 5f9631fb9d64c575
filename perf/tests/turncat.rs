//! turncat against a TURN server no one here wrote: coturn's `turnserver` on loopback, over
//! each of UDP, TCP, TLS and DTLS. Each test has its own coturn, echo peer and turncat.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use uturn_testkit::stunnerd::{free_port, temp_dir, wait_for_tcp, Killed};
use uturn_testkit::tls::self_signed_cert;
use uturn_testkit::turncat::relay_through;

/// A coturn serving TURN over UDP and TCP on `port` and TLS and DTLS on `tls_port`.
struct Coturn {
    port: u16,
    tls_port: u16,
    dir: std::path::PathBuf,
    _child: Killed,
}

impl Drop for Coturn {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// coturn with static user1:pass1.
fn coturn() -> Coturn {
    coturn_with(&["--user=user1:pass1", "--lt-cred-mech"])
}

/// coturn with `auth` (its credential flags).
fn coturn_with(auth: &[&str]) -> Coturn {
    let dir = temp_dir("turncat-coturn");
    let cert = self_signed_cert(&dir);
    let (port, tls_port) = (free_port(), free_port());
    let child = Command::new("turnserver")
        .args([
            "-n",
            "--listening-ip=127.0.0.1",
            &format!("--listening-port={port}"),
            &format!("--tls-listening-port={tls_port}"),
            "--relay-ip=127.0.0.1",
            "--realm=perf",
            "--no-cli",
            "--allow-loopback-peers",
            &format!("--cert={}", cert.cert.display()),
            &format!("--pkey={}", cert.key.display()),
            "--log-file=stdout",
            "--simple-log",
        ])
        .args(auth)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run coturn's turnserver ({e}): apt-get install -y coturn")
        });
    let child = Killed(child);
    for p in [port, tls_port] {
        let addr: SocketAddr = format!("127.0.0.1:{p}").parse().unwrap();
        wait_for_tcp(addr, Duration::from_secs(10)).unwrap();
    }
    Coturn {
        port,
        tls_port,
        dir,
        _child: child,
    }
}

fn uri(port: u16, transport: &str) -> String {
    format!("turn://user1:pass1@127.0.0.1:{port}?transport={transport}")
}

#[test]
fn relays_10k_datagrams_through_coturn_over_udp() {
    let server = coturn();
    relay_through(&uri(server.port, "udp"), &[]);
}

#[test]
fn relays_10k_datagrams_through_coturn_over_tcp() {
    let server = coturn();
    relay_through(&uri(server.port, "tcp"), &[]);
}

#[test]
fn relays_10k_datagrams_through_coturn_over_tls() {
    let server = coturn();
    relay_through(&uri(server.tls_port, "tls"), &["-i"]);
}

#[test]
fn relays_10k_datagrams_through_coturn_over_dtls() {
    let server = coturn();
    relay_through(&uri(server.tls_port, "dtls"), &["-i"]);
}

/// Runs `turncat … - <uri> udp://<peer>` with `input` on stdin; exit code, stdout, stderr.
fn turncat_stdio(args: &[&str], input: &[u8], timeout: Duration) -> (Option<i32>, Vec<u8>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_turncat"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = stdout.read_to_end(&mut bytes);
        bytes
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let mut child = Killed(child);
    let deadline = Instant::now() + timeout;
    let code = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status.code();
        }
        if Instant::now() >= deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(child);
    (code, out.join().unwrap(), err.join().unwrap())
}

#[test]
fn stdin_is_relayed_and_echoes_reach_stdout_then_it_exits() {
    let server = coturn();
    let echo = uturn_testkit::peers::Peer::start();
    let peer = format!("udp://{}", echo.addr);
    for (transport, port, insecure) in [("udp", server.port, false), ("tls", server.tls_port, true)]
    {
        let uri = uri(port, transport);
        let mut args = vec![];
        if insecure {
            args.push("-i");
        }
        args.extend(["-", uri.as_str(), peer.as_str()]);
        let (code, out, err) =
            turncat_stdio(&args, b"hello through turn\n", Duration::from_secs(20));
        assert_eq!(code, Some(0), "{transport}: {err}");
        assert_eq!(out, b"hello through turn\n", "{transport}: {err}");
        assert!(
            err.contains("turncat: - -> relay 127.0.0.1:"),
            "{transport}: {err}"
        );
    }
}

#[test]
fn wrong_password_and_untrusted_certificate_fail_with_a_fix() {
    let server = coturn();
    let peer = "udp://127.0.0.1:9";
    let bad = format!("turn://user1:wrong@127.0.0.1:{}", server.port);
    let (code, _, err) = turncat_stdio(&["-", &bad, peer], b"x", Duration::from_secs(20));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("401") && err.contains("password"), "{err}");
    for transport in ["tls", "dtls"] {
        let strict = uri(server.tls_port, transport);
        let (code, _, err) = turncat_stdio(&["-", &strict, peer], b"x", Duration::from_secs(20));
        assert_eq!(code, Some(1), "{transport}: {err}");
        assert!(err.contains("--insecure"), "{transport}: {err}");
    }
}

#[test]
fn a_shared_secret_mints_credentials_coturn_accepts() {
    let server = coturn_with(&["--use-auth-secret", "--static-auth-secret=s3cr3t"]);
    let echo = uturn_testkit::peers::Peer::start();
    let peer = format!("udp://{}", echo.addr);
    let uri = format!("turn://alice@127.0.0.1:{}", server.port);
    let args = ["--secret", "s3cr3t", "-", uri.as_str(), peer.as_str()];
    let (code, out, err) = turncat_stdio(&args, b"minted\n", Duration::from_secs(20));
    assert_eq!((code, out.as_slice()), (Some(0), &b"minted\n"[..]), "{err}");
    let args = ["--secret", "wrong", "-", uri.as_str(), peer.as_str()];
    let (code, _, err) = turncat_stdio(&args, b"x", Duration::from_secs(20));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("401"), "{err}");
}
