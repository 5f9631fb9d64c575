//! The IO engines: `--io-engine auto|uring|epoll`, the one log line that says which runs and
//! why, the fallback to epoll where io_uring cannot run (here: a memlock limit below what
//! glommio needs, set with `prlimit`), and relaying on whichever engine runs. The rest of the
//! suite runs against both engines (`.ci/run` repeats it with `UTURN_IO_ENGINE=epoll`).

mod support;

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;
use support::{free_port, temp_file, wait_until, Driver, Stunnerd};

const MEMLOCK_64K: &[&str] = &["prlimit", "--memlock=65536:65536"];

fn config(port: u16) -> std::path::PathBuf {
    let path = temp_file("engines.yaml");
    std::fs::write(
        &path,
        format!(
            "version: v1\nadmin: {{healthcheck_endpoint: \"\"}}\nauth: {{type: static, credentials: {{username: alice, password: s3cret}}}}\nlisteners: [{{name: udp, address: 127.0.0.1, port: {port}, routes: [media]}}]\nclusters: [{{name: media, endpoints: [127.0.0.1]}}]\n"
        ),
    )
    .unwrap();
    path
}

fn start(wrapper: &[&str], engine: &str) -> (Stunnerd, u16, std::path::PathBuf) {
    let port = free_port();
    let path = config(port);
    let server = Stunnerd::start_under(
        wrapper,
        &["-c", &format!("file://{}", path.display())],
        &[("UTURN_IO_ENGINE", engine)],
    );
    (server, port, path)
}

/// Allocates, relays one datagram each way through a channel, and checks the bytes.
fn relays_both_ways(port: u16) -> bool {
    let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
    peer.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let peer_addr = peer.local_addr().unwrap();
    let turn: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut d = Driver::new(turn, "alice", "s3cret");
    let Some(relay) = d.allocate() else {
        return false;
    };
    if !d.permit(peer_addr.ip()) || !d.bind(peer_addr) {
        return false;
    }
    d.send(peer_addr, b"up through the relay");
    let mut buf = [0u8; 64];
    let Ok((n, from)) = peer.recv_from(&mut buf) else {
        return false;
    };
    if &buf[..n] != b"up through the relay" || from != relay {
        return false;
    }
    peer.send_to(b"down to the client", relay).unwrap();
    d.drive(0.3);
    d.received.iter().any(|(_, p)| p == b"down to the client")
}

fn log_line(server: &Stunnerd) -> Option<String> {
    server
        .logs()
        .lines()
        .find(|l| l.contains("io engine: "))
        .map(str::to_owned)
}

#[test]
fn auto_falls_back_to_epoll_when_memlock_is_too_small_and_relays() {
    let (server, port, _path) = start(MEMLOCK_64K, "auto");
    assert!(
        wait_until(10, || log_line(&server).is_some()),
        "{}",
        server.logs()
    );
    let line = log_line(&server).unwrap();
    assert!(
        line.contains("io engine: epoll (io_uring is not available: RLIMIT_MEMLOCK is 64 KiB"),
        "{line}"
    );
    assert!(relays_both_ways(port), "{}", server.logs());
}

#[test]
fn forcing_uring_where_it_cannot_run_exits_and_names_cause_and_fix() {
    let (mut server, _port, _path) = start(MEMLOCK_64K, "uring");
    assert_eq!(server.wait_exit(), Some(1), "{}", server.logs());
    let logs = server.logs();
    assert!(
        logs.contains("cannot use --io-engine uring: RLIMIT_MEMLOCK is 64 KiB"),
        "{logs}"
    );
    assert!(logs.contains("or use --io-engine epoll"), "{logs}");
}

#[test]
fn epoll_runs_when_asked_and_relays() {
    let (server, port, _path) = start(&[], "epoll");
    assert!(wait_until(10, || log_line(&server).is_some()));
    assert!(
        log_line(&server)
            .unwrap()
            .contains("io engine: epoll (--io-engine epoll)"),
        "{}",
        server.logs()
    );
    assert!(relays_both_ways(port), "{}", server.logs());
}

#[test]
fn auto_runs_uring_where_the_probe_passes_and_says_why_not_elsewhere() {
    let (server, port, _path) = start(&[], "auto");
    assert!(wait_until(10, || log_line(&server).is_some()));
    let line = log_line(&server).unwrap();
    match uturn_dataplane::io::probe::probe_uring() {
        Ok(()) => assert!(
            line.contains("io engine: uring (io_uring is available)"),
            "{line}"
        ),
        Err(why) => assert!(
            line.contains(&format!(
                "io engine: epoll (io_uring is not available: {why}"
            )),
            "{line}"
        ),
    }
    assert!(relays_both_ways(port), "{}", server.logs());
}
