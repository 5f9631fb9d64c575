//! The kernel offload's own per-packet cost: its TC and XDP programs run in the kernel on
//! crafted Ethernet/IPv4/UDP frames (`BPF_PROG_TEST_RUN`), each against its limit (a program
//! that only redirects, or only returns XDP_TX) and against a miss (ChannelData of a channel no entry matches, which goes up to
//! user space untouched). Every rewrite is checked byte for byte against a frame built here,
//! and both checksums of every output are verified with this file's own checksum code: a
//! correctness check of the program's incremental checksum updates too.
//!
//! `BPF_PROG_TEST_RUN` runs the program `repeat` times on one skb, so from the second run on
//! the program sees its own output. A miss and the limit leave the frame as it is; a relayed
//! frame is rewritten, so the timed loop installs a mirror channel whose entries relay each
//! output back into the input: client→peer, then peer→client, and so on, every run a hit. That
//! loop's mean is the cost of the two directions together; each direction alone is the median
//! of single runs (each one a fresh skb, timed with one more clock read, as is the limit's in
//! the same row).
//!
//! Needs CAP_BPF and CAP_NET_ADMIN and a build that found clang and libbpf-dev; without them it
//! says why and exits 0.

use std::net::SocketAddrV4;
use uturn_dataplane::io::offload::{EntrySpec, LimitProgram, Offload, TestRun};

/// Timed runs per measurement (the median is reported).
const RUNS: usize = 5;
/// Program runs per timed run of a looping measurement.
const REPEAT: u32 = 1_000_000;
/// Single runs per direction, for the per-direction medians.
const SINGLES: usize = 20_000;
const PAYLOADS: [usize; 2] = [100, 1200];
const CHANNEL: u16 = 0x4001;
/// Where the program sends a relayed packet: an entry with an interface gets
/// `bpf_redirect_neigh` (`TC_ACT_REDIRECT`; under test run nothing is sent). An entry with 0
/// (this host) would return `TC_ACT_OK` on the loopback device, the verdict of a miss. The
/// XDP program sends back out (XDP_TX) an entry whose interface is the one the frame came in
/// on: under test run, the loopback's.
const IFINDEX: u32 = 1;
/// The Ethernet destination and source `frame` writes, which the XDP program writes from the
/// entry.
const MACS: [u8; 12] = [0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01];
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

const ETH: usize = 14;
const IP: usize = 20;
const UDP: usize = 8;
const IP_CHECK: usize = ETH + 10;
const UDP_CHECK: usize = ETH + IP + 6;

fn addr(s: &str) -> SocketAddrV4 {
    s.parse().unwrap()
}

/// The channel under test, and its mirror: the mirror's entries relay each output of the
/// channel's back into the channel's input, which keeps the timed loop on hits.
fn channels(expires_ns: u64) -> (EntrySpec, EntrySpec) {
    let (client, listener) = (addr("192.0.2.10:50000"), addr("10.0.0.1:3478"));
    let (relay, peer) = (addr("10.0.0.1:49152"), addr("198.51.100.20:5000"));
    let spec = |client, listener, relay, peer| EntrySpec {
        client,
        listener,
        channel: CHANNEL,
        relay,
        peer,
        peer_ifindex: IFINDEX,
        client_ifindex: IFINDEX,
        peer_macs: Some(MACS),
        client_macs: Some(MACS),
        expires_ns,
    };
    (
        spec(client, listener, relay, peer),
        spec(listener, client, peer, relay),
    )
}

