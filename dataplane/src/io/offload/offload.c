// SPDX-License-Identifier: MIT OR GPL-2.0
//
// uturn's ChannelData offload: a TC ingress program and an XDP program that relay the
// ChannelData of channels the engine bound, without waking the process (issue 20, `--offload`).
//
// client -> peer: a UDP datagram to a listener port whose payload is ChannelData of a channel in
//   `chan_out` loses its 4-byte header and leaves from the relay address to the peer.
// peer -> client: a UDP datagram to a relay port from a peer in `chan_in` gains the header and
//   leaves from the listener address to the client.
//
// Everything else (STUN, Send/Data indications, padded or malformed ChannelData, IP options,
// fragments, GSO packets, IPv6, a datagram whose UDP checksum is wrong, anything past an
// entry's end) goes up to user space untouched. User space is the authority: it installs an
// entry only for a channel the engine admitted, with the instant (CLOCK_MONOTONIC ns) at which
// the channel ends, and keeps the ends of what it depends on in `deadlines`: one word per
// allocation and one per permission (an allocation and a peer IP), so that a Refresh or a
// CreatePermission is one write however many channels share the allocation or the permission;
// it removes the entries when any of them ends or the peer is no longer admitted.
//
// The promises of the user-space relay, kept here:
// - Only datagrams addressed to this gateway are relayed: each key holds the destination
//   address as well as the port (the listener's address for client -> peer, the relay
//   address for peer -> client), so a datagram that a routing host forwards to another host on
//   an equal port is never taken.
// - What leaves looks as if the relay socket sent it: TOS 0, DF set, the host's default TTL
//   (`settings`), a fresh IP ID; nothing of the arriving header (the client's TTL, TOS or ID)
//   crosses the relay.
// - A datagram whose UDP checksum is wrong is not relayed (the stack drops it, as it would
//   before any socket): XDP checks every one; TC checks those the device did not check
//   (a locally sent datagram whose checksum is still to be completed counts as good; a
//   program cannot tell one from a wrong checksum that happens to be the pseudo header's sum,
//   once in 65 535 wrong checksums, which it relays and the stack would drop). Nor
//   is one whose IPv4 header checksum is wrong (the stack checks every header). TC passes
//   up one without a UDP checksum (zero): it cannot give it one, as a socket would; XDP
//   computes every checksum whole.
// - A client's datagram of CLIENT_MAX bytes or more goes up: user space drops it
//   (MAX_DATAGRAM in io/shard, as stunnerd), so the program must not relay it either.
//
// TC: the UDP header stays where it is and the payload moves by 4 bytes (through a per-CPU scratch
// buffer), so an skb whose checksum the device completes later (CHECKSUM_PARTIAL: loopback, veth)
// keeps a valid checksum start. Checksums are updated incrementally: the pseudo header's part
// with BPF_F_PSEUDO_HDR (the only part a partial checksum holds), the rest without it.
//
// XDP (native mode only, where the driver runs it): the same lookups, for entries that user space
// marked as sendable from XDP (it knows the next hop's and the interface's MAC addresses) and
// whose packets leave by the interface they arrived on; they go back out with XDP_TX. The
// headers move by 4 bytes (bpf_xdp_adjust_head) and are written whole, the UDP checksum computed
// over the whole datagram (an XDP frame does not say whether its checksum is complete or only the
// pseudo header's, as a veth's partial checksums are). Everything else is XDP_PASS: the TC
// program, attached too, handles it as above.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

// Keys, values and capacities: the one definition of the maps' layout, which build.rs also
// turns into the Rust types user space writes (maps.rs).
#include "offload.h"

// A client's UDP payload of this size or more is dropped by user space (MAX_DATAGRAM in
// io/shard), so it is never relayed here: ChannelData payloads of at most CLIENT_MAX - 5.
#define CLIENT_MAX 1600
_Static_assert(CLIENT_MAX - 5 <= SCRATCH - 8, "client payloads fit the scratch buffer");

