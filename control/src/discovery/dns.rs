//! STRICT_DNS clusters: each hostname is re-resolved every 5 s on the control thread's
//! blocking pool (never on a shard). A failed lookup keeps the last addresses.

use crate::outbox::Outbox;
use std::net::IpAddr;
use std::time::Duration;

/// How often a STRICT_DNS hostname is resolved again.
pub const RESOLVE_PERIOD: Duration = Duration::from_secs(5);

/// What a resolver reports: the addresses a hostname resolves to now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsUpdate {
    /// The STRICT_DNS hostname.
    pub hostname: String,
    /// Its addresses, sorted, without duplicates.
    pub addresses: Vec<IpAddr>,
}

/// Resolves `hostname` with the system resolver every [`RESOLVE_PERIOD`] and sends the
/// address set when it changes.
pub async fn resolve_forever(hostname: String, updates: Outbox<DnsUpdate>) {
    resolve_with(hostname, updates, RESOLVE_PERIOD, |host| async move {
        tokio::net::lookup_host((host.as_str(), 0))
            .await
            .map(|addrs| addrs.map(|a| a.ip()).collect())
    })
    .await
}

/// Resolves `hostname` with `lookup` every `period` and sends the address set when it
/// changes; a failed lookup keeps the last set.
pub async fn resolve_with<F, Fut>(
    hostname: String,
    updates: Outbox<DnsUpdate>,
    period: Duration,
    lookup: F,
) where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = std::io::Result<Vec<IpAddr>>>,
{
    let mut last: Option<Vec<IpAddr>> = None;
    let mut failing = false;
    while !updates.is_closed() {
        match lookup(hostname.clone()).await {
            Ok(mut ips) => {
                ips.sort();
                ips.dedup();
                if failing {
                    tracing::info!(target: "stunner", "STRICT_DNS {hostname:?} resolves again");
                    failing = false;
                }
                if last.as_ref() != Some(&ips) {
                    tracing::debug!(target: "stunner", "STRICT_DNS {hostname:?} resolved to {ips:?}");
                    last = Some(ips.clone());
                    let _ = updates.send(DnsUpdate {
                        hostname: hostname.clone(),
                        addresses: ips,
                    });
                }
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(target: "stunner", "cannot resolve STRICT_DNS endpoint {hostname:?}: {e}; keeping its last addresses");
                    failing = true;
                }
            }
        }
        tokio::time::sleep(period).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn re_resolves_and_keeps_the_last_addresses_on_failure() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let calls = Arc::new(AtomicUsize::new(0));
        let answers: Vec<std::io::Result<Vec<IpAddr>>> = vec![
            Ok(vec!["10.0.0.1".parse().unwrap()]),
            Ok(vec!["10.0.0.1".parse().unwrap()]),
            Err(std::io::Error::other("SERVFAIL")),
            Ok(vec![
                "10.0.0.2".parse().unwrap(),
                "10.0.0.1".parse().unwrap(),
            ]),
        ];
        let answers = Arc::new(std::sync::Mutex::new(answers.into_iter()));
        let counter = calls.clone();
        let task = resolve_with(
            "media.example".into(),
            Outbox::new(tx),
            Duration::from_millis(10),
            move |_| {
                counter.fetch_add(1, Ordering::Relaxed);
                let next = answers.lock().unwrap().next();
                async move {
                    next.unwrap_or_else(|| {
                        Ok(vec![
                            "10.0.0.2".parse().unwrap(),
                            "10.0.0.1".parse().unwrap(),
                        ])
                    })
                }
            },
        );
        let sets = runtime.block_on(async {
            let handle = tokio::spawn(task);
            let mut sets = Vec::new();
            while sets.len() < 2 {
                if let Some(DnsUpdate { addresses, .. }) = rx.recv().await {
                    sets.push(addresses);
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            handle.abort();
            sets
        });
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(sets[0], vec![ip("10.0.0.1")]);
        assert_eq!(
            sets[1],
            vec![ip("10.0.0.1"), ip("10.0.0.2")],
            "a change after a failure"
        );
        assert!(rx.try_recv().is_err(), "an unchanged answer was sent again");
        assert!(
            calls.load(Ordering::Relaxed) >= 5,
            "not re-resolved periodically"
        );
    }
}
