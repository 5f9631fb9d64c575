//! The IO engines: `--io-engine auto|uring|epoll`, the one log line that says which runs and
//! why, the fallback to epoll where io_uring cannot run (a seccomp filter that denies
//! `io_uring_setup` or `io_uring_register`, as containerd 2.x and Docker 25+ do), io_uring under
//! the small memlock limit many runtimes set, relaying on whichever engine runs, and shards
//! placed on the CPUs a cpuset (`taskset`) allows. The rest of the suite runs against both engines (`.ci/run`
//! repeats it with `UTURN_IO_ENGINE=epoll`).

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;
use uturn_testkit::stunnerd::{free_port, temp_file, wait_until, Stunnerd};
use uturn_testkit::turn_client::TurnClient;

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
    let mut d = TurnClient::new(turn, "alice", "s3cret");
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

/// The rings need no locked memory (Linux 5.12+ charges them to the cgroup), so a 64 KiB
/// RLIMIT_MEMLOCK, the default of many container runtimes, does not stop the io_uring engine.
#[test]
fn uring_runs_under_a_64k_memlock_limit_and_relays() {
    let (server, port, _path) = start(MEMLOCK_64K, "auto");
    assert!(
        wait_until(10, || log_line(&server).is_some()),
        "{}",
        server.logs()
    );
    let line = log_line(&server).unwrap();
    assert!(
        line.contains("io engine: uring (io_uring is available)"),
        "{line}"
    );
    assert!(relays_both_ways(port), "{}", server.logs());
}

#[test]
fn forcing_uring_where_it_cannot_run_exits_and_names_cause_and_fix() {
    let (mut server, _port, _path) = start_denying(libc::SYS_io_uring_setup, "uring");
    assert_eq!(server.wait_exit(), Some(1), "{}", server.logs());
    let logs = server.logs();
    assert!(
        logs.contains("cannot use --io-engine uring: io_uring_setup failed with EPERM"),
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

/// Starts stunnerd (`--io-engine` `engine`) with a seccomp filter denying syscall `nr`.
fn start_denying(nr: libc::c_long, engine: &str) -> (Stunnerd, u16, std::path::PathBuf) {
    let port = free_port();
    let path = config(port);
    let server = Stunnerd::start_with(
        &[],
        &["-c", &format!("file://{}", path.display())],
        &[("UTURN_IO_ENGINE", engine)],
        uturn_testkit::stunnerd::denying(nr),
    );
    (server, port, path)
}

#[test]
fn auto_falls_back_to_epoll_under_a_seccomp_filter_that_denies_io_uring_and_relays() {
    let (server, port, _path) = start_denying(libc::SYS_io_uring_setup, "auto");
    assert!(
        wait_until(10, || log_line(&server).is_some()),
        "{}",
        server.logs()
    );
    let line = log_line(&server).unwrap();
    assert!(
        line.contains(
            "io engine: epoll (io_uring is not available: io_uring_setup failed with EPERM"
        ),
        "{line}"
    );
    assert!(line.contains("seccomp"), "{line}");
    assert!(relays_both_ways(port), "{}", server.logs());
}

#[test]
fn a_profile_that_allows_the_ring_but_not_io_uring_register_is_caught_by_the_probe() {
    let (server, port, _path) = start_denying(libc::SYS_io_uring_register, "auto");
    assert!(
        wait_until(10, || log_line(&server).is_some()),
        "{}",
        server.logs()
    );
    let line = log_line(&server).unwrap();
    assert!(
        line.contains("io engine: epoll (io_uring is not available: io_uring_register failed"),
        "{line}"
    );
    assert!(relays_both_ways(port), "{}", server.logs());
}

/// The CPUs each of the server's threads named `prefix…` may run on (from /proc).
fn thread_cpus(pid: u32, prefix: &str) -> Vec<String> {
    let mut found = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        if let Some(cpus) = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        {
            found.push(format!("{}={}", comm.trim(), cpus.trim()));
        }
    }
    found.sort();
    found
}

#[test]
fn under_taskset_shards_follow_the_cpuset_one_per_cpu_each_pinned() {
    let allowed = uturn_dataplane::io::allowed_cpus();
    let last = *allowed.last().unwrap();
    // One CPU: one shard, on that CPU.
    let port = free_port();
    let path = config(port);
    let cpu = last.to_string();
    let server = Stunnerd::start_under(
        &["taskset", "-c", &cpu],
        &["-c", &format!("file://{}", path.display())],
        // Empty: the shard count comes from the CPUs, as in a pod.
        &[("UTURN_SHARDS", "")],
    );
    assert!(
        wait_until(10, || server.logs().contains("serving on shard")),
        "{}",
        server.logs()
    );
    let logs = server.logs();
    assert!(logs.contains("dataplane: 1 shard(s)"), "{logs}");
    assert!(logs.contains(&format!("shard 0 on CPU {last}")), "{logs}");
    let threads = thread_cpus(server.pid(), "uturn-shard-");
    assert!(
        !threads.is_empty() && threads.iter().all(|t| t.ends_with(&format!("={last}"))),
        "{threads:?}"
    );
    assert!(relays_both_ways(port), "{logs}");
    drop(server);
    // Two CPUs: two shards, each pinned to its own one.
    if allowed.len() >= 2 {
        let (a, b) = (allowed[0], allowed[1]);
        let port = free_port();
        let path = config(port);
        let cpus = format!("{a},{b}");
        let server = Stunnerd::start_under(
            &["taskset", "-c", &cpus],
            &["-c", &format!("file://{}", path.display())],
            &[("UTURN_SHARDS", "")],
        );
        let pid = server.pid();
        assert!(
            wait_until(10, || thread_cpus(pid, "uturn-shard-").len() >= 2),
            "{}",
            server.logs()
        );
        let logs = server.logs();
        assert!(logs.contains("dataplane: 2 shard(s)"), "{logs}");
        let threads = thread_cpus(server.pid(), "uturn-shard-");
        assert!(
            threads
                .iter()
                .any(|t| t.starts_with("uturn-shard-0") && t.ends_with(&format!("={a}"))),
            "{threads:?}"
        );
        assert!(
            threads
                .iter()
                .any(|t| t.starts_with("uturn-shard-1") && t.ends_with(&format!("={b}"))),
            "{threads:?}"
        );
    }
}
