//! Ports for servers started by tests and benchmarks, handed out so that no two callers in a
//! process get the same one and none is a port the kernel may pick on its own.
//!
//! Asking the kernel for a free port (bind to port 0, read it, close) races: the port goes
//! back to the ephemeral pool, where a relay or client socket opened a moment later, or a
//! second caller doing the same, can take it. Two stunnerd processes that both bind it with
//! SO_REUSEPORT then share it silently and the kernel spreads one client's packets over both.
//! The ports here come from below the ephemeral range instead, in a sequence that starts at
//! an offset drawn from the process id, and each one is probed free for UDP and TCP on the
//! wildcard address before it is handed out. They are even, and the odd port above each is
//! free too and never handed out: coturn's `turnutils_peer -p P` also binds P+1, and a test's
//! stunnerd given that port would share it with the peer, which echoes what it receives.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, UdpSocket};
use std::sync::atomic::{AtomicU32, Ordering};

/// The lowest port handed out.
const FIRST: u16 = 10_000;

/// Where the kernel's ephemeral range starts (`net.ipv4.ip_local_port_range`), 32768 if it
/// cannot be read.
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// Whether `port` can be bound for both UDP and TCP on the wildcard address (both families
/// where the host has IPv6), which is how stunnerd binds its listeners.
fn is_free(port: u16) -> bool {
    let any6 = SocketAddr::from((Ipv6Addr::UNSPECIFIED, port));
    let any4 = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
    let udp = UdpSocket::bind(any6).or_else(|_| UdpSocket::bind(any4));
    let tcp = TcpListener::bind(any6).or_else(|_| TcpListener::bind(any4));
    udp.is_ok() && tcp.is_ok()
}

/// An even port free for UDP and TCP, with the port above it free too, never handed out
/// before by this process.
///
/// # Panics
/// If every such pair between 10000 and the start of the ephemeral range is taken.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let end = ephemeral_start();
    if end <= FIRST + 1_000 {
        // An unusual host whose ephemeral range covers the low ports: fall back to the kernel.
        return kernel_port();
    }
    let pairs = u32::from(end - FIRST) / 2;
    let offset = std::process::id().wrapping_mul(2_654_435_761) % pairs;
    for _ in 0..pairs {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = FIRST + 2 * ((offset + n) % pairs) as u16;
        if is_free(port) && is_free(port + 1) {
            return port;
        }
    }
    panic!("no pair of ports free for UDP and TCP between {FIRST} and {end}");
}

/// A port the kernel picked for UDP that is also free for TCP.
fn kernel_port() -> u16 {
    for _ in 0..100 {
        let udp = UdpSocket::bind("127.0.0.1:0").expect("bind a UDP port on loopback");
        let port = udp
            .local_addr()
            .expect("a bound socket has an address")
            .port();
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no loopback port free for both UDP and TCP in 100 tries");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_below_the_ephemeral_range_and_free() {
        let end = ephemeral_start();
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "a port was handed out twice");
        for port in ports {
            assert!(
                (FIRST..end).contains(&port),
                "{port} is outside {FIRST}..{end}"
            );
            assert_eq!(port % 2, 0, "{port} is odd");
            assert!(is_free(port) && is_free(port + 1));
        }
    }

    #[test]
    fn a_port_bound_for_udp_or_tcp_is_not_free() {
        let port = free_port();
        let udp = UdpSocket::bind(("127.0.0.1", port)).unwrap();
        assert!(!is_free(port), "UDP on 127.0.0.1:{port} is taken");
        drop(udp);
        let tcp = TcpListener::bind(("127.0.0.1", port)).unwrap();
        assert!(!is_free(port), "TCP on 127.0.0.1:{port} is taken");
        drop(tcp);
        assert!(is_free(port));
    }
}
