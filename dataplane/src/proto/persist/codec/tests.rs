//! The codec on whole, cut, bit-flipped and random journals: it reads back what it wrote,
//! never panics, and counts what it could not read.

use super::super::tests::record;
use super::*;
use crate::proto::Family;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BOOT_ID: [u8; 16] = [9; 16];

/// A dual allocation forwarded through a sibling, with IPv4 and IPv6 permissions and channels.
fn full_record() -> AllocationRecord {
    let mut record = record("udp", "[2001:db8::7]:40000", 1_600_000_000_000);
    record.relays = record.relays.with(Family::V6, 50003);
    record.dont_fragment = true;
    record.user_id = "tenant-a".into();
    record.allocate_txid = TransactionId::from(0x0102_0304_0506_0708_090a_0b0c);
    record.allocate_response = (0..=255).collect();
    record.via = Some("10.0.0.9:9000".parse().unwrap());
    record.permissions = vec![
        PermissionRecord {
            ip: "10.1.2.3".parse().unwrap(),
            expires_at_ns: 1_300_000_000_000,
        },
        PermissionRecord {
            ip: "fd00::1".parse().unwrap(),
            expires_at_ns: 1_300_000_000_001,
        },
    ];
    record.channels = vec![ChannelRecord {
        number: 0x4001,
        peer: "[fd00::1]:5000".parse().unwrap(),
        expires_at_ns: 1_600_000_000_000,
    }];
    record
}

fn entries() -> Vec<JournalEntry> {
    vec![
        JournalEntry::Put(full_record()),
        JournalEntry::Put(record("udp", "192.0.2.1:1", 5)),
        JournalEntry::Delete {
            listener: "udp".into(),
            client: "192.0.2.1:1".parse().unwrap(),
        },
        JournalEntry::Put(record("tcp-listener", "192.0.2.2:2", 6)),
    ]
}

/// The journal of `entries`, and where each entry's frame starts and ends.
fn journal(entries: &[JournalEntry]) -> (Vec<u8>, Vec<usize>) {
    let mut out = Vec::new();
    encode_header(&JournalHeader { boot_id: BOOT_ID }, &mut out);
    let mut bounds = vec![out.len()];
    for entry in entries {
        encode_entry(entry, &mut out).unwrap();
        bounds.push(out.len());
    }
    (out, bounds)
}

#[test]
fn a_journal_reads_back_as_written() {
    let (buf, _) = journal(&entries());
    let decoded = decode(&buf).unwrap();
    assert_eq!(decoded.header, Some(JournalHeader { boot_id: BOOT_ID }));
    assert_eq!(decoded.entries, entries());
    assert_eq!((decoded.corrupt, decoded.torn), (0, 0));
    let empty = decode(&[]).unwrap();
    assert_eq!(
        (empty.header, empty.entries.len(), empty.torn),
        (None, 0, 0)
    );
}

#[test]
fn an_entry_too_large_is_refused_and_leaves_the_journal_as_it_was() {
    let mut big = record("udp", "192.0.2.1:1", 5);
    big.username = "x".repeat(usize::from(u16::MAX) + 1);
    let (mut buf, _) = journal(&entries());
    let before = buf.clone();
    assert_eq!(
        encode_entry(&JournalEntry::Put(big), &mut buf),
        Err(EncodeError::TooLarge)
    );
    assert_eq!(buf, before);
}

#[test]
fn another_magic_version_or_a_bad_header_is_an_error() {
    let (buf, _) = journal(&entries());
    let mut other = buf.clone();
    other[0] ^= 1;
    assert_eq!(decode(&other), Err(DecodeError::NotAJournal));
    assert_eq!(decode(b"{\"json\""), Err(DecodeError::NotAJournal));
    // Version 2, its header checksummed as a version-2 writer would.
    let mut v2 = buf[..28].to_vec();
    v2[8..12].copy_from_slice(&2u32.to_be_bytes());
    let crc = crc32fast::hash(&v2);
    v2.extend_from_slice(&crc.to_be_bytes());
    v2.extend_from_slice(&buf[32..]);
    assert_eq!(decode(&v2), Err(DecodeError::UnknownVersion(2)));
    let mut flipped = buf.clone();
    flipped[20] ^= 0x10;
    assert_eq!(decode(&flipped), Err(DecodeError::CorruptHeader));
}

#[test]
fn a_journal_cut_anywhere_reads_the_entries_before_the_cut() {
    let all = entries();
    let (buf, bounds) = journal(&all);
    for cut in 0..buf.len() {
        let decoded = decode(&buf[..cut]).unwrap();
        let whole = bounds
            .iter()
            .filter(|&&b| b <= cut)
            .count()
            .saturating_sub(1);
        assert_eq!(decoded.entries, all[..whole], "cut at {cut}");
        let on_a_boundary = cut == 0 || bounds.contains(&cut);
        assert_eq!(decoded.torn, usize::from(!on_a_boundary), "cut at {cut}");
        assert_eq!(decoded.corrupt, 0, "cut at {cut}");
    }
}