// The maps user space finds by name (offload/program.rs loads the object with aya, which creates
// them from these definitions; UTURN_OFFLOAD_MAX_CHANNELS may lower the channel maps' capacity).
// The channel maps allocate entries as they are added.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct out_key);
	__type(value, struct out_value);
	__uint(max_entries, MAX_CHANNELS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} chan_out SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct in_key);
	__type(value, struct in_value);
	__uint(max_entries, MAX_CHANNELS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} chan_in SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u8[SCRATCH]);
	__uint(max_entries, 1);
} scratch SEC(".maps");

// The ends of allocations and permissions, by the indexes entries carry (0: none there).
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, MAX_DEADLINES);
} deadlines SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct settings);
	__uint(max_entries, 1);
} settings SEC(".maps");

#define ETH_LEN 14
#define IP_LEN 20
#define UDP_OFF (ETH_LEN + IP_LEN)
#define UDP_CSUM_OFF (UDP_OFF + offsetof(struct udphdr, check))
#define PAYLOAD_OFF (UDP_OFF + 8)
#define LOOPBACK_IFINDEX 1
#define IP_DF 0x4000
// Not ours: the next program attached to the interface (tcx), or the stack.
#define NEXT TC_ACT_UNSPEC
// Bytes of the datagram summed per bpf_csum_diff call (its limit).
#define CSUM_CHUNK 512

// Whether the frame is IPv4 without options carrying a whole (unfragmented) UDP datagram.
static __always_inline int plain_udp(const struct ethhdr *eth, const struct iphdr *ip)
{
	return eth->h_proto == bpf_htons(ETH_P_IP) && ip->ihl == 5 && ip->version == 4 &&
	       ip->protocol == IPPROTO_UDP && !(ip->frag_off & bpf_htons(0x3fff));
}

struct headers {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	__u16 udp_len;
	__u16 udp_check;
	__u16 tot_len;
};

// `n` (checked to be 1 or more) in a form the verifier reads as at least 1: clang merges
// `n == 0 || n > max` into one unsigned comparison, which gives the verifier no lower bound.
static __always_inline __u32 at_least_one(__u32 n)
{
	asm volatile("" : "+r"(n));
	return ((n - 1) & (SCRATCH - 1)) + 1;
}

