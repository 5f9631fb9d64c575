//! Restarts that keep the calls: `stunnerd --state-dir DIR` journals its TURN allocations in
//! DIR (mode 0700, files 0600), and the next process, after a `kill -9`, re-creates them before
//! `/ready` answers 200, so a client's channel goes on relaying through the same relay address
//! and its next requests succeed with the nonce it holds. Also: a directory a running process
//! holds is refused to a second one, a damaged journal costs only the entries it touched, a
//! journal of an unknown format version is left unread, a peer the new config no longer admits
//! loses its channel but not the allocation, and no secret reaches the logs or `/status`.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::ops::Range;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;
use uturn_perf::client::BenchClient;
use uturn_testkit::peers::Peer;
use uturn_testkit::stunnerd::{
    free_port, http_get, metric, run_binary, status, stunnerd_binary, temp_dir, temp_file,
    wait_until, Stunnerd,
};
use uturn_testkit::turn_client::{Response, TurnClient};

const PASSWORD: &str = "r3start-p4ssw0rd";
const REFRESH: u16 = 0x0004;
const ADOPTED: &str = "uturn_restored_allocations_total{outcome=\"adopted\"} ";

/// A gateway's config file on ports of its own, admitting peers at one address, and the state
/// directory it runs on.
struct Gateway {
    turn: u16,
    health: u16,
    metrics: u16,
    config: PathBuf,
    origin: String,
    state: PathBuf,
    /// The state directory is the config's `admin.state_dir`, not `--state-dir`.
    in_config: bool,
}

impl Gateway {
    fn new(state: &Path, peer_endpoint: &str) -> Gateway {
        let config = temp_file("restart.yaml");
        let gateway = Gateway {
            turn: free_port(),
            health: free_port(),
            metrics: free_port(),
            origin: format!("file://{}", config.display()),
            config,
            state: state.to_path_buf(),
            in_config: false,
        };
        gateway.admit(peer_endpoint);
        gateway
    }

    /// The same gateway with its state directory named by its config's `admin.state_dir`.
    fn named_in_config(mut self, peer_endpoint: &str) -> Gateway {
        self.in_config = true;
        self.admit(peer_endpoint);
        self
    }

    /// Rewrites the config so that its one cluster admits peers at `endpoint` alone.
    fn admit(&self, endpoint: &str) {
        let (turn, health, metrics) = (self.turn, self.health, self.metrics);
        let state = match self.in_config {
            true => format!(", state_dir: \"{}\"", self.state.display()),
            false => String::new(),
        };
        let config = format!(
            "version: v1\nadmin: {{name: media/gw, healthcheck_endpoint: \"http://127.0.0.1:{health}\", \
             metrics_endpoint: \"http://127.0.0.1:{metrics}/metrics\"{state}}}\n\
             auth: {{type: static, realm: restart, credentials: {{username: alice, password: {PASSWORD}}}}}\n\
             listeners: [{{name: media/gw/udp, address: 127.0.0.1, port: {turn}, routes: [media/peers]}}]\n\
             clusters: [{{name: media/peers, endpoints: [{endpoint}]}}]\n"
        );
        std::fs::write(&self.config, config).unwrap();
    }

    fn args(&self) -> Vec<&str> {
        let state = self.state.to_str().unwrap();
        match self.in_config {
            true => vec!["-c", self.origin.as_str()],
            false => vec!["-c", self.origin.as_str(), "--state-dir", state],
        }
    }

    /// Starts stunnerd on this config and state directory and waits for `/ready` to say 200.
    fn start_ready(&self) -> Stunnerd {
        self.start_ready_with(&self.args(), &[])
    }

    /// The same with `args` and `envs` of the caller's.
    fn start_ready_with(&self, args: &[&str], envs: &[(&str, &str)]) -> Stunnerd {
        let server = Stunnerd::start(args, envs);
        assert!(self.ready(), "not ready: {}", server.logs());
        server
    }

    /// Whether `/ready` says 200 within 15 s.
    fn ready(&self) -> bool {
        let health = self.health;
        wait_until(15, || {
            http_get(health, "/ready").is_some_and(|(c, _)| c == 200)
        })
    }

    fn turn_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.turn))
    }

    /// A metric sample's value; 0 for a sample not (yet) exported.
    fn metric(&self, line_start: &str) -> f64 {
        metric(self.metrics, line_start).unwrap_or(0.0)
    }

    fn skipped(&self, reason: &str) -> f64 {
        self.metric(&format!(
            "uturn_state_records_skipped_total{{reason=\"{reason}\"}} "
        ))
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config);
    }
}

