//! The kernel offload's own per-packet cost: its TC and XDP programs run in the kernel on
//! crafted Ethernet/IPv4/UDP frames (`BPF_PROG_TEST_RUN`), each against its limit (a program
//! that only redirects, or only returns XDP_TX) and against a miss (ChannelData of a channel no
//! entry matches, which goes up to user space untouched). Only the verdicts are checked here,
//! as a sanity check of what is timed: the byte-exact, checksum-verified checks of the
//! programs' output run under `cargo test` (`dataplane/stunnerd/tests/offload_program.rs`;
//! both build their frames with `uturn_testkit::frames`).
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
use uturn_testkit::frames::{channel_data, monotonic_ns, payload, Header};

/// A frame between the loopback's addresses ([`MACS`]), as the programs see under test run.
fn frame(src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8]) -> Vec<u8> {
    uturn_testkit::frames::frame(MACS, src, dst, payload, Header::default())
}

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
// The frames' Ethernet destination and source, and the entries' next hop and own address: all
// zero, the loopback's address, which BPF_PROG_TEST_RUN runs on (a frame to another host's
// address is not the gateway's, and the programs pass it up).
const MACS: [u8; 12] = [0; 12];
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

/// The deadline slot of the allocation the channels belong to.
const ALLOC: u32 = 1;
/// The deadline slot of their permission.
const PERM: u32 = 2;

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
        alloc: ALLOC,
        perm: PERM,
        expires_ns,
    };
    (
        spec(client, listener, relay, peer),
        spec(listener, client, peer, relay),
    )
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
    /// loop ended with `verdict`.
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
    programs
        .offload
        .set_deadline(ALLOC, monotonic_ns() + 3_600_000_000_000)
        .and_then(|()| {
            programs
                .offload
                .set_deadline(PERM, monotonic_ns() + 3_600_000_000_000)
        })
        .unwrap_or_else(|e| panic!("setting the deadlines: {e}"));
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
        // client→peer: ChannelData to the listener (leaves as the bare payload, relay→peer).
        let to_peer = frame(channel.client, channel.listener, &chan);
        // peer→client: a datagram to the relay (leaves as ChannelData, listener→client).
        let from_peer = frame(channel.peer, channel.relay, &data);
        // Misses, up untouched: ChannelData from a client no entry knows (both maps looked
        // up), a datagram from a peer no entry knows (one).
        let client_miss = frame(stranger, channel.listener, &chan);
        let peer_miss = frame(stranger, channel.relay, &data);

        for (direction, input, miss) in [
            ("client→peer", &to_peer, &client_miss),
            ("peer→client", &from_peer, &peer_miss),
        ] {
            let what = format!("{direction} {len} B");
            // What is timed is what it should be: a hit relays, a miss goes up.
            let run = programs.run(Which::Tc, input, 1);
            assert_eq!(run.verdict, TC_ACT_REDIRECT, "{what}: verdict");
            let missed = programs.run(Which::Tc, miss, 1);
            assert!(
                !matches!(missed.verdict, TC_ACT_REDIRECT | TC_ACT_SHOT),
                "{what}: a miss's verdict {}",
                missed.verdict
            );
            let run = programs.run(Which::Xdp, input, 1);
            assert_eq!(run.verdict, XDP_TX, "{what}: XDP verdict");
            let missed = programs.run(Which::Xdp, miss, 1);
            assert_eq!(missed.verdict, XDP_PASS, "{what}: a miss's XDP verdict");
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
        // The loop: the channel relays, its mirror relays back, every run a hit (the test
        // checks that an even number of runs gives the input again, checksums included).
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
