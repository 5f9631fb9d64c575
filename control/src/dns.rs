//! STRICT_DNS clusters: each hostname is re-resolved every 5 s on the control thread's
//! blocking pool (never on a shard). A failed lookup keeps the last addresses.

use crate::Event;
use std::net::IpAddr;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;

/// How often a STRICT_DNS hostname is resolved again.
pub const RESOLVE_PERIOD: Duration = Duration::from_secs(5);

/// Resolves `hostname` every [`RESOLVE_PERIOD`] and sends the address set when it changes.
pub async fn resolve_forever(hostname: String, events: UnboundedSender<Event>) {
    let mut last: Option<Vec<IpAddr>> = None;
    let mut failing = false;
    while !events.is_closed() {
        match tokio::net::lookup_host((hostname.as_str(), 0)).await {
            Ok(addrs) => {
                let mut ips: Vec<IpAddr> = addrs.map(|a| a.ip()).collect();
                ips.sort();
                ips.dedup();
                if failing {
                    tracing::info!(target: "stunner", "STRICT_DNS {hostname:?} resolves again");
                    failing = false;
                }
                if last.as_ref() != Some(&ips) {
                    tracing::debug!(target: "stunner", "STRICT_DNS {hostname:?} resolved to {ips:?}");
                    last = Some(ips.clone());
                    let _ = events.send(Event::Dns(hostname.clone(), ips));
                }
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(target: "stunner", "cannot resolve STRICT_DNS endpoint {hostname:?}: {e}; keeping its last addresses");
                    failing = true;
                }
            }
        }
        tokio::time::sleep(RESOLVE_PERIOD).await;
    }
}
