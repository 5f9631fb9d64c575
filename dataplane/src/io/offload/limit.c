// SPDX-License-Identifier: MIT OR GPL-2.0
//
// The limits the offload's per-packet cost is measured against (benches/benches/offload.rs),
// kept out of the production object (offload.c): programs that only send every packet back
// out where it came from.

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

// TC: every packet redirected back out of its interface.
SEC("classifier")
int uturn_limit(struct __sk_buff *skb)
{
	return bpf_redirect(skb->ifindex, 0);
}

// XDP: every frame straight back out (XDP_TX).
SEC("xdp")
int uturn_limit_xdp(struct xdp_md *ctx)
{
	return XDP_TX;
}

char _license[] SEC("license") = "Dual MIT/GPL";