/// A state directory path that does not exist yet (stunnerd makes it), in a scratch directory.
fn fresh_state() -> PathBuf {
    temp_dir("restart").join("state")
}

/// `kill -9` the server, and reap it.
fn kill(server: &mut Stunnerd) {
    let pid = server.pid();
    server.signal(libc::SIGKILL);
    server.wait_exit_for(5.0);
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "pid {pid} outlived SIGKILL"
    );
}

/// A client of `gw` holding an allocation, a permission and a channel to `peer`, whose echo
/// comes back; and the relayed address.
fn call(gw: &Gateway, peer: &Peer) -> (TurnClient, SocketAddr) {
    let mut d = TurnClient::new(gw.turn_addr(), "alice", PASSWORD);
    let relay = d.allocate().expect("allocation");
    assert!(d.permit(peer.addr.ip()), "{:?}", d.responses);
    assert!(d.bind(peer.addr), "{:?}", d.responses);
    assert!(echoes(&mut d, peer.addr, "before", 3));
    (d, relay)
}

/// Sends `tag` to `peer` (ChannelData, once bound) up to `attempts` times; whether its echo
/// came back within a second of a send.
fn echoes(d: &mut TurnClient, peer: SocketAddr, tag: &str, attempts: u32) -> bool {
    let before = d.received.len();
    for _ in 0..attempts {
        d.send(peer, tag.as_bytes());
        for _ in 0..10 {
            d.drive(0.1);
            let received = &d.received[before..];
            if received
                .iter()
                .any(|(from, p)| *from == peer && p == tag.as_bytes())
            {
                return true;
            }
        }
    }
    false
}

/// Half an hour of client time in one-minute steps (the server keeps real time): the
/// permission (300 s), channel (600 s) and allocation (1800 s asked) refreshes all come due.
/// The responses they got.
fn refreshes(d: &mut TurnClient) -> Vec<Response> {
    let before = d.responses.len();
    for _ in 0..30 {
        d.warp(Duration::from_secs(60));
        d.drive(0.12);
    }
    d.responses[before..].to_vec()
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn file_names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// What `DIR/lock` says: the pid of the process that holds the directory.
fn lock_pid(state: &Path) -> String {
    let text = std::fs::read_to_string(state.join("lock")).unwrap_or_default();
    text.trim().to_string()
}

/// The journal that holds the allocation: the one `shard-*.journal` longer than its header.
fn holding_journal(state: &Path) -> PathBuf {
    let names = file_names(state);
    let mut holding = names
        .iter()
        .filter(|n| n.starts_with("shard-") && n.ends_with(".journal"))
        .map(|n| state.join(n))
        .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.len() > 32));
    let journal = holding
        .next()
        .unwrap_or_else(|| panic!("no entry in {names:?}"));
    assert!(holding.next().is_none(), "one allocation, one journal");
    journal
}

/// CRC-32 (IEEE, as zlib's), bit by bit.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

fn be32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes(bytes[..4].try_into().unwrap())
}

/// The byte ranges of the bodies of a journal's whole entries (after its 32-byte header).
fn entry_bodies(journal: &[u8]) -> Vec<Range<usize>> {
    let mut bodies = Vec::new();
    let mut at = 32;
    while at + 8 <= journal.len() {
        let end = at + 8 + be32(&journal[at..]) as usize;
        if end > journal.len() {
            break;
        }
        bodies.push(at + 8..end);
        at = end;
    }
    bodies
}

