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
// fragments, GSO packets, IPv6, anything past an entry's expiry) goes up to user space
// untouched. User space is the authority: it installs an entry only for a channel the engine
// admitted, with the instant (CLOCK_MONOTONIC ns) at which the channel, its permission or its
// allocation ends, and removes it when any of them ends or the peer is no longer admitted.
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
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

// Keys and values: the layout user space writes (dataplane/src/offload/maps.rs). Addresses and
// ports in network byte order, times in CLOCK_MONOTONIC nanoseconds.
struct out_key {
	__u32 client_ip;
	__u16 client_port;
	__u16 listener_port;
	__u16 channel; // as on the wire
	__u16 pad;
};

struct out_value {
	__u32 relay_ip;
	__u32 peer_ip;
	__u16 relay_port;
	__u16 peer_port;
	__u32 ifindex; // where the peer is reached; 0: this host
	__u8 macs[12]; // the Ethernet destination and source toward the peer (XDP)
	__u8 xdp; // 1: `macs` are known, XDP may send it
	__u8 pad[3];
	__u64 expires_ns;
	__u64 packets;
	__u64 bytes; // payload bytes
	__u64 last_ns;
};

struct in_key {
	__u32 peer_ip;
	__u16 peer_port;
	__u16 relay_port;
};

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
	__u8 pad2[7];
	__u64 expires_ns;
	__u64 packets;
	__u64 bytes; // payload bytes
	__u64 last_ns;
};

_Static_assert(sizeof(struct out_key) == 12, "out_key layout");
_Static_assert(sizeof(struct out_value) == 64, "out_value layout");
_Static_assert(sizeof(struct in_key) == 8, "in_key layout");
_Static_assert(sizeof(struct in_value) == 72, "in_value layout");

// The largest payload moved in the kernel; bigger ones go up to user space.
#define SCRATCH 2048

// Map definitions are read by name: user space creates the maps (offload/maps.rs) and points
// these symbols at them, so the declarations only name them.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct out_key);
	__type(value, struct out_value);
	__uint(max_entries, 1);
} chan_out SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct in_key);
	__type(value, struct in_value);
	__uint(max_entries, 1);
} chan_in SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u8[SCRATCH]);
	__uint(max_entries, 1);
} scratch SEC(".maps");

#define ETH_LEN 14
#define IP_LEN 20
#define UDP_OFF (ETH_LEN + IP_LEN)
#define IP_CSUM_OFF (ETH_LEN + offsetof(struct iphdr, check))
#define UDP_CSUM_OFF (UDP_OFF + offsetof(struct udphdr, check))
#define PAYLOAD_OFF (UDP_OFF + 8)
#define LOOPBACK_IFINDEX 1
// Not ours: the next program attached to the interface (tcx), or the stack.
#define NEXT TC_ACT_UNSPEC

