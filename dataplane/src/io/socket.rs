//! Socket construction: SO_REUSEPORT listener sockets on the dual-stack wildcard (or a
//! listener's bind address) and relay sockets on the wildcard of one family, plus address
//! canonicalisation for dual-stack sockets.

use super::sys;
use crate::proto::{Family, RelayRequest};
use socket2::{Domain, Protocol, Socket, Type};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Receive/send buffer size asked for on every socket (the kernel may clamp it).
const SOCKET_BUFFER_BYTES: usize = 4 << 20;

/// A bound, non-blocking UDP socket for a TURN-UDP listener on `port` of `bind`, or, with no
/// bind address, `[::]:port` dual-stack when the host has IPv6, else `0.0.0.0:port`; always
/// SO_REUSEPORT so several shards share it.
pub fn listener_socket(bind: Option<IpAddr>, port: u16) -> io::Result<Socket> {
    if let Some(ip) = bind {
        return bind_udp(SocketAddr::new(ip, port), true, None);
    }
    match bind_udp(
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
        true,
        Some(false),
    ) {
        Ok(socket) => Ok(socket),
        Err(_) => bind_udp(
            SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
            true,
            None,
        ),
    }
}

/// A bound, listening, non-blocking TCP socket for a TURN-TCP or TURN-TLS listener on `port`
/// of `bind`, or, with no bind address, dual-stack `[::]:port` where the host has IPv6, else
/// `0.0.0.0:port`; SO_REUSEPORT, so every shard accepts on its own socket and the kernel
/// spreads connections over them.
pub fn stream_listener_socket(bind: Option<IpAddr>, port: u16) -> io::Result<Socket> {
    let open = |addr: SocketAddr| -> io::Result<Socket> {
        let domain = if addr.is_ipv4() {
            Domain::IPV4
        } else {
            Domain::IPV6
        };
        let socket = Socket::new(domain, Type::STREAM, Some(Protocol::TCP))?;
        if addr.is_ipv6() && addr.ip().is_unspecified() {
            socket.set_only_v6(false)?;
        }
        socket.set_reuse_address(true)?;
        socket.set_reuse_port(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        Ok(socket)
    };
    if let Some(ip) = bind {
        return open(SocketAddr::new(ip, port));
    }
    open(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port))
        .or_else(|_| open(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)))
}

/// Makes an accepted TCP connection ready for the shard: non-blocking, no Nagle delay (media
/// frames go out as they come).
pub fn prepare_stream(socket: &Socket) -> io::Result<()> {
    socket.set_nonblocking(true)?;
    socket.set_nodelay(true)?;
    Ok(())
}

/// A relay socket of `family` as `request` asks: wildcard of that family (IPv6 only on an
/// IPv6 socket), kernel-chosen port (even if asked), no fragmentation when asked (DF on IPv4,
/// no source fragmentation on IPv6).
pub fn relay_socket(family: Family, request: &RelayRequest) -> io::Result<(Socket, u16)> {
    let wildcard = match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Family::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    // EVEN-PORT: keep trying ephemeral ports until the kernel hands out an even one.
    for _ in 0..32 {
        let socket = bind_udp(SocketAddr::new(wildcard, 0), false, Some(true))?;
        let port = socket
            .local_addr()?
            .as_socket()
            .map(|a| a.port())
            .unwrap_or(0);
        if request.even_port && port % 2 == 1 {
            continue;
        }
        if request.dont_fragment {
            set_dont_fragment(&socket, family)?;
        }
        return Ok((socket, port));
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        "no even relay port found in 32 tries",
    ))
}

/// A relay socket of `family` on `port` (a restart re-binding the port an allocation's client
/// and peers know), DF as the allocation asked.
pub fn relay_socket_at(family: Family, port: u16, dont_fragment: bool) -> io::Result<Socket> {
    let wildcard = match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Family::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let socket = bind_udp(SocketAddr::new(wildcard, port), false, Some(true))?;
    if dont_fragment {
        set_dont_fragment(&socket, family)?;
    }
    Ok(socket)
}

fn bind_udp(addr: SocketAddr, reuse_port: bool, v6_only: Option<bool>) -> io::Result<Socket> {
    let domain = if addr.is_ipv4() {
        Domain::IPV4
    } else {
        Domain::IPV6
    };
    let socket = Socket::new(domain, Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6() {
        if let Some(only) = v6_only {
            socket.set_only_v6(only)?;
        }
    }
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    // Best effort: a small rmem_max only means more drops under bursts.
    let _ = socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = socket.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(socket)
}

/// RFC 8656 §7.2 and §14: DONT-FRAGMENT asks that relayed datagrams not be fragmented. IPv4: the
/// DF bit on every datagram (path MTU discovery "do"). IPv6 routers never fragment, but the
/// sending host does unless IPV6_DONTFRAG is set (RFC 3542 §11.2): with it a datagram too large
/// for the path fails with EMSGSIZE instead of leaving in fragments.
fn set_dont_fragment(socket: &Socket, family: Family) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let (level, name, value) = match family {
        Family::V4 => (
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        ),
        Family::V6 => (libc::IPPROTO_IPV6, libc::IPV6_DONTFRAG, 1),
    };
    sys::set_int_option(socket.as_raw_fd(), level, name, value)
}

/// The address as a client sees it: IPv4-mapped IPv6 (from a dual-stack socket) becomes IPv4.
pub fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => addr,
        },
        v4 => v4,
    }
}

/// The destination to pass to a socket bound on `local`: IPv4 becomes IPv4-mapped on IPv6
/// sockets.
pub fn for_socket(local: SocketAddr, dest: SocketAddr) -> SocketAddr {
    match (local, dest) {
        (SocketAddr::V6(_), SocketAddr::V4(v4)) => {
            SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port())
        }
        _ => dest,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::RelayId;
    use std::os::fd::AsRawFd;

    fn option(socket: &Socket, level: libc::c_int, name: libc::c_int) -> libc::c_int {
        let mut value: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a valid fd, and a c_int buffer with its length.
        let rc = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                level,
                name,
                (&mut value as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "getsockopt: {}", io::Error::last_os_error());
        value
    }

    /// DONT-FRAGMENT reaches the kernel for both families, and only when asked.
    #[test]
    fn dont_fragment_is_set_on_ipv4_and_ipv6_relays() {
        for dont_fragment in [false, true] {
            for family in [Family::V4, Family::V6] {
                let request = RelayRequest {
                    relay: RelayId(0),
                    family: Family::V4,
                    additional: Some(RelayId(1)),
                    even_port: false,
                    dont_fragment,
                };
                let (socket, _) = relay_socket(family, &request).expect("relay socket");
                let (got, want) = match family {
                    Family::V4 => (
                        option(&socket, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER),
                        if dont_fragment {
                            libc::IP_PMTUDISC_DO
                        } else {
                            option(
                                &bind_udp("0.0.0.0:0".parse().unwrap(), false, None).unwrap(),
                                libc::IPPROTO_IP,
                                libc::IP_MTU_DISCOVER,
                            )
                        },
                    ),
                    Family::V6 => (
                        option(&socket, libc::IPPROTO_IPV6, libc::IPV6_DONTFRAG),
                        i32::from(dont_fragment),
                    ),
                };
                assert_eq!(got, want, "{family:?}, DONT-FRAGMENT {dont_fragment}");
            }
        }
    }
}