#[test]
fn a_flipped_bit_in_an_entry_costs_that_entry_alone() {
    let all = entries();
    let (buf, bounds) = journal(&all);
    let mut rng = StdRng::seed_from_u64(0x5eed);
    for _ in 0..4_000 {
        let bit = rng.gen_range(bounds[0] * 8..buf.len() * 8);
        let mut flipped = buf.clone();
        flipped[bit / 8] ^= 1 << (bit % 8);
        let decoded = decode(&flipped).unwrap();
        let hit = bounds
            .windows(2)
            .position(|w| (w[0]..w[1]).contains(&(bit / 8)));
        let hit = hit.unwrap();
        // The entries before the one hit read whole; the one hit is never read as another.
        assert_eq!(decoded.entries.get(..hit), Some(&all[..hit]), "bit {bit}");
        assert!(!decoded.entries.contains(&all[hit]), "bit {bit}");
        assert!(decoded.corrupt + decoded.torn >= 1, "bit {bit}");
        let frames_room = (flipped.len() - bounds[0]) / FRAME_LEN;
        assert!(
            decoded.torn <= 1 && decoded.corrupt <= frames_room,
            "bit {bit}"
        );
        // A flip in the body (not its length) lets the reading go on past it.
        if bit / 8 >= bounds[hit] + 4 {
            let mut rest = all.clone();
            rest.remove(hit);
            assert_eq!(decoded.entries, rest, "bit {bit}");
            assert_eq!((decoded.corrupt, decoded.torn), (1, 0), "bit {bit}");
        }
    }
}

#[test]
fn random_bytes_after_a_header_never_panic_and_count_sanely() {
    let (buf, bounds) = journal(&entries());
    let mut rng = StdRng::seed_from_u64(42);
    for case in 0..5_000 {
        let mut bytes = buf[..bounds[0]].to_vec();
        let len = rng.gen_range(0..600);
        match case % 3 {
            // Pure noise.
            0 => bytes.extend((0..len).map(|_| rng.gen::<u8>())),
            // Small lengths, so that frames are found and their checksums tried.
            1 => {
                for _ in 0..len / 16 {
                    let body = rng.gen_range(0u32..24);
                    bytes.extend_from_slice(&body.to_be_bytes());
                    bytes.extend((0..4 + body).map(|_| rng.gen::<u8>()));
                }
            }
            // A real journal with noise spliced in.
            _ => {
                bytes = buf.clone();
                let at = rng.gen_range(bounds[0]..bytes.len());
                let noise: Vec<u8> = (0..len % 40).map(|_| rng.gen()).collect();
                bytes.splice(at..at, noise);
            }
        }
        let decoded = decode(&bytes).unwrap();
        let frames_room = (bytes.len() - bounds[0]) / FRAME_LEN;
        assert!(
            decoded.entries.len() + decoded.corrupt <= frames_room,
            "case {case}"
        );
        assert!(decoded.torn <= 1, "case {case}");
        for entry in &decoded.entries {
            assert!(entries().contains(entry), "case {case}: {entry:?}");
        }
    }
    // Bodies cut, flipped or made up, under a checksum that matches them: the body's own
    // reading is what must hold (each read, every field).
    let mut bodies: Vec<Vec<u8>> = bounds
        .windows(2)
        .map(|w| buf[w[0] + FRAME_LEN..w[1]].to_vec())
        .collect();
    bodies.push(Vec::new());
    for case in 0..20_000 {
        let mut body = bodies[case % bodies.len()].clone();
        match case % 4 {
            0 => body.truncate(rng.gen_range(0..=body.len())),
            1 if !body.is_empty() => {
                for _ in 0..rng.gen_range(1..4) {
                    let at = rng.gen_range(0..body.len());
                    body[at] ^= 1 << rng.gen_range(0..8);
                }
            }
            2 => body.extend((0..rng.gen_range(1..8)).map(|_| rng.gen::<u8>())),
            _ => body = (0..rng.gen_range(0..64)).map(|_| rng.gen()).collect(),
        }
        let mut framed = buf[..bounds[0]].to_vec();
        let len = (body.len() as u32).to_be_bytes();
        let mut crc = crc32fast::Hasher::new();
        crc.update(&len);
        crc.update(&body);
        framed.extend_from_slice(&len);
        framed.extend_from_slice(&crc.finalize().to_be_bytes());
        framed.extend_from_slice(&body);
        let decoded = decode(&framed).unwrap();
        assert_eq!(decoded.entries.len() + decoded.corrupt, 1, "case {case}");
        assert_eq!(decoded.torn, 0, "case {case}");
        if case % 4 == 2 {
            assert_eq!(decoded.corrupt, 1, "case {case}: bytes after the entry");
        }
    }
    // Any bytes at all, header or not: an error or a reading, never a panic.
    for _ in 0..5_000 {
        let len = rng.gen_range(0..80);
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        if rng.gen_bool(0.5) {
            let keep = rng.gen_range(0..=buf.len().min(40));
            bytes.splice(0..0, buf[..keep].iter().copied());
        }
        let _ = decode(&bytes);
    }
}
