//! The offload's TC and XDP programs, byte for byte: the real programs (as stunnerd loads them,
//! attached nowhere) run in the kernel on crafted Ethernet/IPv4/UDP frames with
//! `BPF_PROG_TEST_RUN`, one channel's entries installed by hand, and each output frame is
//! compared with one built here from the channel's addresses:
//!
//! - client → peer: ChannelData to the listener leaves as the bare payload, relay → peer;
//! - peer → client: a datagram to the relay leaves as ChannelData, listener → client;
//!
//! both with the IPv4 header a relay socket would send (TOS 0, DF, the namespace's default
//! TTL; the IP ID is the program's own and not compared), the header checksum and the UDP
//! checksum verified with this file's own checksum code, the payload unchanged. The verdicts:
//! TC redirects (`TC_ACT_REDIRECT`), XDP sends back out (`XDP_TX`); what no entry matches, or
//! an entry whose allocation ended, goes up to the stack untouched (`TC_ACT_UNSPEC`,
//! `XDP_PASS`). A frame relayed to the channel's mirror and back a thousand times is the
//! input again: the incremental checksum updates do not drift.
//!
//! Needs root (CAP_BPF, CAP_NET_ADMIN), as CI runs it; a build without the program (no clang
//! or libbpf-dev when it was built) skips each test, saying so.

use std::net::SocketAddrV4;
use uturn_dataplane::io::offload::{EntrySpec, Offload, OffloadError, TestRun};
use uturn_testkit::frames::{
    channel_data, fold, monotonic_ns, payload, sum, udp_sum, Header, ETH, IP, IP_CHECK, IP_ID, UDP,
};

const TC_ACT_UNSPEC: u32 = u32::MAX;
const TC_ACT_REDIRECT: u32 = 7;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;

const CHANNEL: u16 = 0x4001;
/// The entries' interface: the loopback, which `BPF_PROG_TEST_RUN` runs on (TC redirects
/// toward it; XDP sends back out an entry whose interface is the one the frame came in on).
const IFINDEX: u32 = 1;
/// The frames' Ethernet destination and source, and the entries' next hop and own address:
/// the loopback's (all zero).
const MACS: [u8; 12] = [0; 12];
/// The deadline slots of the channel's allocation and of its permission.
const ALLOC: u32 = 1;
const PERM: u32 = 2;
const HOUR_NS: u64 = 3_600_000_000_000;
/// Payload sizes: the smallest both programs relay both ways (XDP passes a peer's datagram of
/// under 4 bytes up, to TC), odd ones (a checksum's padded last byte), a media packet's.
const PAYLOADS: [usize; 4] = [4, 5, 101, 1200];

fn addr(s: &str) -> SocketAddrV4 {
    s.parse().unwrap()
}

// ---- frames ----

/// A frame between the loopback's addresses ([`MACS`]), as the programs see under test run.
fn frame(src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8], header: Header) -> Vec<u8> {
    uturn_testkit::frames::frame(MACS, src, dst, payload, header)
}

// ---- checks ----

/// What byte `i` of a frame is, for a failure's message.
fn field(i: usize) -> &'static str {
    match i {
        0..6 => "Ethernet destination",
        6..12 => "Ethernet source",
        12..14 => "EtherType",
        14 => "IPv4 version/IHL",
        15 => "IPv4 TOS",
        16..18 => "IPv4 total length",
        18..20 => "IPv4 ID",
        20..22 => "IPv4 flags/fragment",
        22 => "IPv4 TTL",
        23 => "IPv4 protocol",
        24..26 => "IPv4 checksum",
        26..30 => "IPv4 source",
        30..34 => "IPv4 destination",
        34..36 => "UDP source port",
        36..38 => "UDP destination port",
        38..40 => "UDP length",
        40..42 => "UDP checksum",
        _ => "payload",
    }
}

