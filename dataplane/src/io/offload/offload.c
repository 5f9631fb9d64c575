// SPDX-License-Identifier: MIT OR GPL-2.0
//
// uturn's ChannelData offload: a TC ingress program that relays the ChannelData of channels the
// engine bound, without waking the process (issue 20, `--offload tc`).
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
// The UDP header stays where it is and the payload moves by 4 bytes (through a per-CPU scratch
// buffer), so an skb whose checksum the device completes later (CHECKSUM_PARTIAL: loopback, veth)
// keeps a valid checksum start. Checksums are updated incrementally: the pseudo header's part
// with BPF_F_PSEUDO_HDR (the only part a partial checksum holds), the rest without it.

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
	__u32 pad2;
	__u64 expires_ns;
	__u64 packets;
	__u64 bytes; // payload bytes
	__u64 last_ns;
};

_Static_assert(sizeof(struct out_key) == 12, "out_key layout");
_Static_assert(sizeof(struct out_value) == 48, "out_value layout");
_Static_assert(sizeof(struct in_key) == 8, "in_key layout");
_Static_assert(sizeof(struct in_value) == 56, "in_value layout");

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
	if (eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != 5 || ip->protocol != IPPROTO_UDP ||
	    (ip->frag_off & bpf_htons(0x3fff)))
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

char _license[] SEC("license") = "Dual MIT/GPL";

// The limit the offload's per-packet cost is measured against (benches/benches/offload.rs):
// a program that only sends every packet back out where it came from.
SEC("tc/limit")
int uturn_limit(struct __sk_buff *skb)
{
	return bpf_redirect(skb->ifindex, 0);
}