/// This machine's boot id, as the 16 bytes a journal header holds.
fn boot_id() -> [u8; 16] {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let hex: String = text.trim().chars().filter(|c| *c != '-').collect();
    std::array::from_fn(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
}

/// `text` holds neither the password nor the nonce key (as hex or base64).
fn assert_no_secrets(what: &str, text: &str, nonce_key: &[u8]) {
    use base64::Engine;
    let hex: String = nonce_key.iter().map(|b| format!("{b:02x}")).collect();
    let b64 = base64::engine::general_purpose::STANDARD_NO_PAD.encode(nonce_key);
    assert!(!text.contains(PASSWORD), "the password in {what}: {text}");
    assert!(
        !text.to_lowercase().contains(&hex) && !text.contains(&b64),
        "the nonce key in {what}: {text}"
    );
}

#[test]
fn a_killed_process_s_call_goes_on_in_the_next_one() {
    let state = fresh_state();
    let gw = Gateway::new(&state, "127.0.0.1");
    let peer = Peer::start();
    let mut first = gw.start_ready();
    let (mut d, relay) = call(&gw, &peer);

    // The directory and every file in it are the process's alone.
    assert_eq!(mode(&state), 0o700);
    let names = file_names(&state);
    assert!(
        names.contains("lock") && names.contains("nonce-key"),
        "{names:?}"
    );
    assert!(
        names
            .iter()
            .any(|n| n.starts_with("shard-") && n.ends_with(".journal")),
        "{names:?}"
    );
    for name in &names {
        assert_eq!(mode(&state.join(name)), 0o600, "{name}");
    }
    assert_eq!(lock_pid(&state), first.pid().to_string());
    let nonce_key = std::fs::read(state.join("nonce-key")).unwrap();
    assert_eq!(nonce_key.len(), 32);

    kill(&mut first);
    let second = gw.start_ready();
    assert_eq!(lock_pid(&state), second.pid().to_string());

    // The same client socket's next ChannelData is relayed from the same relay address, and
    // the peer's echo to that address comes back to the client.
    let before = peer.senders();
    assert!(
        echoes(&mut d, peer.addr, "after the restart", 3),
        "{}",
        second.logs()
    );
    let after = peer.senders();
    assert!(
        after.get(&relay) > before.get(&relay),
        "{before:?} → {after:?}"
    );
    assert_eq!(after.len(), 1, "a second relay address: {after:?}");
    assert!(
        wait_until(2, || gw.metric(ADOPTED) == 1.0),
        "adopted: {}",
        gw.metric(ADOPTED)
    );

    // Its next Refresh, CreatePermission and ChannelBind succeed, none told 438 (Stale Nonce):
    // the nonce outlived the process that gave it.
    let responses = refreshes(&mut d);
    assert!(
        responses.iter().any(|r| r.method == REFRESH && r.success),
        "{responses:?}"
    );
    assert!(responses.iter().all(|r| r.success), "{responses:?}");
    assert!(echoes(&mut d, peer.addr, "after the refreshes", 3));

    let status_body = http_get(gw.health, "/status").expect("/status").1;
    assert_no_secrets("the first log", &first.logs(), &nonce_key);
    assert_no_secrets("the second log", &second.logs(), &nonce_key);
    assert_no_secrets("/status", &status_body, &nonce_key);
    drop(second);
    let _ = std::fs::remove_dir_all(state.parent().unwrap());
}

#[test]
fn a_second_process_on_a_held_state_directory_is_refused() {
    let state = fresh_state();
    let gw = Gateway::new(&state, "127.0.0.1");
    let peer = Peer::start();
    let first = gw.start_ready();
    let (mut d, _relay) = call(&gw, &peer);

    let other = Gateway::new(&state, "127.0.0.1");
    let (code, text) = run_binary(
        &stunnerd_binary(),
        &other.args(),
        &[("UTURN_SHARDS", "1")],
        5.0,
    );
    assert_eq!(code, Some(1), "{text}");
    let pid = first.pid().to_string();
    assert!(
        text.lines()
            .any(|l| l.contains("state directory") && l.contains("in use by") && l.contains(&pid)),
        "no line names the state directory in use by {pid}: {text}"
    );

    // The holder is untouched: the lock still names it and its call goes on.
    assert_eq!(lock_pid(&state), pid);
    assert!(echoes(&mut d, peer.addr, "after the refusal", 3));
    drop(first);
    let _ = std::fs::remove_dir_all(state.parent().unwrap());
}

#[test]
fn two_processes_started_at_once_on_one_state_directory_one_wins_the_other_says_why() {
    let state = fresh_state();
    let (a, b) = (
        Gateway::new(&state, "127.0.0.1"),
        Gateway::new(&state, "127.0.0.1"),
    );
    let mut servers = [
        Stunnerd::start(&a.args(), &[]),
        Stunnerd::start(&b.args(), &[]),
    ];
    // Exactly one of them exits 1, saying who holds the directory; the other serves.
    let mut refused = None;
    assert!(wait_until(10, || {
        refused = servers
            .iter_mut()
            .position(|s| s.wait_exit_for(0.05).is_some());
        refused.is_some()
    }));
    let refused = refused.unwrap();
    let winner = &servers[1 - refused];
    let logs = servers[refused].logs();
    assert!(
        logs.contains("state directory")
            && logs.contains("in use by")
            && logs.contains(&winner.pid().to_string()),
        "{logs}"
    );
    assert!([&a, &b][1 - refused].ready());
    assert_eq!(lock_pid(&state), winner.pid().to_string());
    drop(servers);
    let _ = std::fs::remove_dir_all(state.parent().unwrap());
}

/// Makes a call, kills the server, applies `damage` to the journal that holds the call (with
/// the byte ranges of its entries' bodies) and starts the server again: the call goes on.
/// The entries skipped: (corrupt, torn).
fn restart_after_damage(damage: impl FnOnce(&mut Vec<u8>, &[Range<usize>])) -> (f64, f64) {
    let state = fresh_state();
    let gw = Gateway::new(&state, "127.0.0.1");
    let peer = Peer::start();
    let mut first = gw.start_ready();
    let (mut d, _relay) = call(&gw, &peer);
    kill(&mut first);

    let journal = holding_journal(&state);
    let mut bytes = std::fs::read(&journal).unwrap();
    assert_eq!(&bytes[..8], b"uturnAJ\n");
    assert_eq!(be32(&bytes[8..]), 1, "format version");
    assert_eq!(be32(&bytes[28..]), crc32(&bytes[..28]), "header checksum");
    let bodies = entry_bodies(&bytes);
    assert_eq!(
        bodies.last().map(|b| b.end),
        Some(bytes.len()),
        "{bodies:?}"
    );
    damage(&mut bytes, &bodies);
    std::fs::write(&journal, &bytes).unwrap();

    let second = gw.start_ready();
    assert_eq!(gw.metric(ADOPTED), 1.0, "{}", second.logs());
    assert!(echoes(&mut d, peer.addr, "after the restart", 3));
    let skipped = (gw.skipped("corrupt"), gw.skipped("torn"));
    drop(second);
    let _ = std::fs::remove_dir_all(state.parent().unwrap());
    skipped
}

#[test]
fn corrupt_and_torn_journal_entries_cost_only_themselves() {
    // Allocate, CreatePermission and ChannelBind each put the whole record, so a bit flipped
    // in the first entry costs a record that a later one replaces; and garbage after the last.
    let (corrupt, torn) = restart_after_damage(|bytes, bodies| {
        assert!(bodies.len() >= 2, "{bodies:?}");
        bytes[(bodies[0].start + bodies[0].end) / 2] ^= 0x40;
        bytes.extend_from_slice(&[0xAB; 40]);
    });
    assert!(
        corrupt >= 1.0 && corrupt + torn >= 2.0,
        "corrupt {corrupt}, torn {torn}"
    );

    // A write the kill cut short: the last entry again, without its last byte.
    let (corrupt, torn) = restart_after_damage(|bytes, bodies| {
        let last = bodies.last().unwrap();
        let cut = bytes[last.start - 8..last.end - 1].to_vec();
        bytes.extend_from_slice(&cut);
    });
    assert_eq!((corrupt, torn), (0.0, 1.0));
}

#[test]
fn a_journal_of_an_unknown_format_version_is_left_unread() {
    let state = fresh_state();
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&state)
        .unwrap();
    let mut header = b"uturnAJ\n".to_vec();
    header.extend_from_slice(&99u32.to_be_bytes());
    header.extend_from_slice(&boot_id());
    header.extend_from_slice(&crc32(&header).to_be_bytes());
    let journal = state.join("shard-0.journal");
    let mut file = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(&journal)
        .unwrap();
    std::io::Write::write_all(&mut file, &header).unwrap();
    drop(file);

    let gw = Gateway::new(&state, "127.0.0.1");
    let server = gw.start_ready();
    assert!(
        wait_until(2, || gw.skipped("version") == 1.0),
        "version: {}; {}",
        gw.skipped("version"),
        server.logs()
    );
    assert_eq!(gw.metric(ADOPTED), 0.0);
    assert_eq!(status(gw.health).expect("/status")["allocationCount"], 0);
    drop(server);
    let _ = std::fs::remove_dir_all(state.parent().unwrap());
}

