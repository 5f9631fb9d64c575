//! Ports for servers started by tests and benchmarks, handed out so that no two callers in a
//! process get the same one and none is a port the kernel may pick on its own.
//!
//! Asking the kernel for a free port (bind to port 0, read it, close) races: the port goes
//! back to the ephemeral pool, where a relay or client socket opened a moment later, or a
//! second caller doing the same, can take it. Two stunnerd processes that both bind it with
//! SO_REUSEPORT then share it silently and the kernel spreads one client's packets over both.
//! The ports here come from beside the ephemeral range instead, in a sequence that starts at
//! an offset drawn from the process id, and each one is probed free for UDP and TCP on the
//! wildcard address before it is handed out. They step by two, and the port above each is
//! free too and never handed out: coturn's `turnutils_peer -p P` also binds P+1, and a test's
//! stunnerd given that port would share it with the peer, which echoes what it receives.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, UdpSocket};
use std::sync::atomic::{AtomicU32, Ordering};

/// The lowest port handed out.
const FIRST: u16 = 10_000;

/// The kernel's ephemeral range (`net.ipv4.ip_local_port_range`), Linux's default if it cannot
/// be read.
fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut bounds = s.split_whitespace().map(|b| b.parse::<u16>().ok());
            Some((bounds.next()??, bounds.next()??))
        })
        .unwrap_or((32_768, 60_999))
}

/// The ports handed out, `start..end`: the larger gap beside the ephemeral range (from 10000),
/// or 10000..32768 on a host whose ephemeral range leaves no room (the probe still skips ports
/// in use).
fn range() -> (u16, u16) {
    let (low, high) = ephemeral_range();
    range_beside(low, high)
}

/// [`range`] for the ephemeral range `low..=high`.
fn range_beside(low: u16, high: u16) -> (u16, u16) {
    let below = (FIRST, low.max(FIRST));
    let above = (high.saturating_add(1).max(FIRST), u16::MAX);
    let size = |(start, end): (u16, u16)| end.saturating_sub(start);
    let gap = if size(below) >= size(above) {
        below
    } else {
        above
    };
    if size(gap) >= 2_000 {
        gap
    } else {
        (FIRST, 32_768)
    }
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

/// A port free for UDP and TCP, with the port above it free too and never handed out, itself
/// never handed out before by this process.
///
/// # Panics
/// If every such pair in the range this process hands out is taken.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let (start, end) = range();
    let pairs = u32::from(end - start) / 2;
    let offset = std::process::id().wrapping_mul(2_654_435_761) % pairs;
    for _ in 0..pairs {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = start + 2 * ((offset + n) % pairs) as u16;
        if is_free(port) && is_free(port + 1) {
            return port;
        }
    }
    panic!("no pair of ports free for UDP and TCP in {start}..{end}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_below_the_ephemeral_range_and_free() {
        let (start, end) = range();
        let (low, high) = ephemeral_range();
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "a port was handed out twice");
        for port in ports {
            assert!(
                (start..end).contains(&port),
                "{port} is outside {start}..{end}"
            );
            if end - start > 2_000 && (start, end) != (FIRST, 32_768) {
                assert!(!(low..=high).contains(&port), "{port} is ephemeral");
            }
            assert_eq!((port - start) % 2, 0, "{port} is out of step");
            assert!(is_free(port) && is_free(port + 1));
        }
    }

    #[test]
    fn ports_come_from_the_larger_gap_beside_the_ephemeral_range() {
        assert_eq!(range_beside(32_768, 60_999), (10_000, 32_768));
        assert_eq!(range_beside(40_000, 50_000), (10_000, 40_000));
        assert_eq!(range_beside(10_000, 30_000), (30_001, 65_535));
        // No room on either side: the probe alone keeps clear of ports in use.
        assert_eq!(range_beside(1_024, 65_535), (10_000, 32_768));
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
