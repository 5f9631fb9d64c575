//! How this host reaches an address, as its routing tables say: a small synchronous rtnetlink
//! (`NETLINK_ROUTE`) client for the shard threads, and a time-passed-in cache of its answers.
//!
//! [`Netlink::route`] asks what `ip route get ADDR` asks (`RTM_GETROUTE` for one address), so
//! the answer is the kernel's own: policy routing, every table, the local table included. An
//! address is this host's own when that answer is a route of type `RTN_LOCAL`, never because
//! `bind()` accepts it (with `net.ipv4.ip_nonlocal_bind=1` it accepts any address).
//! [`Netlink::neighbour`] (`RTM_GETNEIGH`) and [`Netlink::link_mac`] (`RTM_GETLINK`) give the
//! link-layer addresses the XDP path writes into the frames it sends.
//!
//! Every exchange is bounded: the socket has a receive timeout, a reply must carry the sequence
//! number of the request it answers (a late reply to an earlier request that timed out is
//! skipped), and a reply the parser cannot read is an error, never a panic. Of each reply only
//! the attributes used here are decoded, so an attribute this crate version cannot decode (a
//! newer kernel's, or a tunnel encapsulation's) does not fail the answer.

use netlink_packet_core::{
    ErrorBuffer, NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload, NlaBuffer,
    NlasIterator, ParseableParametrized, NLMSG_DONE, NLMSG_ERROR, NLMSG_NOOP, NLMSG_OVERRUN,
    NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_route::link::{LinkAttribute, LinkExtentMask, LinkHeader, LinkMessage};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourHeader, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteLwEnCapType, RouteMessage, RouteType, RouteVia,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use std::io;
use std::net::IpAddr;
use std::time::{Duration, Instant};

mod cache;
#[cfg(test)]
mod tests;

pub(crate) use cache::RouteCache;

/// How long one exchange waits for each datagram of its reply.
const TIMEOUT: Duration = Duration::from_millis(100);

/// The receive buffer: larger than any datagram the kernel sends a socket (it caps a dump's at
/// 32 KiB), so a reply is never cut.
const BUFFER: usize = 64 * 1024;

/// The fixed headers of the messages (`struct rtmsg`, `ndmsg`, `ifinfomsg`), before their
/// attributes.
const RTMSG_LEN: usize = 12;
const NDMSG_LEN: usize = 12;
const IFINFOMSG_LEN: usize = 16;

/// The attributes read here (`linux/rtnetlink.h`, `linux/neighbour.h`, `linux/if_link.h`).
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_PREFSRC: u16 = 7;
const RTA_VIA: u16 = 18;
const NDA_DST: u16 = 1;
const NDA_LLADDR: u16 = 2;
const IFLA_ADDRESS: u16 = 1;

/// The errors with which `RTM_GETROUTE` says there is no usable route: no route at all or a
/// `throw` (ENETUNREACH), `unreachable` (EHOSTUNREACH), `prohibit` (EACCES), `blackhole`
/// (EINVAL: the request is well formed, so that is what it means here).
const NO_ROUTE: [i32; 4] = [
    libc::ENETUNREACH,
    libc::EHOSTUNREACH,
    libc::EACCES,
    libc::EINVAL,
];

/// How this host reaches an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Route {
    /// The source address a socket bound to the wildcard sends from (RTA_PREFSRC, or the
    /// address itself for a local route).
    pub source: IpAddr,
    /// The output interface (RTA_OIF). A local address's is the loopback's.
    pub ifindex: u32,
    /// The next hop, if the route has a gateway (RTA_GATEWAY, or RTA_VIA for an IPv4 route
    /// through an IPv6 next hop, so not always of `to`'s family).
    pub gateway: Option<IpAddr>,
    /// The route is of type RTN_LOCAL: the address is one of this host's own.
    pub local: bool,
}

/// A rtnetlink socket of the calling thread's network namespace, reused for every request.
pub(crate) struct Netlink {
    socket: Socket,
    /// The port id the kernel gave the socket: the one its replies are addressed to.
    port: u32,
    /// The sequence number of the last request sent.
    seq: u32,
    /// How long an exchange waits for each datagram.
    timeout: Duration,
    buffer: Vec<u8>,
}

/// What an exchange found out: the kernel's error (a positive errno) if it refused the request.
type Answer = Result<(), i32>;