// The 16-bit one's complement of the folded one's complement sum `sum`: a checksum field.
static __always_inline __u16 fold(__u64 sum)
{
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

// Whether the IPv4 header (20 bytes: no options) sums to zero with its checksum, as the stack
// requires of every packet it takes.
static __always_inline int ip_checksum_ok(const struct iphdr *ip)
{
	const __u16 *words = (const __u16 *)ip;
	__u64 sum = 0;
#pragma unroll
	for (int i = 0; i < IP_LEN / 2; i++)
		sum += words[i];
	return fold(sum) == 0;
}

// The one's complement sum of `buf[0..len]` (`len` a multiple of 4, at most SCRATCH), or -1.
static __always_inline __s64 sum_scratch(__u8 *buf, __u32 len)
{
	__u64 sum = 0;
#pragma unroll
	for (int i = 0; i < SCRATCH / CSUM_CHUNK; i++) {
		__u32 at = i * CSUM_CHUNK;
		if (at >= len)
			break;
		__u32 chunk = len - at;
		if (chunk > CSUM_CHUNK)
			chunk = CSUM_CHUNK;
		__s64 part = bpf_csum_diff(NULL, 0, (__be32 *)(buf + at), chunk, 0);
		if (part < 0)
			return -1;
		sum += (__u32)part;
	}
	return sum;
}

// Zero-pads `buf[at..at + n]` to a multiple of 4 bytes and returns the one's complement sum of
// `buf[0..at + n]` (RFC 768: an odd last byte is summed as if padded with zero), or -1.
static __always_inline __s64 pad_and_sum(__u8 *buf, __u32 at, __u32 n)
{
	if (n > SCRATCH - 8)
		return -1;
	__u32 len = (at + n) & (SCRATCH - 1);
	if (len > SCRATCH - 4)
		return -1;
	buf[len] = 0;
	buf[len + 1] = 0;
	buf[len + 2] = 0;
	return sum_scratch(buf, (len + 3) & ~3u);
}

// The one's complement sum of the pseudo header and UDP header of a datagram of `udp_len`
// bytes (the checksum field as `check`), or -1.
static __always_inline __s64 header_sum(__u32 saddr, __u32 daddr, __u16 sport, __u16 dport,
					__u16 udp_len, __u16 check)
{
	__u32 words[5] = {saddr, daddr, bpf_htonl(((__u32)IPPROTO_UDP << 16) | udp_len),
			  (__u32)sport | ((__u32)dport << 16),
			  (__u32)bpf_htons(udp_len) | ((__u32)check << 16)};
	return bpf_csum_diff(NULL, 0, (__be32 *)words, sizeof(words), 0);
}

// Whether the arriving datagram's UDP checksum is good, given the sum of its payload. A zero
// checksum is none (IPv4). A checksum that holds only the pseudo header's sum is one a local
// socket left for the device to complete (CHECKSUM_PARTIAL on loopback and veth): good.
static __always_inline int checksum_ok(struct headers *h, __s64 payload_sum)
{
	if (!h->udp_check)
		return 1;
	if (payload_sum < 0)
		return 0;
	__s64 head = header_sum(h->saddr, h->daddr, h->sport, h->dport, h->udp_len, h->udp_check);
	if (head < 0)
		return 0;
	if (fold((__u64)(__u32)head + (__u64)payload_sum) == 0)
		return 1;
	__u32 pseudo[3] = {h->saddr, h->daddr, bpf_htonl(((__u32)IPPROTO_UDP << 16) | h->udp_len)};
	__s64 partial = bpf_csum_diff(NULL, 0, (__be32 *)pseudo, sizeof(pseudo), 0);
	return partial >= 0 && h->udp_check == (__u16)~fold((__u32)partial);
}

// The IPv4/UDP headers of a packet this program may relay, or -1; `word`: the first 4 bytes
// of the UDP payload (0 if it is shorter).
static __always_inline int parse(struct __sk_buff *skb, struct headers *h, __u32 *word)
{
	// A frame to another host's MAC address (a promiscuous device, a veth) the stack drops.
	if (skb->protocol != bpf_htons(ETH_P_IP) || skb->gso_segs > 1 ||
	    skb->pkt_type != PACKET_HOST)
		return -1;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	// Headers and the first payload word in the linear part (a packet that is shorter is
	// pulled whole). No pointer is subtracted from another: that needs CAP_PERFMON.
	if (data + PAYLOAD_OFF + 4 > end) {
		__u32 want = skb->len < PAYLOAD_OFF + 4 ? skb->len : PAYLOAD_OFF + 4;
		if (bpf_skb_pull_data(skb, want) < 0)
			return -1;
		data = (void *)(long)skb->data;
		end = (void *)(long)skb->data_end;
	}
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ETH_LEN;
	struct udphdr *udp = data + UDP_OFF;
	if (data + PAYLOAD_OFF > end)
		return -1;
	if (!plain_udp(eth, ip) || !ip_checksum_ok(ip))
		return -1;
	h->saddr = ip->saddr;
	h->daddr = ip->daddr;
	h->sport = udp->source;
	h->dport = udp->dest;
	h->udp_len = bpf_ntohs(udp->len);
	h->udp_check = udp->check;
	h->tot_len = bpf_ntohs(ip->tot_len);
	if (h->tot_len != IP_LEN + h->udp_len || h->udp_len < 8 ||
	    skb->len != ETH_LEN + h->tot_len)
		return -1;
	*word = 0;
	if (data + PAYLOAD_OFF + 4 <= end)
		*word = *(__u32 *)(data + PAYLOAD_OFF);
	return 0;
}

// The IPv4 header a relay socket would send: TOS 0, DF, the host's TTL, a fresh ID.
static __always_inline int fresh_ip(struct iphdr *ip, __u32 saddr, __u32 daddr, __u16 tot_len)
{
	__u32 zero = 0;
	struct settings *cfg = bpf_map_lookup_elem(&settings, &zero);
	__u8 ttl = cfg && cfg->ttl ? (__u8)cfg->ttl : 64;
	__builtin_memset(ip, 0, sizeof(*ip));
	ip->version = 4;
	ip->ihl = 5;
	ip->tot_len = bpf_htons(tot_len);
	ip->id = (__u16)bpf_get_prandom_u32();
	ip->frag_off = bpf_htons(IP_DF);
	ip->ttl = ttl;
	ip->protocol = IPPROTO_UDP;
	ip->saddr = saddr;
	ip->daddr = daddr;
	__s64 sum = bpf_csum_diff(NULL, 0, (__be32 *)ip, sizeof(*ip), 0);
	if (sum < 0)
		return -1;
	ip->check = fold((__u32)sum);
	return 0;
}

// Rewrites the IPv4 header (a fresh one, `fresh_ip`) and the UDP ports, length and checksum.
// `pseudo_*`: the pseudo header's words (source, destination, length); `rest_*`: the other
// words that change (ports, UDP length, and the ChannelData header where it is added or removed).
static __always_inline int rewrite(struct __sk_buff *skb, struct headers *h, __u32 saddr,
				   __u32 daddr, __u16 sport, __u16 dport, int delta, __u32 header)
{
	__u16 udp_len = h->udp_len + delta;
	__u16 tot_len = h->tot_len + delta;
	__u32 pseudo_old[3] = {h->saddr, h->daddr, bpf_htonl(h->udp_len)};
	__u32 pseudo_new[3] = {saddr, daddr, bpf_htonl(udp_len)};
	__u32 rest_old[3] = {(__u32)h->sport | ((__u32)h->dport << 16), bpf_htonl(h->udp_len), header};
	__u32 rest_new[3] = {(__u32)sport | ((__u32)dport << 16), bpf_htonl(udp_len), header};
	if (h->udp_check) {
		__s64 diff = bpf_csum_diff(pseudo_old, sizeof(pseudo_old), pseudo_new, sizeof(pseudo_new), 0);
		if (diff < 0 ||
		    bpf_l4_csum_replace(skb, UDP_CSUM_OFF, 0, (__u32)diff,
					BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0) < 0)
			return -1;
		// The header word is in the old datagram (delta < 0) or in the new one (delta > 0).
		diff = delta < 0 ? bpf_csum_diff(rest_old, 12, rest_new, 8, 0)
				 : bpf_csum_diff(rest_old, 8, rest_new, 12, 0);
		if (diff < 0 ||
		    bpf_l4_csum_replace(skb, UDP_CSUM_OFF, 0, (__u32)diff, BPF_F_MARK_MANGLED_0) < 0)
			return -1;
	}
	// A whole new header: both it and the old one sum to zero with their checksums, so a
	// device's complete checksum of the packet (CHECKSUM_COMPLETE) stays right.
	struct iphdr ip;
	if (fresh_ip(&ip, saddr, daddr, tot_len) < 0 ||
	    bpf_skb_store_bytes(skb, ETH_LEN, &ip, sizeof(ip), 0) < 0)
		return -1;
	__u16 ports_len[3] = {sport, dport, bpf_htons(udp_len)};
	if (bpf_skb_store_bytes(skb, UDP_OFF, ports_len, 6, 0) < 0)
		return -1;
	return 0;
}

// Sends the rewritten packet on: to a local socket through the stack, or out of `ifindex`
// with L2 addresses from the neighbour table.
static __always_inline int forward(struct __sk_buff *skb, __u32 ifindex)
{
	if (ifindex)
		return bpf_redirect_neigh(ifindex, NULL, 0, 0);
	if (skb->ifindex == LOOPBACK_IFINDEX)
		return TC_ACT_OK;
	// Local, but arrived on another interface: a packet from a local address would be a
	// martian there, so it goes in through the loopback device.
	__u8 zero[12] = {};
	if (bpf_skb_store_bytes(skb, 0, zero, sizeof(zero), 0) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(LOOPBACK_IFINDEX, BPF_F_INGRESS);
}

static __always_inline void count(__u64 *packets, __u64 *bytes, __u64 *last, __u32 len, __u64 now)
{
	__sync_fetch_and_add(packets, 1);
	__sync_fetch_and_add(bytes, len);
	*last = now;
}

// Whether an entry ending at `expires_ns`, of allocation `alloc` and permission `perm`, still
// relays at `now`.
static __always_inline int live(__u64 expires_ns, __u32 alloc, __u32 perm, __u64 now)
{
	if (now >= expires_ns)
		return 0;
	__u64 *deadline = bpf_map_lookup_elem(&deadlines, &alloc);
	if (!deadline || now >= *deadline)
		return 0;
	deadline = bpf_map_lookup_elem(&deadlines, &perm);
	return deadline && now < *deadline;
}

// Whether the device already verified the datagram's checksum (CHECKSUM_UNNECESSARY).
static __always_inline int device_checked(struct __sk_buff *skb)
{
	return bpf_csum_level(skb, BPF_CSUM_LEVEL_QUERY) >= 0;
}

SEC("classifier")
int uturn_offload(struct __sk_buff *skb)
{
	struct headers h;
	__u32 word;
	if (parse(skb, &h, &word) < 0)
		return NEXT;
	// No UDP checksum (zero, allowed in IPv4): the incremental update below would leave the
	// datagram without one, where a relay socket sends one; user space relays it.
	if (!h.udp_check)
		return NEXT;
	__u32 payload = h.udp_len - 8;
	__u64 now = bpf_ktime_get_ns();
	__u32 zero = 0;

	// client -> peer: ChannelData of a bound channel, unpadded (RFC 8656 §12.5: over UDP the
	// padding is optional; a padded one goes up).
	__u16 channel = bpf_ntohs(word & 0xffff);
	__u16 length = bpf_ntohs(word >> 16);
	if ((channel & 0xc000) == 0x4000 && length + 4 == payload) {
		struct out_key key = {
			.client_ip = h.saddr,
			.listener_ip = h.daddr,
			.client_port = h.sport,
			.listener_port = h.dport,
			.channel = word & 0xffff,
		};
		struct out_value *v = bpf_map_lookup_elem(&chan_out, &key);
		if (v) {
			__u32 n = length & (SCRATCH - 1);
			__u8 *buf = bpf_map_lookup_elem(&scratch, &zero);
			// A datagram of CLIENT_MAX bytes or more goes up: user space drops it.
			if (!live(v->expires_ns, v->alloc, v->perm, now) || n != length || n == 0 ||
			    n > CLIENT_MAX - 5 || !buf)
				return NEXT;
			n = at_least_one(n);
			if (n > SCRATCH - 8)
				return NEXT;
			if (bpf_skb_load_bytes(skb, PAYLOAD_OFF + 4, buf + 4, n) < 0)
				return NEXT;
			if (!device_checked(skb)) {
				*(__u32 *)buf = word;
				if (!checksum_ok(&h, pad_and_sum(buf, 4, n)))
					return NEXT;
			}
			__u32 relay_ip = v->relay_ip, peer_ip = v->peer_ip, ifindex = v->ifindex;
			__u16 relay_port = v->relay_port, peer_port = v->peer_port;
			if (rewrite(skb, &h, relay_ip, peer_ip, relay_port, peer_port, -4, word) < 0)
				return TC_ACT_SHOT;
			if (bpf_skb_store_bytes(skb, PAYLOAD_OFF, buf + 4, n, BPF_F_RECOMPUTE_CSUM) < 0 ||
			    bpf_skb_change_tail(skb, skb->len - 4, 0) < 0)
				return TC_ACT_SHOT;
			count(&v->packets, &v->bytes, &v->last_ns, length, now);
			return forward(skb, ifindex);
		}
	}

	// peer -> client: a datagram to a relay address and port from a peer with a bound channel.
	struct in_key key = {
		.peer_ip = h.saddr,
		.relay_ip = h.daddr,
		.peer_port = h.sport,
		.relay_port = h.dport,
	};
	struct in_value *v = bpf_map_lookup_elem(&chan_in, &key);
	if (!v || !live(v->expires_ns, v->alloc, v->perm, now))
		return NEXT;
	__u32 n = payload & (SCRATCH - 1);
	__u8 *buf = bpf_map_lookup_elem(&scratch, &zero);
	if (n != payload || n == 0 || n > SCRATCH - 8 || !buf)
		return NEXT;
	n = at_least_one(n);
	if (n > SCRATCH - 8)
		return NEXT;
	__u32 listener_ip = v->listener_ip, client_ip = v->client_ip, ifindex = v->ifindex;
	__u16 listener_port = v->listener_port, client_port = v->client_port;
	__u32 header = (__u32)v->channel | ((__u32)bpf_htons(payload) << 16);
	if (bpf_skb_load_bytes(skb, PAYLOAD_OFF, buf + 4, n) < 0)
		return NEXT;
	if (!device_checked(skb)) {
		*(__u32 *)buf = 0;
		if (!checksum_ok(&h, pad_and_sum(buf, 4, n)))
			return NEXT;
	}
	if (bpf_skb_change_tail(skb, skb->len + 4, 0) < 0)
		return NEXT;
	if (rewrite(skb, &h, listener_ip, client_ip, listener_port, client_port, 4, header) < 0)
		return TC_ACT_SHOT;
	*(__u32 *)buf = header;
	if (bpf_skb_store_bytes(skb, PAYLOAD_OFF, buf, n + 4, BPF_F_RECOMPUTE_CSUM) < 0)
		return TC_ACT_SHOT;
	count(&v->packets, &v->bytes, &v->last_ns, payload, now);
	return forward(skb, ifindex);
}


// ---- XDP ----

// Copies `n` bytes of the frame from offset `from` to `buf + 4` and returns the one's
// complement sum of `buf[0..4 + n]` (the caller has put a word at `buf[0..4]`), or -1 (`n` 0
// or too big for the buffer).
static __always_inline __s64 load_and_sum(struct xdp_md *ctx, __u32 from, __u8 *buf, __u32 n)
{
	if (n == 0 || n > SCRATCH - 8)
		return -1;
	n = at_least_one(n);
	if (n > SCRATCH - 8)
		return -1;
	if (bpf_xdp_load_bytes(ctx, from, buf + 4, n) < 0)
		return -1;
	return pad_and_sum(buf, 4, n);
}

// Writes Ethernet, IPv4 (`fresh_ip`) and UDP headers at `data` (checked to hold them) for a
// datagram of `payload` bytes whose one's complement sum is `payload_sum`, from `saddr:sport`
// to `daddr:dport`.
static __always_inline int write_headers(void *data, void *end, const __u8 *macs, __u32 saddr,
					 __u32 daddr, __u16 sport, __u16 dport, __u32 payload,
					 __u64 payload_sum)
{
	if (data + PAYLOAD_OFF > end)
		return -1;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ETH_LEN;
	struct udphdr *udp = data + UDP_OFF;
	struct iphdr iph;
	if (fresh_ip(&iph, saddr, daddr, IP_LEN + 8 + payload) < 0)
		return -1;
	__s64 head = header_sum(saddr, daddr, sport, dport, 8 + payload, 0);
	if (head < 0)
		return -1;
	__u16 check = fold(payload_sum + (__u32)head);
	struct udphdr uh = {
		.source = sport,
		.dest = dport,
		.len = bpf_htons(8 + payload),
		.check = check ? check : 0xffff,
	};
	__builtin_memcpy(eth->h_dest, macs, 12);
	eth->h_proto = bpf_htons(ETH_P_IP);
	*ip = iph;
	*udp = uh;
	return 0;
}

// Whether the frame is addressed to the interface: the source address of `macs`, since XDP
// sends back out of the interface a frame came in on (the stack drops a frame to another
// host's address).
static __always_inline int to_us(const struct ethhdr *eth, const __u8 *macs)
{
	const __u8 *dst = eth->h_dest;
	return dst[0] == macs[6] && dst[1] == macs[7] && dst[2] == macs[8] && dst[3] == macs[9] &&
	       dst[4] == macs[10] && dst[5] == macs[11];
}

SEC("xdp")
int uturn_offload_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	if (data + PAYLOAD_OFF + 4 > end)
		return XDP_PASS;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ETH_LEN;
	struct udphdr *udp = data + UDP_OFF;
	if (!plain_udp(eth, ip) || !ip_checksum_ok(ip))
		return XDP_PASS;
	__u16 tot_len = bpf_ntohs(ip->tot_len);
	__u16 udp_len = bpf_ntohs(udp->len);
	if (tot_len != IP_LEN + udp_len || udp_len < 8 + 4)
		return XDP_PASS;
	// The frame is exactly the datagram, in one buffer (no padding, no fragments).
	void *last = data + ETH_LEN + tot_len;
	if (last > end || last < end)
		return XDP_PASS;
	struct headers h = {
		.saddr = ip->saddr,
		.daddr = ip->daddr,
		.sport = udp->source,
		.dport = udp->dest,
		.udp_len = udp_len,
		.udp_check = udp->check,
		.tot_len = tot_len,
	};
	__u32 payload = udp_len - 8;
	__u32 word = *(__u32 *)(data + PAYLOAD_OFF);
	__u64 now = bpf_ktime_get_ns();
	__u32 zero = 0;
	__u8 *buf = bpf_map_lookup_elem(&scratch, &zero);
	if (!buf || payload > SCRATCH - 8)
		return XDP_PASS;

	// client -> peer
	__u16 channel = bpf_ntohs(word & 0xffff);
	__u16 length = bpf_ntohs(word >> 16);
	if ((channel & 0xc000) == 0x4000 && length + 4 == payload) {
		struct out_key key = {
			.client_ip = h.saddr,
			.listener_ip = h.daddr,
			.client_port = h.sport,
			.listener_port = h.dport,
			.channel = word & 0xffff,
		};
		struct out_value *v = bpf_map_lookup_elem(&chan_out, &key);
		if (v) {
			if (!live(v->expires_ns, v->alloc, v->perm, now) || !v->xdp ||
			    v->ifindex != ctx->ingress_ifindex || length > CLIENT_MAX - 5 ||
			    !to_us(eth, v->macs))
				return XDP_PASS;
			__u32 n = length;
			// The whole arriving payload (header word included) checks the checksum; the
			// payload without it is what leaves.
			*(__u32 *)buf = word;
			__s64 whole = load_and_sum(ctx, PAYLOAD_OFF + 4, buf, n);
			if (whole < 0 || !checksum_ok(&h, whole))
				return XDP_PASS;
			__s64 sum = bpf_csum_diff((__be32 *)buf, 4, NULL, 0, (__u32)whole);
			if (sum < 0)
				return XDP_PASS;
			__u8 macs[12];
			__builtin_memcpy(macs, v->macs, 12);
			if (write_headers(data + 4, end, macs, v->relay_ip, v->peer_ip, v->relay_port,
					  v->peer_port, n, (__u32)sum) < 0)
				return XDP_PASS;
			if (bpf_xdp_adjust_head(ctx, 4) < 0)
				return XDP_DROP;
			count(&v->packets, &v->bytes, &v->last_ns, n, now);
			return XDP_TX;
		}
	}

	// peer -> client
	struct in_key key = {
		.peer_ip = h.saddr,
		.relay_ip = h.daddr,
		.peer_port = h.sport,
		.relay_port = h.dport,
	};
	struct in_value *v = bpf_map_lookup_elem(&chan_in, &key);
	if (!v || !live(v->expires_ns, v->alloc, v->perm, now) || !v->xdp ||
	    v->ifindex != ctx->ingress_ifindex || !to_us(eth, v->macs))
		return XDP_PASS;
	__u32 n = payload;
	__u32 header = (__u32)v->channel | ((__u32)bpf_htons(payload) << 16);
	*(__u32 *)buf = header;
	__s64 sum = load_and_sum(ctx, PAYLOAD_OFF, buf, n);
	if (sum < 0)
		return XDP_PASS;
	// The arriving payload is the sum without the header word.
	__s64 arrived = bpf_csum_diff((__be32 *)buf, 4, NULL, 0, (__u32)sum);
	if (arrived < 0 || !checksum_ok(&h, arrived))
		return XDP_PASS;
	__u8 macs[12];
	__builtin_memcpy(macs, v->macs, 12);
	__u32 listener_ip = v->listener_ip, client_ip = v->client_ip;
	__u16 listener_port = v->listener_port, client_port = v->client_port;
	count(&v->packets, &v->bytes, &v->last_ns, n, now);
	if (bpf_xdp_adjust_head(ctx, -4) < 0)
		return XDP_PASS;
	data = (void *)(long)ctx->data;
	end = (void *)(long)ctx->data_end;
	if (data + PAYLOAD_OFF + 4 > end)
		return XDP_DROP;
	if (write_headers(data, end, macs, listener_ip, client_ip, listener_port, client_port,
			  n + 4, (__u32)sum) < 0)
		return XDP_DROP;
	*(__u32 *)(data + PAYLOAD_OFF) = header;
	return XDP_TX;
}

char _license[] SEC("license") = "Dual MIT/GPL";
