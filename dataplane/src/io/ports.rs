//! Who else serves a port. Listener sockets are SO_REUSEPORT, so a second process of the same
//! user that binds a port this one serves joins its group and the kernel hands it a share of
//! the clients; and a process that holds the port first would take a share of ours. Before a
//! listener opens a port, [`foreign_holders`] looks for sockets on it that are not this
//! process's: the kernel's socket tables (`/proc/net/{udp,udp6,tcp,tcp6}`) give the inode of
//! every socket bound to the port, and `/proc/self/fd` the inodes of ours.

use std::collections::HashSet;
use std::fmt;
use std::io;
use uturn_shared::config::ListenerProtocol;

/// The kernel protocol a listener's port is bound in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PortProtocol {
    /// TURN-UDP and TURN-DTLS listeners.
    Udp,
    /// TURN-TCP and TURN-TLS listeners.
    Tcp,
}

impl PortProtocol {
    /// Where a listener of `protocol` binds its port; `None` for protocols that are not
    /// served (only the `TURN-*` ones are).
    pub fn of(protocol: ListenerProtocol) -> Option<PortProtocol> {
        match (protocol.is_turn(), protocol.is_datagram()) {
            (false, _) => None,
            (true, true) => Some(PortProtocol::Udp),
            (true, false) => Some(PortProtocol::Tcp),
        }
    }

    /// `udp` or `tcp`, as in `3478/udp`.
    pub fn as_str(self) -> &'static str {
        match self {
            PortProtocol::Udp => "udp",
            PortProtocol::Tcp => "tcp",
        }
    }

    fn tables(self) -> [&'static str; 2] {
        match self {
            PortProtocol::Udp => ["/proc/net/udp", "/proc/net/udp6"],
            PortProtocol::Tcp => ["/proc/net/tcp", "/proc/net/tcp6"],
        }
    }

    /// The socket state that receives new clients: an unconnected UDP socket (`07`, CLOSE;
    /// a connected one only gets its own peer's datagrams) or a listening TCP socket (`0A`).
    fn serving_state(self) -> &'static str {
        match self {
            PortProtocol::Udp => "07",
            PortProtocol::Tcp => "0A",
        }
    }
}

/// A socket of another process on a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The socket's inode.
    pub inode: u64,
    /// The process that has it open and its command name, where `/proc` lets us see it.
    pub process: Option<(u32, String)>,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.process {
            Some((pid, command)) => write!(f, "pid {pid}, {command}"),
            None => write!(f, "socket inode {} (owner not visible)", self.inode),
        }
    }
}

/// The sockets of other processes that serve `port` in `protocol`, whatever their address
/// (our listeners bind the wildcard, so any address on the port overlaps them).
pub fn foreign_holders(protocol: PortProtocol, port: u16) -> io::Result<Vec<Holder>> {
    // Our descriptors are read only if something is bound to the port (a gateway holds one
    // per allocation), between two reads of the tables: a socket of ours opened meanwhile is
    // among them, one closed meanwhile is gone from the second read.
    let first = bound_on(protocol, port)?;
    if first.is_empty() {
        return Ok(Vec::new());
    }
    let ours = socket_inodes_of("self")?;
    let second = bound_on(protocol, port)?;
    let foreign: Vec<u64> = first
        .into_iter()
        .filter(|inode| second.contains(inode) && !ours.contains(inode))
        .collect();
    if foreign.is_empty() {
        return Ok(Vec::new());
    }
    let owners = socket_owners(&foreign);
    Ok(foreign
        .into_iter()
        .map(|inode| Holder {
            inode,
            process: owners
                .iter()
                .find(|(owned, _)| *owned == inode)
                .map(|(_, process)| process.clone()),
        })
        .collect())
}

