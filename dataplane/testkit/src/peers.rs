//! The media side of a relay test: a UDP echo peer that counts what it receives and sends
//! and remembers who sent it (a client's relay address, so a client whose allocation was
//! lost and made again shows up under a second address).

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

#[derive(Default)]
struct Tally {
    /// (received packets, received bytes, sent packets, sent bytes).
    counts: [u64; 4],
    /// Datagrams received, by sender.
    senders: HashMap<SocketAddr, u64>,
}

/// An echo peer; it stops (and its thread ends) when dropped.
pub struct Peer {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
    thread: Option<JoinHandle<()>>,
}

impl Peer {
    /// A peer on 127.0.0.1.
    pub fn start() -> Peer {
        Peer::on("127.0.0.1")
    }

    /// A peer on `ip`.
    pub fn on(ip: &str) -> Peer {
        let socket = UdpSocket::bind((ip, 0)).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let addr = socket.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Mutex::new(Tally::default()));
        let (stopped, counted) = (stop.clone(), tally.clone());
        let thread = std::thread::spawn(move || {
            // Room for the largest UDP datagram, so large relayed payloads come back whole.
            let mut buf = vec![0u8; 65_536];
            while !stopped.load(Ordering::Relaxed) {
                if let Ok((n, from)) = socket.recv_from(&mut buf) {
                    let mut tally = counted.lock().unwrap();
                    tally.counts[0] += 1;
                    tally.counts[1] += n as u64;
                    *tally.senders.entry(from).or_insert(0) += 1;
                    if socket.send_to(&buf[..n], from).is_ok() {
                        tally.counts[2] += 1;
                        tally.counts[3] += n as u64;
                    }
                }
            }
        });
        Peer {
            addr,
            stop,
            tally,
            thread: Some(thread),
        }
    }

    /// (received packets, received bytes, sent packets, sent bytes).
    pub fn counts(&self) -> [u64; 4] {
        self.tally.lock().unwrap().counts
    }

    /// Datagrams received, by sender.
    pub fn senders(&self) -> HashMap<SocketAddr, u64> {
        self.tally.lock().unwrap().senders.clone()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A UDP echo peer (python3) on `ip:port` inside network namespace `netns` (a test's own),
/// killed when the returned guard drops.
pub fn echo_peer_in_netns(netns: &str, ip: std::net::IpAddr, port: u16) -> crate::stunnerd::Killed {
    let script = format!(
        "import socket\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         s.bind(('{ip}', {port}))\n\
         while True:\n    data, source = s.recvfrom(65535)\n    s.sendto(data, source)\n"
    );
    let child = std::process::Command::new("ip")
        .args(["netns", "exec", netns, "python3", "-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("ip netns exec … python3");
    crate::stunnerd::Killed(child)
}

/// SIGKILLs every process left in network namespace `netns` (a test's own, so only its
/// processes can be there), so that none keeps the namespace alive once it is deleted.
pub fn kill_netns_processes(netns: &str) {
    let Ok(out) = std::process::Command::new("ip")
        .args(["netns", "pids", netns])
        .output()
    else {
        return;
    };
    for pid in String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
    {
        // SAFETY: kill(2) on a process in a namespace the calling test made.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

/// coturn's echo peer (`turnutils_peer`) on `ip:port`, killed when the returned guard drops.
pub fn turnutils_peer(ip: &str, port: u16) -> crate::stunnerd::Killed {
    let child = std::process::Command::new("turnutils_peer")
        .args(["-p", &port.to_string(), "-L", ip])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("turnutils_peer (apt-get install coturn)");
    crate::stunnerd::Killed(child)
}
