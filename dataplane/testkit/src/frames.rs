//! Ethernet/IPv4/UDP frames built by hand, for what runs the offload's programs on them
//! (`BPF_PROG_TEST_RUN` in `tests/offload_program.rs` and `benches/benches/offload.rs`): a
//! frame with both checksums set, ChannelData, media-like payloads, the one's complement sums
//! to check a frame's checksums with, and the clock the programs compare an entry's end with.

use std::net::SocketAddrV4;

/// Ethernet header length.
pub const ETH: usize = 14;
/// IPv4 header length (no options).
pub const IP: usize = 20;
/// UDP header length.
pub const UDP: usize = 8;
/// Where a frame's IPv4 ID is.
pub const IP_ID: usize = ETH + 4;
/// Where a frame's IPv4 header checksum is.
pub const IP_CHECK: usize = ETH + 10;
/// Where a frame's UDP checksum is.
pub const UDP_CHECK: usize = ETH + IP + 6;

/// The IPv4 header fields a frame is built with.
#[derive(Clone, Copy, Debug)]
pub struct Header {
    /// Type of service.
    pub tos: u8,
    /// Don't fragment.
    pub df: bool,
    /// Time to live.
    pub ttl: u8,
}

impl Default for Header {
    /// What a socket sends by default: TOS 0, DF, TTL 64.
    fn default() -> Header {
        Header {
            tos: 0,
            df: true,
            ttl: 64,
        }
    }
}

/// One's complement sum of `data` as big-endian 16-bit words (an odd last byte padded), added
/// to `acc`.
pub fn sum(data: &[u8], mut acc: u32) -> u32 {
    let mut words = data.chunks_exact(2);
    for w in &mut words {
        acc += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = words.remainder() {
        acc += u32::from(*last) << 8;
    }
    acc
}

/// `acc` folded to 16 bits.
pub fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// The UDP checksum's sum of IPv4 header `ip` and UDP datagram `udp`: pseudo header, UDP
/// header and data (0xffff: the checksum in `udp` verifies).
pub fn udp_sum(ip: &[u8], udp: &[u8]) -> u16 {
    let mut pseudo = [0u8; 12];
    pseudo[..8].copy_from_slice(&ip[12..20]);
    pseudo[9] = 17;
    pseudo[10..12].copy_from_slice(&(udp.len() as u16).to_be_bytes());
    fold(sum(udp, sum(&pseudo, 0)))
}

/// An Ethernet frame (both addresses `macs`: destination, then source) carrying `payload` in
/// UDP from `src` to `dst` with IPv4 `header`, both checksums set.
pub fn frame(
    macs: [u8; 12],
    src: SocketAddrV4,
    dst: SocketAddrV4,
    payload: &[u8],
    header: Header,
) -> Vec<u8> {
    let mut f = Vec::with_capacity(ETH + IP + UDP + payload.len());
    f.extend_from_slice(&macs);
    f.extend_from_slice(&[0x08, 0x00]);
    let total = (IP + UDP + payload.len()) as u16;
    f.extend_from_slice(&[0x45, header.tos]);
    f.extend_from_slice(&total.to_be_bytes());
    let flags = if header.df { 0x40 } else { 0 };
    // Identification, flags, TTL, UDP, checksum (below).
    f.extend_from_slice(&[0x12, 0x34, flags, 0x00, header.ttl, 17, 0, 0]);
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
pub fn channel_data(channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(4 + payload.len());
    m.extend_from_slice(&channel.to_be_bytes());
    m.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    m.extend_from_slice(payload);
    m
}

/// Media-like bytes: not ChannelData (the first byte's top bits are not 01).
pub fn payload(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + 0x80) as u8).collect()
}

/// CLOCK_MONOTONIC nanoseconds, what the offload's programs compare an entry's end with.
pub fn monotonic_ns() -> u64 {
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