/// The inodes of the sockets serving `port` in `protocol`, both address families.
fn bound_on(protocol: PortProtocol, port: u16) -> io::Result<Vec<u64>> {
    let mut bound = Vec::new();
    for table in protocol.tables() {
        match std::fs::read_to_string(table) {
            Ok(text) => bound.extend(bound_inodes(&text, port, protocol.serving_state())),
            // No IPv6 on this host.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(bound)
}

/// The inodes of the sockets in a `/proc/net/{udp,tcp}[6]` table bound to `port` in `state`
/// (inode 0, a socket on its way out, is skipped).
fn bound_inodes(table: &str, port: u16, state: &str) -> Vec<u64> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode …
            let local = fields.get(1)?;
            let (_, hex_port) = local.rsplit_once(':')?;
            let bound_port = u16::from_str_radix(hex_port, 16).ok()?;
            let inode: u64 = fields.get(9)?.parse().ok()?;
            (bound_port == port && fields.get(3)?.eq_ignore_ascii_case(state) && inode != 0)
                .then_some(inode)
        })
        .collect()
}

/// The socket inodes among the open file descriptors of process `pid` (`self` for ours).
fn socket_inodes_of(pid: &str) -> io::Result<HashSet<u64>> {
    let mut inodes = HashSet::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(target) = std::fs::read_link(entry?.path()) else {
            // Closed since the directory was read.
            continue;
        };
        if let Some(inode) = socket_inode(&target.to_string_lossy()) {
            inodes.insert(inode);
        }
    }
    Ok(inodes)
}

/// `socket:[12345]` → 12345.
fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// Which visible processes hold which of `inodes`: (inode, (pid, command)). Best effort: the
/// fds of another user's processes are not readable.
fn socket_owners(inodes: &[u64]) -> Vec<(u64, (u32, String))> {
    let mut owners = Vec::new();
    let Ok(processes) = std::fs::read_dir("/proc") else {
        return owners;
    };
    for process in processes.flatten() {
        let name = process.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(held) = socket_inodes_of(&pid.to_string()) else {
            continue;
        };
        for &inode in inodes.iter().filter(|inode| held.contains(inode)) {
            let command = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|c| c.trim().to_string())
                .unwrap_or_default();
            owners.push((inode, (pid, command)));
        }
    }
    owners
}

#[cfg(test)]
mod tests {
    use super::*;
    use socket2::{Domain, Socket, Type};

    const TABLE: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
 1: 0100007F:0D96 00000000:0000 07 00000000:00000000 00:00000000 00000000  1000        0 4242 2 0000000000000000 0
 2: 0100007F:0D96 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 4343 2 0000000000000000 0
 3: 00000000:0D97 00000000:0000 07 00000000:00000000 00:00000000 00000000  1000        0 4444 2 0000000000000000 0
 4: 00000000:0D96 00000000:0000 07 00000000:00000000 00:00000000 00000000  1000        0 0 2 0000000000000000 0
";

    #[test]
    fn a_table_gives_the_serving_sockets_on_the_port() {
        // 0x0D96 = 3478: the unconnected socket, not the connected one, another port's, or a
        // dying one (inode 0).
        assert_eq!(bound_inodes(TABLE, 3478, "07"), vec![4242]);
        assert_eq!(bound_inodes(TABLE, 3479, "07"), vec![4444]);
        assert_eq!(socket_inode("socket:[99]"), Some(99));
        assert_eq!(socket_inode("pipe:[99]"), None);
    }

    fn reuseport_udp(port: u16) -> Socket {
        let socket = Socket::new(Domain::IPV4, Type::DGRAM, None).unwrap();
        socket.set_reuse_port(true).unwrap();
        socket
            .bind(&std::net::SocketAddr::from(([127, 0, 0, 1], port)).into())
            .unwrap();
        socket
    }

    #[test]
    fn our_own_sockets_are_not_foreign() {
        let socket = reuseport_udp(0);
        let port = socket.local_addr().unwrap().as_socket().unwrap().port();
        assert_eq!(foreign_holders(PortProtocol::Udp, port).unwrap(), vec![]);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert_eq!(foreign_holders(PortProtocol::Tcp, port).unwrap(), vec![]);
    }
}