#[test]
fn a_restart_under_a_config_that_no_longer_admits_the_peer_keeps_the_allocation_not_the_channel() {
    let state = fresh_state();
    let gw = Gateway::new(&state, "127.0.0.1");
    let peer = Peer::start();
    let mut first = gw.start_ready();
    let (mut d, _relay) = call(&gw, &peer);
    kill(&mut first);

    gw.admit("127.0.0.3");
    let second = gw.start_ready();
    assert_eq!(gw.metric(ADOPTED), 1.0, "{}", second.logs());
    let seen = peer.counts()[0];
    assert!(!echoes(
        &mut d,
        peer.addr,
        "to a peer no longer admitted",
        1
    ));
    assert_eq!(
        peer.counts()[0],
        seen,
        "relayed to a peer the config no longer admits"
    );

    let responses = refreshes(&mut d);
    assert!(
        responses.iter().any(|r| r.method == REFRESH && r.success),
        "{responses:?}"
    );
    drop(second);
    let _ = std::fs::remove_dir_all(state.parent().unwrap());
}

#[test]
fn the_journal_stays_bounded_however_many_requests_and_reads_back_whole() {
    let state = fresh_state();
    let gw = Gateway::new(&state, "127.0.0.1");
    let mut first = gw.start_ready();
    let mut client = BenchClient::allocate(gw.turn_addr(), "alice", PASSWORD).unwrap();
    // 4000 Refreshes: a Put of ~190 bytes each, 760 kB if the journal were never rewritten.
    for _ in 0..4000 {
        client.refresh(600).unwrap();
    }
    let journal = holding_journal(&state);
    let len = std::fs::metadata(&journal).unwrap().len();
    assert!(len < 300 << 10, "{} is {len} bytes", journal.display());
    kill(&mut first);
    let second = gw.start_ready();
    assert_eq!(gw.metric(ADOPTED), 1.0, "{}", second.logs());
    assert_eq!(gw.skipped("corrupt") + gw.skipped("torn"), 0.0);
    client.refresh(600).unwrap();
    drop(second);
    let _ = std::fs::remove_dir_all(state.parent().unwrap());
}

