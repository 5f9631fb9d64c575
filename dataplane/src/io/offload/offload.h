// SPDX-License-Identifier: MIT OR GPL-2.0
//
// The layout of the offload's maps: the one definition both sides use. `offload.c` includes
// this header; `dataplane/build.rs` reads it and generates the Rust `#[repr(C)]` types that
// user space writes and reads (`maps.rs` includes them), with the sizes and offsets asserted
// on both sides (Rust's `offset_of!`, and a C file of `_Static_assert`s that clang checks).
//
// build.rs reads a small part of C only: `struct NAME { ... };` of `__u8`, `__u16`, `__u32`
// and `__u64` fields and arrays of them, each field at its natural alignment with no implicit
// padding (a hash key is compared byte for byte, padding included: write pad fields), and
// `#define NAME NUMBER`. A comment line before a struct or a define and a comment after a
// field become the Rust doc. Anything else here fails the build, naming the line.
//
// Addresses and ports are in network byte order, times in CLOCK_MONOTONIC nanoseconds.

#ifndef UTURN_OFFLOAD_H
#define UTURN_OFFLOAD_H

#include <linux/types.h>

// Entries per direction across all shards, unless UTURN_OFFLOAD_MAX_CHANNELS says otherwise.
#define MAX_CHANNELS 262144
// Deadline words (allocations and permissions with entries) across all shards; slot 0 is never
// handed out, so an entry that names it is never live.
#define MAX_DEADLINES 262144
// Bytes of the per-CPU scratch buffer: the largest payload moved in the kernel; bigger ones go
// up to user space.
#define SCRATCH 2048

// The key of a client's ChannelData: what it arrives with.
struct out_key {
	__u32 client_ip;
	__u32 listener_ip; // the address the client sends to: one of this gateway's
	__u16 client_port;
	__u16 listener_port;
	__u16 channel; // as on the wire
	__u16 pad;
};

// Where a client's ChannelData goes, and what it relayed.
struct out_value {
	__u32 relay_ip;
	__u32 peer_ip;
	__u16 relay_port;
	__u16 peer_port;
	__u32 ifindex; // where the peer is reached; 0: this host
	__u8 macs[12]; // the Ethernet destination and source toward the peer (XDP)
	__u8 xdp; // 1: `macs` are known, XDP may send it
	__u8 pad[3];
	__u32 alloc; // the allocation's index in `deadlines`
	__u32 perm; // the permission's index in `deadlines`
	__u64 expires_ns; // when the channel ends
	__u64 packets;
	__u64 bytes; // payload bytes
	__u64 last_ns;
};

// The key of a peer's datagram: what it arrives with.
struct in_key {
	__u32 peer_ip;
	__u32 relay_ip; // the address the peer sends to: one of this gateway's
	__u16 peer_port;
	__u16 relay_port;
};

// Where a peer's datagram goes as ChannelData, and what it relayed.
struct in_value {
	__u32 listener_ip;
	__u32 client_ip;
	__u16 listener_port;
	__u16 client_port;
	__u16 channel; // as on the wire
	__u16 pad;
	__u32 ifindex; // where the client is reached; 0: this host
	__u8 macs[12]; // the Ethernet destination and source toward the client (XDP)
	__u8 xdp; // 1: `macs` are known, XDP may send it
	__u8 pad2[3];
	__u32 alloc; // the allocation's index in `deadlines`
	__u32 perm; // the permission's index in `deadlines`
	__u32 pad3;
	__u64 expires_ns; // when the channel ends
	__u64 packets;
	__u64 bytes; // payload bytes
	__u64 last_ns;
};

// What every relayed datagram gets from the host, as a socket's would.
struct settings {
	__u32 ttl; // net.ipv4.ip_default_ttl
};

#endif