fn hex(packet: &[u8]) -> String {
    packet
        .chunks(16)
        .map(|line| {
            line.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Panics unless `packet` equals `want` byte for byte.
fn assert_bytes(what: &str, packet: &[u8], want: &[u8]) {
    if packet != want {
        let diff: Vec<String> = packet
            .iter()
            .zip(want)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, (a, b))| format!("[{i}] ({}) {a:#04x} want {b:#04x}", field(i)))
            .collect();
        panic!(
            "{what}: not the expected frame ({} bytes, want {}): {}\n{}",
            packet.len(),
            want.len(),
            diff.join(", "),
            hex(packet)
        );
    }
}

/// Panics unless `packet` is a well-formed IPv4/UDP frame whose IPv4 header checksum and UDP
/// checksum both verify and which equals `want`, the IP ID aside (the program's own).
fn check_relayed(what: &str, packet: &[u8], want: &[u8]) {
    assert!(
        packet.len() >= ETH + IP + UDP,
        "{what}: {} bytes out",
        packet.len()
    );
    let ip = &packet[ETH..ETH + IP];
    let udp = &packet[ETH + IP..];
    let ip_len = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let udp_len = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    assert!(
        ip_len == packet.len() - ETH && udp_len == udp.len(),
        "{what}: lengths: IPv4 total {ip_len}, UDP {udp_len}, frame {}\n{}",
        packet.len(),
        hex(packet)
    );
    assert_eq!(
        fold(sum(ip, 0)),
        0xffff,
        "{what}: IPv4 header checksum {:#06x} does not verify\n{}",
        u16::from_be_bytes([ip[10], ip[11]]),
        hex(packet)
    );
    let udp_check = u16::from_be_bytes([udp[6], udp[7]]);
    assert!(
        udp_check != 0 && udp_sum(ip, udp) == 0xffff,
        "{what}: UDP checksum {udp_check:#06x} does not verify (sum {:#06x})\n{}",
        udp_sum(ip, udp),
        hex(packet)
    );
    // The header checksum covers the ID: it verified above, so both are taken from `want`.
    let mut packet = packet.to_vec();
    packet[IP_ID..IP_ID + 2].copy_from_slice(&want[IP_ID..IP_ID + 2]);
    packet[IP_CHECK..IP_CHECK + 2].copy_from_slice(&want[IP_CHECK..IP_CHECK + 2]);
    assert_bytes(what, &packet, want);
}

// ---- the program ----

/// The TTL the program writes: this network namespace's default, as a relay socket's.
fn default_ttl() -> u8 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_default_ttl")
        .ok()
        .and_then(|t| t.trim().parse::<u8>().ok())
        .filter(|t| *t > 0)
        .unwrap_or(64)
}

/// The channel's entry pair, with its interfaces and MAC addresses (TC and XDP relay it).
fn channel(expires_ns: u64) -> EntrySpec {
    EntrySpec {
        client: addr("192.0.2.10:50000"),
        listener: addr("10.0.0.1:3478"),
        channel: CHANNEL,
        relay: addr("10.0.0.1:49152"),
        peer: addr("198.51.100.20:5000"),
        peer_ifindex: IFINDEX,
        client_ifindex: IFINDEX,
        peer_macs: Some(MACS),
        client_macs: Some(MACS),
        alloc: ALLOC,
        perm: PERM,
        expires_ns,
    }
}

/// The loaded program with the channel's entries installed, its allocation and permission
/// an hour from their end.
struct Lab {
    offload: Offload,
    channel: EntrySpec,
    /// The IPv4 header of what arrives (not what a relay socket sends) and of what leaves.
    arriving: Header,
    leaving: Header,
}

/// Which program runs.
#[derive(Clone, Copy, Debug)]
enum Program {
    Tc,
    Xdp,
}

/// Which way a channel's datagram goes.
#[derive(Clone, Copy, Debug)]
enum Direction {
    ToPeer,
    ToClient,
}

/// What goes into a program and what must come out.
struct Case {
    input: Vec<u8>,
    /// The input relayed.
    want: Vec<u8>,
    /// A frame no entry matches: from an unknown client, or an unknown peer.
    miss: Vec<u8>,
}

impl Lab {
    /// `None` (the reason printed) only when this build has no BPF program.
    fn new(test: &str) -> Option<Lab> {
        let offload = match Offload::load() {
            Ok(offload) => offload,
            Err(why @ OffloadError::NoProgram) => {
                println!("{test}: skipped: {why}");
                return None;
            }
            Err(why) => panic!(
                "{test}: loading the offload program: {why} (this test needs root: CAP_BPF, \
                 CAP_NET_ADMIN)"
            ),
        };
        let end = monotonic_ns() + HOUR_NS;
        let channel = channel(end);
        for slot in [ALLOC, PERM] {
            offload
                .set_deadline(slot, end)
                .unwrap_or_else(|e| panic!("{test}: setting deadline {slot}: {e}"));
        }
        offload
            .install(&channel)
            .unwrap_or_else(|e| panic!("{test}: installing the channel: {e}"));
        let ttl = default_ttl();
        Some(Lab {
            offload,
            channel,
            // Not what a relay socket sends: a TOS, no DF, another TTL.
            arriving: Header {
                tos: 0xb8,
                df: false,
                ttl: if ttl == 200 { 201 } else { 200 },
            },
            leaving: Header {
                tos: 0,
                df: true,
                ttl,
            },
        })
    }

    fn run(&self, program: Program, packet: &[u8], repeat: u32) -> TestRun {
        match program {
            Program::Tc => self.offload.test_run(packet, repeat),
            Program::Xdp => self.offload.test_run_xdp(packet, repeat),
        }
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN of the {program:?} program: {e}"))
    }

