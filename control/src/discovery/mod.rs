//! Discovery: the peer addresses of KUBERNETES clusters (a Service's EndpointSlices and
//! ClusterIPs, [`kubernetes`]) and STRICT_DNS clusters (a hostname's addresses, [`dns`]). Each
//! watch or resolver is a task that reports its own update type through an outbox
//! (`crate::outbox::Outbox`); `status` is what `/status` shows of them.

pub mod dns;
pub mod kubernetes;

use crate::state::ControlState;
use serde_json::{json, Value};

/// `/status`'s `discovery` section: each watched Service (its addresses, slices, whether it is
/// listed and whether the API server answers), each STRICT_DNS hostname's addresses, and what
/// readiness still waits for.
pub(crate) fn status(state: &ControlState) -> Value {
    let services: Vec<Value> = state
        .services()
        .iter()
        .map(|(key, s)| {
            json!({
                "service": key,
                "addresses": s.addresses(),
                "terminating": s.terminating(),
                "clusterIPs": s.cluster_ips,
                "slices": s.slices.len(),
                "synced": s.synced,
                "syncTimedOut": s.sync_timed_out,
                // The discovery task words it: "unreachable, keeping last known
                // endpoints: …", or the sentence a 401 or 403 makes.
                "api": s.api_error.as_deref().unwrap_or("connected"),
            })
        })
        .collect();
    let dns: Vec<Value> = state
        .dns_names()
        .iter()
        .map(|(host, ips)| json!({"hostname": host, "addresses": ips}))
        .collect();
    json!({
        "kubernetes": services,
        "dns": dns,
        "readyWaitsFor": state.waiting_for(),
        "timeoutSeconds": state.discovery_timeout().as_secs_f64(),
    })
}