#[test]
fn a_state_directory_named_by_the_config_keeps_the_call_as_the_flag_does() {
    let state = fresh_state();
    let gw = Gateway::new(&state, "127.0.0.1").named_in_config("127.0.0.1");
    let peer = Peer::start();
    let mut first = gw.start_ready();
    let (mut d, _relay) = call(&gw, &peer);
    assert_eq!(lock_pid(&state), first.pid().to_string());
    kill(&mut first);
    let second = gw.start_ready();
    assert_eq!(gw.metric(ADOPTED), 1.0, "{}", second.logs());
    assert!(echoes(&mut d, peer.addr, "after the restart", 3));
    // stunnerd's /status shows no field of uturn's.
    let shown = status(gw.health).unwrap().to_string();
    assert!(!shown.contains("state_dir"), "{shown}");
    drop(second);
    let _ = std::fs::remove_dir_all(state.parent().unwrap());
}

#[test]
fn a_restart_on_another_shard_layout_carries_every_call_to_the_shard_its_client_reaches() {
    let state = fresh_state();
    let gw = Gateway::new(&state, "127.0.0.1");
    let peer = Peer::start();
    let mut first = gw.start_ready();
    let mut clients: Vec<TurnClient> = (0..8).map(|_| call(&gw, &peer).0).collect();
    kill(&mut first);
    // Two shards, each with a socket of the listener: the kernel's hash sends each client to
    // one of them, which the journal of the one-shard process could not know.
    let mut args = gw.args();
    args.push("--udp-thread-num=2");
    let second = gw.start_ready_with(&args, &[("UTURN_SHARDS", "2")]);
    let logs = second.logs();
    assert!(
        logs.contains(
            "the last process ran \"shards 1 sockets 1\", this one \"shards 2 sockets 2\""
        ),
        "{logs}"
    );
    for (i, client) in clients.iter_mut().enumerate() {
        assert!(
            echoes(
                client,
                peer.addr,
                &format!("client {i} after the restart"),
                3
            ),
            "{}",
            second.logs()
        );
    }
    assert_eq!(gw.metric(ADOPTED), 8.0, "{}", second.logs());
    // Every allocation is placed: what waited is gone from the directory, and the next
    // process (the same layout) carries them all from the shards' journals.
    assert!(!state.join("unplaced.journal").exists());
    drop(second);
    let third = gw.start_ready_with(&args, &[("UTURN_SHARDS", "2")]);
    assert!(
        !third.logs().contains("the last process ran"),
        "{}",
        third.logs()
    );
    assert_eq!(gw.metric(ADOPTED), 8.0, "{}", third.logs());
    for client in clients.iter_mut() {
        assert!(echoes(client, peer.addr, "after the third start", 3));
    }
    drop(third);
    let _ = std::fs::remove_dir_all(state.parent().unwrap());
}