impl Netlink {
    /// A socket of the calling thread's network namespace.
    pub(crate) fn open() -> io::Result<Netlink> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        let port = socket.bind_auto()?.port_number();
        // Only the kernel's messages (port 0) reach a socket connected to it.
        socket.connect(&SocketAddr::new(0, 0))?;
        socket2::SockRef::from(&socket).set_read_timeout(Some(TIMEOUT))?;
        Ok(Netlink {
            socket,
            port,
            seq: 0,
            timeout: TIMEOUT,
            buffer: vec![0; BUFFER],
        })
    }

    /// RTM_GETROUTE for `to` (what `ip route get TO` prints); Ok(None) where the kernel says
    /// there is no usable route (unreachable, prohibit, blackhole, ENETUNREACH, EHOSTUNREACH),
    /// and where it gives no source address (IPv6 with no address to send from).
    pub(crate) fn route(&mut self, to: IpAddr) -> io::Result<Option<Route>> {
        let mut message = RouteMessage::default();
        message.header.address_family = family(to);
        message.header.destination_prefix_length = if to.is_ipv4() { 32 } else { 128 };
        message
            .attributes
            .push(RouteAttribute::Destination(RouteAddress::from(to)));
        let mut found = None;
        let answer = self.exchange(
            RouteNetlinkMessage::GetRoute(message),
            NLM_F_REQUEST,
            &mut |kind, payload| {
                if kind == libc::RTM_NEWROUTE {
                    found = Some(parse_route(to, payload)?);
                }
                Ok(())
            },
        )?;
        match answer {
            Err(errno) if NO_ROUTE.contains(&errno) => Ok(None),
            Err(errno) => Err(io::Error::from_raw_os_error(errno)),
            Ok(()) => found.ok_or_else(|| invalid("RTM_GETROUTE answered without a route")),
        }
    }

    /// The link-layer address of neighbour `ip` on `ifindex`, if the neighbour table has it
    /// in a usable state (REACHABLE, STALE, DELAY, PROBE, PERMANENT; not INCOMPLETE/FAILED).
    pub(crate) fn neighbour(&mut self, ip: IpAddr, ifindex: u32) -> io::Result<Option<[u8; 6]>> {
        let mut message = NeighbourMessage::default();
        message.header.family = family(ip);
        message.header.ifindex = ifindex;
        message
            .attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::from(ip)));
        let mut found = None;
        let answer = self.exchange(
            RouteNetlinkMessage::GetNeighbour(message),
            NLM_F_REQUEST,
            &mut |kind, payload| {
                if kind == libc::RTM_NEWNEIGH {
                    found = parse_neighbour(ip, ifindex, payload)?;
                }
                Ok(())
            },
        )?;
        match answer {
            Ok(()) => Ok(found),
            // No such entry, or no such interface.
            Err(libc::ENOENT | libc::ENODEV) => Ok(None),
            // A kernel before 5.0 answers no single neighbour: read its table.
            Err(libc::EOPNOTSUPP) => self.neighbour_from_dump(ip, ifindex),
            Err(errno) => Err(io::Error::from_raw_os_error(errno)),
        }
    }

    /// [`Netlink::neighbour`] from a dump of the neighbour table of `ip`'s family.
    fn neighbour_from_dump(&mut self, ip: IpAddr, ifindex: u32) -> io::Result<Option<[u8; 6]>> {
        let mut message = NeighbourMessage::default();
        message.header.family = family(ip);
        let mut found = None;
        let answer = self.exchange(
            RouteNetlinkMessage::GetNeighbour(message),
            NLM_F_REQUEST | NLM_F_DUMP,
            &mut |kind, payload| {
                if kind == libc::RTM_NEWNEIGH && found.is_none() {
                    found = parse_neighbour(ip, ifindex, payload)?;
                }
                Ok(())
            },
        )?;
        answer.map_err(io::Error::from_raw_os_error)?;
        Ok(found)
    }

    /// Interface `ifindex`'s own MAC address (None: no such interface, or one without a
    /// 6-byte link-layer address, such as a tun or a WireGuard device).
    pub(crate) fn link_mac(&mut self, ifindex: u32) -> io::Result<Option<[u8; 6]>> {
        let mut message = LinkMessage::default();
        message.header.index = ifindex;
        // The interface's counters are of no use here: leave them out of the reply.
        message
            .attributes
            .push(LinkAttribute::ExtMask(vec![LinkExtentMask::SkipStats]));
        let mut found = None;
        let answer = self.exchange(
            RouteNetlinkMessage::GetLink(message),
            NLM_F_REQUEST,
            &mut |kind, payload| {
                if kind == libc::RTM_NEWLINK {
                    found = parse_link(ifindex, payload)?;
                }
                Ok(())
            },
        )?;
        match answer {
            Ok(()) => Ok(found),
            Err(libc::ENODEV) => Ok(None),
            Err(errno) => Err(io::Error::from_raw_os_error(errno)),
        }
    }

    /// Sends `request` and reads its reply (a dump's, up to its end), handing `each` the type
    /// and payload of each of its messages. Err: the socket's error or no reply in time (or
    /// an unreadable one); Ok(Err(errno)): the kernel refused the request.
    fn exchange(
        &mut self,
        request: RouteNetlinkMessage,
        flags: u16,
        each: &mut dyn FnMut(u16, &[u8]) -> io::Result<()>,
    ) -> io::Result<Answer> {
        let seq = self.send(request, flags)?;
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        let deadline = Instant::now() + self.timeout;
        loop {
            let len = self.receive(deadline)?;
            if let Some(answer) = scan(&self.buffer[..len], self.port, seq, dump, each)? {
                return Ok(answer);
            }
            // Only others' replies so far (late ones to requests that timed out).
            if Instant::now() >= deadline {
                return Err(timed_out());
            }
        }
    }

    /// Sends `request` with a new sequence number, which it returns.
    fn send(&mut self, request: RouteNetlinkMessage, flags: u16) -> io::Result<u32> {
        // 0 is the sequence number of the kernel's notifications: never a request's.
        self.seq = self.seq.wrapping_add(1).max(1);
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = self.seq;
        let mut message = NetlinkMessage::new(header, NetlinkPayload::from(request));
        message.finalize();
        let mut bytes = vec![0; message.buffer_len()];
        message.serialize(&mut bytes);
        let sent = self.socket.send(&bytes, 0)?;
        if sent != bytes.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "netlink request cut short",
            ));
        }
        Ok(self.seq)
    }

    /// Receives one datagram into the buffer, waiting at most the socket's timeout for it.
    fn receive(&mut self, deadline: Instant) -> io::Result<usize> {
        loop {
            let mut buffer = &mut self.buffer[..];
            match self.socket.recv(&mut buffer, libc::MSG_TRUNC) {
                Ok(len) if len > self.buffer.len() => {
                    return Err(invalid("a netlink datagram larger than the buffer"))
                }
                Ok(len) => return Ok(len),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(timed_out()),
                // A signal, or messages dropped on a full socket (perhaps the reply: it is
                // waited for until the deadline).
                Err(e)
                    if (e.kind() == io::ErrorKind::Interrupted
                        || e.raw_os_error() == Some(libc::ENOBUFS))
                        && Instant::now() < deadline => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Goes through the messages of `datagram`, handing those of the reply to request `seq` to
/// `each`. Some: the reply is complete (Err(errno): the kernel refused the request); None: it
/// has more to come, or the datagram was none of it.
fn scan(
    datagram: &[u8],
    port: u32,
    seq: u32,
    dump: bool,
    each: &mut dyn FnMut(u16, &[u8]) -> io::Result<()>,
) -> io::Result<Option<Answer>> {
    let mut rest = datagram;
    while !rest.is_empty() {
        // Checks that the header fits and that its length is within the datagram.
        let message = NetlinkBuffer::new_checked(rest).map_err(invalid)?;
        let len = message.length() as usize;
        if message.sequence_number() == seq && message.port_number() == port {
            let payload = message.payload();
            match message.message_type() {
                NLMSG_ERROR => {
                    let error = ErrorBuffer::new_checked(payload).map_err(invalid)?;
                    // 0 acknowledges (not asked for here), else a negative errno.
                    return Ok(Some(match error.code() {
                        None => Ok(()),
                        Some(code) => Err(code.get().wrapping_neg()),
                    }));
                }
                NLMSG_DONE => {
                    // A dump's end carries its error, if it ended on one.
                    let code = payload
                        .get(..4)
                        .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                    return Ok(Some(if code < 0 {
                        Err(code.wrapping_neg())
                    } else {
                        Ok(())
                    }));
                }
                NLMSG_NOOP => {}
                NLMSG_OVERRUN => return Err(invalid("netlink overrun")),
                kind => {
                    each(kind, payload)?;
                    if !dump {
                        return Ok(Some(Ok(())));
                    }
                }
            }
        }
        rest = rest.get((len + 3) & !3..).unwrap_or_default();
    }
    Ok(None)
}

/// The route of an RTM_NEWROUTE answering RTM_GETROUTE for `to` (None: not a usable one).
fn parse_route(to: IpAddr, payload: &[u8]) -> io::Result<Option<Route>> {
    let header = RouteHeader::parse(payload).map_err(invalid)?;
    if header.address_family != family(to) {
        return Err(invalid("RTM_GETROUTE answered for another family"));
    }
    if matches!(
        header.kind,
        RouteType::Unreachable | RouteType::BlackHole | RouteType::Prohibit | RouteType::Throw
    ) {
        return Ok(None);
    }
    let local = header.kind == RouteType::Local;
    let (mut ifindex, mut gateway, mut source) = (None, None, None);
    for nla in attributes(payload, RTMSG_LEN) {
        let nla = nla?;
        if !matches!(nla.kind(), RTA_OIF | RTA_GATEWAY | RTA_PREFSRC | RTA_VIA) {
            continue;
        }
        let param = (header.address_family, header.kind, RouteLwEnCapType::None);
        match RouteAttribute::parse_with_param(&nla, param).map_err(invalid)? {
            RouteAttribute::Oif(index) => ifindex = Some(index),
            RouteAttribute::PrefSource(address) => source = Some(route_address(address)?),
            RouteAttribute::Gateway(address) => gateway = Some(route_address(address)?),
            RouteAttribute::Via(RouteVia::Inet(address)) => gateway = Some(address.into()),
            RouteAttribute::Via(RouteVia::Inet6(address)) => gateway = Some(address.into()),
            RouteAttribute::Via(_) => return Err(invalid("a next hop of no IP family")),
            _ => {}
        }
    }
    let ifindex = ifindex.ok_or_else(|| invalid("a route without an output interface"))?;
    let Some(source) = source.or(local.then_some(to)) else {
        // Nothing to send from (IPv6 with no address that source selection accepts).
        return Ok(None);
    };
    Ok(Some(Route {
        source,
        ifindex,
        gateway,
        local,
    }))
}

/// The MAC address of an RTM_NEWNEIGH, if it is neighbour `ip` on `ifindex` in a usable state.
fn parse_neighbour(ip: IpAddr, ifindex: u32, payload: &[u8]) -> io::Result<Option<[u8; 6]>> {
    let header = NeighbourHeader::parse(payload).map_err(invalid)?;
    let usable = matches!(
        header.state,
        NeighbourState::Reachable
            | NeighbourState::Stale
            | NeighbourState::Delay
            | NeighbourState::Probe
            | NeighbourState::Permanent
    );
    if header.family != family(ip) || header.ifindex != ifindex || !usable {
        return Ok(None);
    }
    let (mut destination, mut mac) = (None, None);
    for nla in attributes(payload, NDMSG_LEN) {
        let nla = nla?;
        if !matches!(nla.kind(), NDA_DST | NDA_LLADDR) {
            continue;
        }
        match NeighbourAttribute::parse_with_param(&nla, header.family).map_err(invalid)? {
            NeighbourAttribute::Destination(NeighbourAddress::Inet(address)) => {
                destination = Some(IpAddr::from(address))
            }
            NeighbourAttribute::Destination(NeighbourAddress::Inet6(address)) => {
                destination = Some(IpAddr::from(address))
            }
            NeighbourAttribute::LinkLayerAddress(address) => {
                mac = <[u8; 6]>::try_from(address).ok()
            }
            _ => {}
        }
    }
    Ok(mac.filter(|_| destination == Some(ip)))
}

/// The MAC address of an RTM_NEWLINK, if it is interface `ifindex`'s and has one.
fn parse_link(ifindex: u32, payload: &[u8]) -> io::Result<Option<[u8; 6]>> {
    let header = LinkHeader::parse(payload).map_err(invalid)?;
    if header.index != ifindex {
        return Err(invalid("RTM_GETLINK answered for another interface"));
    }
    for nla in attributes(payload, IFINFOMSG_LEN) {
        let nla = nla?;
        if nla.kind() != IFLA_ADDRESS {
            continue;
        }
        if let LinkAttribute::Address(address) =
            LinkAttribute::parse_with_param(&nla, header.interface_family).map_err(invalid)?
        {
            return Ok(<[u8; 6]>::try_from(address).ok());
        }
    }
    Ok(None)
}

/// The attributes after a message's fixed header of `header_len` bytes.
fn attributes(
    payload: &[u8],
    header_len: usize,
) -> impl Iterator<Item = io::Result<NlaBuffer<&[u8]>>> {
    NlasIterator::new(payload.get(header_len..).unwrap_or_default()).map(|nla| nla.map_err(invalid))
}

fn route_address(address: RouteAddress) -> io::Result<IpAddr> {
    match address {
        RouteAddress::Inet(address) => Ok(address.into()),
        RouteAddress::Inet6(address) => Ok(address.into()),
        _ => Err(invalid("a route address of no IP family")),
    }
}

fn family(ip: IpAddr) -> AddressFamily {
    match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

fn invalid(error: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("rtnetlink: {error}"))
}

fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "rtnetlink: no reply in time")
}