    /// The frames of a `len`-byte payload going `direction`.
    fn case(&self, direction: Direction, len: usize) -> Case {
        let c = &self.channel;
        let stranger = addr("192.0.2.99:50000");
        let data = payload(len);
        let chan = channel_data(CHANNEL, &data);
        let (arriving, leaving) = (self.arriving, self.leaving);
        match direction {
            Direction::ToPeer => Case {
                input: frame(c.client, c.listener, &chan, arriving),
                want: frame(c.relay, c.peer, &data, leaving),
                miss: frame(stranger, c.listener, &chan, arriving),
            },
            Direction::ToClient => Case {
                input: frame(c.peer, c.relay, &data, arriving),
                want: frame(c.listener, c.client, &chan, leaving),
                miss: frame(stranger, c.relay, &data, arriving),
            },
        }
    }

    /// Every payload size going `direction` through `program`: each relayed exactly, each
    /// miss passed up untouched.
    fn check(&self, program: Program, direction: Direction) {
        let (relayed, passed) = match program {
            Program::Tc => (TC_ACT_REDIRECT, TC_ACT_UNSPEC),
            Program::Xdp => (XDP_TX, XDP_PASS),
        };
        for len in PAYLOADS {
            let what = format!("{program:?} {direction:?} {len} B");
            let case = self.case(direction, len);
            let run = self.run(program, &case.input, 1);
            assert_eq!(run.verdict, relayed, "{what}: verdict");
            check_relayed(&what, &run.packet, &case.want);
            let missed = self.run(program, &case.miss, 1);
            assert_eq!(missed.verdict, passed, "{what}: a miss's verdict");
            assert_bytes(&format!("{what} miss"), &missed.packet, &case.miss);
        }
    }
}

#[test]
fn tc_relays_client_channel_data_to_the_peer_byte_for_byte() {
    if let Some(lab) = Lab::new("tc_to_peer") {
        lab.check(Program::Tc, Direction::ToPeer);
    }
}

#[test]
fn tc_relays_a_peer_datagram_to_the_client_as_channel_data_byte_for_byte() {
    if let Some(lab) = Lab::new("tc_to_client") {
        lab.check(Program::Tc, Direction::ToClient);
    }
}

#[test]
fn xdp_relays_client_channel_data_to_the_peer_byte_for_byte() {
    if let Some(lab) = Lab::new("xdp_to_peer") {
        lab.check(Program::Xdp, Direction::ToPeer);
    }
}

#[test]
fn xdp_relays_a_peer_datagram_to_the_client_as_channel_data_byte_for_byte() {
    if let Some(lab) = Lab::new("xdp_to_client") {
        lab.check(Program::Xdp, Direction::ToClient);
    }
}

#[test]
fn an_ended_allocation_is_passed_up_untouched() {
    let Some(lab) = Lab::new("ended") else {
        return;
    };
    lab.offload
        .set_deadline(ALLOC, 0)
        .unwrap_or_else(|e| panic!("ending the allocation: {e}"));
    for direction in [Direction::ToPeer, Direction::ToClient] {
        let case = lab.case(direction, 100);
        for (program, passed) in [(Program::Tc, TC_ACT_UNSPEC), (Program::Xdp, XDP_PASS)] {
            let what = format!("{program:?} {direction:?} ended");
            let run = lab.run(program, &case.input, 1);
            assert_eq!(run.verdict, passed, "{what}: verdict");
            assert_bytes(&what, &run.packet, &case.input);
        }
    }
}

/// `BPF_PROG_TEST_RUN` runs a program `repeat` times on one frame, so from the second run on
/// it sees its own output: with the channel's mirror installed (its entries relay each output
/// back into the input), an even number of runs must give the input again, checksums
/// included, after that many incremental updates.
#[test]
fn a_frame_relayed_back_and_forth_a_thousand_times_is_the_input_again() {
    let Some(mut lab) = Lab::new("looped") else {
        return;
    };
    let c = lab.channel;
    let mirror = EntrySpec {
        client: c.listener,
        listener: c.client,
        relay: c.peer,
        peer: c.relay,
        ..c
    };
    lab.offload
        .install(&mirror)
        .unwrap_or_else(|e| panic!("installing the mirror: {e}"));
    // What leaves is what arrives: the header a relay socket sends.
    lab.arriving = lab.leaving;
    for (program, relayed) in [(Program::Tc, TC_ACT_REDIRECT), (Program::Xdp, XDP_TX)] {
        for len in PAYLOADS {
            let what = format!("{program:?} looped {len} B");
            let input = lab.case(Direction::ToPeer, len).input;
            let run = lab.run(program, &input, 1000);
            assert_eq!(run.verdict, relayed, "{what}: verdict");
            check_relayed(&what, &run.packet, &input);
        }
    }
}