/// One's complement sum of `data` as big-endian 16-bit words (an odd last byte padded).
fn sum(data: &[u8], mut acc: u32) -> u32 {
    let mut words = data.chunks_exact(2);
    for w in &mut words {
        acc += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = words.remainder() {
        acc += u32::from(*last) << 8;
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// The UDP checksum's sum: pseudo header, UDP header and data.
fn udp_sum(ip: &[u8], udp: &[u8]) -> u16 {
    let mut pseudo = [0u8; 12];
    pseudo[..8].copy_from_slice(&ip[12..20]);
    pseudo[9] = 17;
    pseudo[10..12].copy_from_slice(&(udp.len() as u16).to_be_bytes());
    fold(sum(udp, sum(&pseudo, 0)))
}

/// An Ethernet frame carrying `payload` in UDP from `src` to `dst`, both checksums set.
fn frame(src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(ETH + IP + UDP + payload.len());
    f.extend_from_slice(&MACS);
    f.extend_from_slice(&[0x08, 0x00]);
    let total = (IP + UDP + payload.len()) as u16;
    f.extend_from_slice(&[0x45, 0]);
    f.extend_from_slice(&total.to_be_bytes());
    // Identification, DF, TTL 64, UDP, checksum (below).
    f.extend_from_slice(&[0x12, 0x34, 0x40, 0x00, 64, 17, 0, 0]);
    f.extend_from_slice(&src.ip().octets());
    f.extend_from_slice(&dst.ip().octets());
    f.extend_from_slice(&src.port().to_be_bytes());
    f.extend_from_slice(&dst.port().to_be_bytes());
    f.extend_from_slice(&(total - IP as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(payload);
    let ip_check = !fold(sum(&f[ETH..ETH + IP], 0));
    f[IP_CHECK..IP_CHECK + 2].copy_from_slice(&ip_check.to_be_bytes());
    let udp_check = match !udp_sum(&f[ETH..ETH + IP], &f[ETH + IP..]) {
        0 => 0xffff,
        c => c,
    };
    f[UDP_CHECK..UDP_CHECK + 2].copy_from_slice(&udp_check.to_be_bytes());
    f
}

/// ChannelData of `channel` carrying `payload`, unpadded.
fn channel_data(channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(4 + payload.len());
    m.extend_from_slice(&channel.to_be_bytes());
    m.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    m.extend_from_slice(payload);
    m
}

/// Media-like bytes: not ChannelData (the first byte's top bits are not 01).
fn payload(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + 0x80) as u8).collect()
}

/// Panics unless `packet` is a well-formed IPv4/UDP frame whose IPv4 header checksum and UDP
/// checksum both verify, and it equals `want`.
fn check_frame(what: &str, packet: &[u8], want: &[u8]) {
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
    if packet != want {
        let diff: Vec<String> = packet
            .iter()
            .zip(want)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, (a, b))| format!("[{i}] {a:#04x} want {b:#04x}"))
            .collect();
        panic!(
            "{what}: not the expected rewrite ({} bytes, want {}): {}\n{}",
            packet.len(),
            want.len(),
            diff.join(", "),
            hex(packet)
        );
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

/// CLOCK_MONOTONIC nanoseconds, what the program compares an entry's end with.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) },
        0
    );
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn median(mut values: Vec<u32>) -> u32 {
    values.sort_unstable();
    values[values.len() / 2]
}

/// The programs under test.
struct Programs {
    offload: Offload,
    limit: LimitProgram,
    xdp_limit: LimitProgram,
}

/// Which program runs.
#[derive(Clone, Copy, PartialEq)]
enum Which {
    Tc,
    TcLimit,
    Xdp,
    XdpLimit,
}

impl Programs {
    fn run(&self, which: Which, packet: &[u8], repeat: u32) -> TestRun {
        let run = match which {
            Which::Tc => self.offload.test_run(packet, repeat),
            Which::TcLimit => self.limit.test_run(packet, repeat),
            Which::Xdp => self.offload.test_run_xdp(packet, repeat),
            Which::XdpLimit => self.xdp_limit.test_run(packet, repeat),
        };
        run.unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN: {e}"))
    }

    /// Median ns per run over `runs` loops of `repeat` runs on `packet`; checks that every
    /// loop ended with `verdict` and the frame as it started.
    fn looped(
        &self,
        what: &str,
        limit: Which,
        packet: &[u8],
        verdict: u32,
        (runs, repeat): (usize, u32),
    ) -> u32 {
        let times = (0..runs)
            .map(|_| {
                let run = self.run(limit, packet, repeat);
                assert_eq!(run.verdict, verdict, "{what}: verdict");
                check_frame(what, &run.packet, packet);
                run.duration_ns
            })
            .collect();
        median(times)
    }

    /// Median ns of `singles` single runs on `packet`.
    fn single(&self, limit: Which, packet: &[u8], singles: usize) -> u32 {
        median(
            (0..singles)
                .map(|_| self.run(limit, packet, 1).duration_ns)
                .collect(),
        )
    }
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: then one short pass.
    let quick = !std::env::args().any(|a| a == "--bench");
    let (runs, repeat, singles) = if quick {
        (1, 1000, 100)
    } else {
        (RUNS, REPEAT, SINGLES)
    };
    let programs = match Offload::load().and_then(|offload| {
        Ok(Programs {
            offload,
            limit: Offload::limit_program()?,
            xdp_limit: Offload::limit_program_xdp()?,
        })
    }) {
        Ok(programs) => programs,
        Err(why) => {
            println!("offload: skipped: {why}");
            return;
        }
    };
    let (channel, mirror) = channels(monotonic_ns() + 3_600_000_000_000);
    for spec in [channel, mirror] {
        programs
            .offload
            .install(&spec)
            .unwrap_or_else(|e| panic!("installing a channel: {e}"));
    }
    let stranger = addr("192.0.2.99:50000");
    if let Err(e) = programs
        .offload
        .test_run(&frame(stranger, channel.listener, &[]), 1)
    {
        println!("offload: skipped: BPF_PROG_TEST_RUN: {e}");
        return;
    }

    println!(
        "offload: TC and XDP programs in the kernel (BPF_PROG_TEST_RUN), ns per packet; single \
         runs: median of {singles}, loops: median of {runs} x {repeat}"
    );
    println!(
        "{:<14} {:>7} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6}",
        "direction", "payload", "tc", "limit", "miss", "xdp", "limit", "miss"
    );
    let mut loops = Vec::new();
    for len in PAYLOADS {
        let data = payload(len);
        let chan = channel_data(CHANNEL, &data);
        // client→peer: ChannelData to the listener leaves as the bare payload, relay→peer.
        let to_peer = frame(channel.client, channel.listener, &chan);
        let at_peer = frame(channel.relay, channel.peer, &data);
        // peer→client: a datagram to the relay leaves as ChannelData, listener→client.
        let from_peer = frame(channel.peer, channel.relay, &data);
        let at_client = frame(channel.listener, channel.client, &chan);
        // Misses, up untouched: ChannelData from a client no entry knows (both maps looked
        // up), a datagram from a peer no entry knows (one).
        let client_miss = frame(stranger, channel.listener, &chan);
        let peer_miss = frame(stranger, channel.relay, &data);

        for (direction, input, want, miss) in [
            ("client→peer", &to_peer, &at_peer, &client_miss),
            ("peer→client", &from_peer, &at_client, &peer_miss),
        ] {
            let what = format!("{direction} {len} B");
            let run = programs.run(Which::Tc, input, 1);
            assert_eq!(run.verdict, TC_ACT_REDIRECT, "{what}: verdict");
            check_frame(&what, &run.packet, want);
            let missed = programs.run(Which::Tc, miss, 1);
            assert!(
                !matches!(missed.verdict, TC_ACT_REDIRECT | TC_ACT_SHOT),
                "{what}: a miss's verdict {}",
                missed.verdict
            );
            check_frame(&format!("{what} miss"), &missed.packet, miss);
            let run = programs.run(Which::Xdp, input, 1);
            assert_eq!(run.verdict, XDP_TX, "{what}: XDP verdict");
            check_frame(&format!("{what} XDP"), &run.packet, want);
            let missed = programs.run(Which::Xdp, miss, 1);
            assert_eq!(missed.verdict, XDP_PASS, "{what}: a miss's XDP verdict");
            check_frame(&format!("{what} XDP miss"), &missed.packet, miss);
            println!(
                "{direction:<14} {len:>5} B {:>6} {:>6} {:>6} {:>6} {:>6} {:>6}",
                programs.single(Which::Tc, input, singles),
                programs.single(Which::TcLimit, input, singles),
                programs.single(Which::Tc, miss, singles),
                programs.single(Which::Xdp, input, singles),
                programs.single(Which::XdpLimit, input, singles),
                programs.single(Which::Xdp, miss, singles),
            );
        }
        // The loop: the channel relays, its mirror relays back; after an even number of runs
        // the frame must be the input again, checksums included, after a million incremental
        // updates.
        let redirect = programs.run(Which::TcLimit, &to_peer, 1).verdict;
        let missed = programs.run(Which::Tc, &client_miss, 1).verdict;
        let even = (runs, repeat & !1);
        loops.push((
            len,
            [
                programs.looped("loop", Which::Tc, &to_peer, TC_ACT_REDIRECT, even),
                programs.looped("limit", Which::TcLimit, &to_peer, redirect, (runs, repeat)),
                programs.looped("miss", Which::Tc, &client_miss, missed, (runs, repeat)),
                programs.looped("XDP loop", Which::Xdp, &to_peer, XDP_TX, even),
                programs.looped(
                    "XDP limit",
                    Which::XdpLimit,
                    &to_peer,
                    XDP_TX,
                    (runs, repeat),
                ),
                programs.looped(
                    "XDP miss",
                    Which::Xdp,
                    &client_miss,
                    XDP_PASS,
                    (runs, repeat),
                ),
            ],
        ));
    }
    for (len, [tc, limit, miss, xdp, xdp_limit, xdp_miss]) in loops {
        println!(
            "{:<14} {len:>5} B {tc:>6} {limit:>6} {miss:>6} {xdp:>6} {xdp_limit:>6} {xdp_miss:>6}",
            "both, looped"
        );
    }
    println!(
        "(a single run is timed with one clock read more than a loop's; a loop's offload is the \
         mean of a client→peer and a peer→client run; miss: ChannelData from an unknown client, \
         peer→client row: a datagram from an unknown peer)"
    );
}