// Whether the frame is IPv4 without options carrying a whole (unfragmented) UDP datagram.
static __always_inline int plain_udp(const struct ethhdr *eth, const struct iphdr *ip)
{
	return eth->h_proto == bpf_htons(ETH_P_IP) && ip->ihl == 5 && ip->protocol == IPPROTO_UDP &&
	       !(ip->frag_off & bpf_htons(0x3fff));
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

// The IPv4/UDP headers of a packet this program may relay, or -1; `word`: the first 4 bytes
// of the UDP payload (0 if it is shorter).
static __always_inline int parse(struct __sk_buff *skb, struct headers *h, __u32 *word)
{
	if (skb->protocol != bpf_htons(ETH_P_IP) || skb->gso_segs > 1)
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
	if (!plain_udp(eth, ip))
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

// Rewrites the IPv4 addresses and lengths and the UDP ports, length and checksum.
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
	__u32 ip_old[3] = {h->saddr, h->daddr, bpf_htonl(h->tot_len)};
	__u32 ip_new[3] = {saddr, daddr, bpf_htonl(tot_len)};
	__s64 diff = bpf_csum_diff(ip_old, sizeof(ip_old), ip_new, sizeof(ip_new), 0);
	if (diff < 0 || bpf_l3_csum_replace(skb, IP_CSUM_OFF, 0, (__u32)diff, 0) < 0)
		return -1;
	__u16 tot = bpf_htons(tot_len);
	if (bpf_skb_store_bytes(skb, ETH_LEN + offsetof(struct iphdr, tot_len), &tot, 2, 0) < 0 ||
	    bpf_skb_store_bytes(skb, ETH_LEN + offsetof(struct iphdr, saddr), &saddr, 4, 0) < 0 ||
	    bpf_skb_store_bytes(skb, ETH_LEN + offsetof(struct iphdr, daddr), &daddr, 4, 0) < 0)
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

SEC("tc")
int uturn_offload(struct __sk_buff *skb)
{
	struct headers h;
	__u32 word;
	if (parse(skb, &h, &word) < 0)
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
			.client_port = h.sport,
			.listener_port = h.dport,
			.channel = word & 0xffff,
		};
		struct out_value *v = bpf_map_lookup_elem(&chan_out, &key);
		if (v) {
			__u32 n = length & (SCRATCH - 1);
			__u8 *buf = bpf_map_lookup_elem(&scratch, &zero);
			if (now >= v->expires_ns || n != length || n == 0 || !buf)
				return NEXT;
			__u32 relay_ip = v->relay_ip, peer_ip = v->peer_ip, ifindex = v->ifindex;
			__u16 relay_port = v->relay_port, peer_port = v->peer_port;
			if (rewrite(skb, &h, relay_ip, peer_ip, relay_port, peer_port, -4, word) < 0)
				return TC_ACT_SHOT;
			if (bpf_skb_load_bytes(skb, PAYLOAD_OFF + 4, buf, n) < 0 ||
			    bpf_skb_store_bytes(skb, PAYLOAD_OFF, buf, n, BPF_F_RECOMPUTE_CSUM) < 0 ||
			    bpf_skb_change_tail(skb, skb->len - 4, 0) < 0)
				return TC_ACT_SHOT;
			count(&v->packets, &v->bytes, &v->last_ns, length, now);
			return forward(skb, ifindex);
		}
	}

	// peer -> client: a datagram to a relay port from a peer with a bound channel.
	struct in_key key = {.peer_ip = h.saddr, .peer_port = h.sport, .relay_port = h.dport};
	struct in_value *v = bpf_map_lookup_elem(&chan_in, &key);
	if (!v || now >= v->expires_ns)
		return NEXT;
	__u32 n = payload & (SCRATCH - 1);
	__u8 *buf = bpf_map_lookup_elem(&scratch, &zero);
	if (n != payload || n == 0 || n > SCRATCH - 4 || !buf)
		return NEXT;
	__u32 listener_ip = v->listener_ip, client_ip = v->client_ip, ifindex = v->ifindex;
	__u16 listener_port = v->listener_port, client_port = v->client_port;
	__u32 header = (__u32)v->channel | ((__u32)bpf_htons(payload) << 16);
	if (bpf_skb_load_bytes(skb, PAYLOAD_OFF, buf + 4, n) < 0)
		return NEXT;
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

// Bytes of the datagram summed per bpf_csum_diff call (its limit).
#define CSUM_CHUNK 512

// `n` (checked to be 1 or more) in a form the verifier reads as at least 1: clang merges
// `n == 0 || n > max` into one unsigned comparison, which gives the verifier no lower bound.
static __always_inline __u32 at_least_one(__u32 n)
{
	asm volatile("" : "+r"(n));
	return ((n - 1) & (SCRATCH - 1)) + 1;
}

static __always_inline __u16 fold(__u64 sum)
{
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
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

// Copies `n` bytes of the frame from offset `from` to `buf + at` (`at`: 0 or 4) and returns the
// one's complement sum of `buf[0..at + n]`, or -1 (`n` 0 or too big for the buffer).
static __always_inline __s64 load_and_sum(struct xdp_md *ctx, __u32 from, __u8 *buf, __u32 at,
					  __u32 n)
{
	if (n == 0 || n > SCRATCH - 8)
		return -1;
	n = at_least_one(n);
	if (n > SCRATCH - 8)
		return -1;
	if (bpf_xdp_load_bytes(ctx, from, buf + at, n) < 0)
		return -1;
	// Zero padding to a multiple of 4 bytes sums as RFC 768's padding of an odd last byte.
	__u32 len = at + n;
	buf[len] = 0;
	buf[len + 1] = 0;
	buf[len + 2] = 0;
	return sum_scratch(buf, (len + 3) & ~3u);
}

// Writes Ethernet, IPv4 and UDP headers at `data` (checked to hold them) for a datagram of
// `payload` bytes whose one's complement sum is `payload_sum`, from `saddr:sport` to
// `daddr:dport`; `old` is the arriving IPv4 header (its other fields are kept).
static __always_inline int write_headers(void *data, void *end, const __u8 *macs,
					 struct iphdr *old, __u32 saddr, __u32 daddr,
					 __u16 sport, __u16 dport, __u32 payload,
					 __u64 payload_sum)
{
	if (data + PAYLOAD_OFF > end)
		return -1;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ETH_LEN;
	struct udphdr *udp = data + UDP_OFF;
	struct iphdr iph = *old;
	iph.tot_len = bpf_htons(IP_LEN + 8 + payload);
	iph.saddr = saddr;
	iph.daddr = daddr;
	iph.check = 0;
	__s64 ipsum = bpf_csum_diff(NULL, 0, (__be32 *)&iph, sizeof(iph), 0);
	if (ipsum < 0)
		return -1;
	iph.check = fold((__u32)ipsum);
	struct udphdr uh = {
		.source = sport,
		.dest = dport,
		.len = bpf_htons(8 + payload),
		.check = 0,
	};
	// Pseudo header (source, destination, protocol, UDP length) and the UDP header.
	__u32 words[5] = {saddr, daddr, bpf_htonl(((__u32)IPPROTO_UDP << 16) | (8 + payload)), 0, 0};
	__builtin_memcpy(&words[3], &uh, 8);
	__s64 head = bpf_csum_diff(NULL, 0, (__be32 *)words, sizeof(words), 0);
	if (head < 0)
		return -1;
	__u16 check = fold(payload_sum + (__u32)head);
	uh.check = check ? check : 0xffff;
	__builtin_memcpy(eth->h_dest, macs, 12);
	eth->h_proto = bpf_htons(ETH_P_IP);
	*ip = iph;
	*udp = uh;
	return 0;
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
	if (!plain_udp(eth, ip))
		return XDP_PASS;
	__u16 tot_len = bpf_ntohs(ip->tot_len);
	__u16 udp_len = bpf_ntohs(udp->len);
	if (tot_len != IP_LEN + udp_len || udp_len < 8 + 4)
		return XDP_PASS;
	// The frame is exactly the datagram, in one buffer (no padding, no fragments).
	void *last = data + ETH_LEN + tot_len;
	if (last > end || last < end)
		return XDP_PASS;
	__u32 payload = udp_len - 8;
	__u32 word = *(__u32 *)(data + PAYLOAD_OFF);
	struct iphdr old = *ip;
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
			.client_ip = old.saddr,
			.client_port = udp->source,
			.listener_port = udp->dest,
			.channel = word & 0xffff,
		};
		struct out_value *v = bpf_map_lookup_elem(&chan_out, &key);
		if (v) {
			if (now >= v->expires_ns || !v->xdp || v->ifindex != ctx->ingress_ifindex)
				return XDP_PASS;
			__u32 n = length;
			__s64 sum = load_and_sum(ctx, PAYLOAD_OFF + 4, buf, 0, n);
			if (sum < 0)
				return XDP_PASS;
			__u8 macs[12];
			__builtin_memcpy(macs, v->macs, 12);
			if (write_headers(data + 4, end, macs, &old, v->relay_ip, v->peer_ip,
					  v->relay_port, v->peer_port, n, sum) < 0)
				return XDP_PASS;
			if (bpf_xdp_adjust_head(ctx, 4) < 0)
				return XDP_DROP;
			count(&v->packets, &v->bytes, &v->last_ns, n, now);
			return XDP_TX;
		}
	}

	// peer -> client
	struct in_key key = {.peer_ip = old.saddr, .peer_port = udp->source, .relay_port = udp->dest};
	struct in_value *v = bpf_map_lookup_elem(&chan_in, &key);
	if (!v || now >= v->expires_ns || !v->xdp || v->ifindex != ctx->ingress_ifindex)
		return XDP_PASS;
	__u32 n = payload;
	__u32 header = (__u32)v->channel | ((__u32)bpf_htons(payload) << 16);
	*(__u32 *)buf = header;
	__s64 sum = load_and_sum(ctx, PAYLOAD_OFF, buf, 4, n);
	if (sum < 0)
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
	if (write_headers(data, end, macs, &old, listener_ip, client_ip, listener_port,
			  client_port, n + 4, sum) < 0)
		return XDP_DROP;
	*(__u32 *)(data + PAYLOAD_OFF) = header;
	return XDP_TX;
}

// The XDP limit: every frame straight back out where it came from.
SEC("xdp/limit")
int uturn_limit_xdp(struct xdp_md *ctx)
{
	return XDP_TX;
}

char _license[] SEC("license") = "Dual MIT/GPL";

// The limit the offload's per-packet cost is measured against (benches/benches/offload.rs):
// a program that only sends every packet back out where it came from.
SEC("tc/limit")
int uturn_limit(struct __sk_buff *skb)
{
	return bpf_redirect(skb->ifindex, 0);
}
