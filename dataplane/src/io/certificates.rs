//! How long each TURN-TLS and TURN-DTLS listener's certificate stays valid. A listener serves
//! whatever certificate its config carries (refusing an expired one would close the port on
//! clients that do not verify it), so expiry is made visible instead: a config that brings a
//! certificate that has expired, or expires within [`EXPIRY_WARNING`], is logged when it is
//! applied, and every scrape exports each certificate's end of validity as a gauge for an
//! alert (`uturn_listener_certificate_expiry_timestamp_seconds{name} - time() < 7 * 86400`).

use super::tls::certificate_expiry;
use metrics::{describe_gauge, gauge};
use std::sync::Mutex;
use uturn_shared::config::{ListenerProtocol, StunnerConfig};

/// A certificate this close to its end is logged as a warning when a config brings it.
pub const EXPIRY_WARNING: i64 = 14 * 86_400;

/// The gauge: when each listener's certificate stops being valid, in Unix seconds.
pub const EXPIRY_METRIC: &str = "uturn_listener_certificate_expiry_timestamp_seconds";

/// The certificates of the running config's TLS and DTLS listeners: (listener name, end of
/// validity in Unix seconds).
#[derive(Debug, Default)]
pub struct CertificateExpiry {
    listeners: Mutex<Vec<(String, i64)>>,
}

impl CertificateExpiry {
    /// Nothing seen yet.
    pub fn new() -> CertificateExpiry {
        CertificateExpiry::default()
    }

    /// Takes the certificates of `config` (applied at `now`, Unix seconds) and logs each one
    /// that is new or changed and has expired or expires within [`EXPIRY_WARNING`].
    pub fn observe(&self, config: &StunnerConfig, now: i64) {
        let mut seen = Vec::new();
        for (index, listener) in config.listeners.iter().enumerate() {
            let secure = matches!(
                config.listener_protocol(listener),
                Some(ListenerProtocol::TurnTls | ListenerProtocol::TurnDtls)
            );
            // A certificate that does not parse was refused before the config was applied.
            let Some(until) = secure.then(|| certificate_expiry(&listener.cert)).flatten() else {
                continue;
            };
            seen.push((listener.name.clone(), until));
            let known = self
                .listeners
                .lock()
                .is_ok_and(|known| known.contains(&(listener.name.clone(), until)));
            if known {
                continue;
            }
            let at = openssl::asn1::Asn1Time::from_unix(until as libc::time_t)
                .map_or_else(|_| until.to_string(), |t| t.to_string());
            let days = (until - now).abs() / 86_400;
            let field = format!("listeners[{index}].cert");
            if until <= now {
                tracing::error!(
                    target: "stunner",
                    "listener {:?} ({}): its certificate expired {days} days ago ({at}): clients \
                     that verify it (browsers) fail the handshake; renew it and update {field}",
                    listener.name,
                    listener.protocol.as_str(),
                );
            } else if until - now < EXPIRY_WARNING {
                tracing::warn!(
                    target: "stunner",
                    "listener {:?} ({}): its certificate expires in {days} days ({at}); renew it \
                     and update {field}",
                    listener.name,
                    listener.protocol.as_str(),
                );
            }
        }
        if let Ok(mut known) = self.listeners.lock() {
            *known = seen;
        }
    }

    /// Sets the gauge of every certificate of the running config (one that is not set again
    /// leaves the metrics page: the page drops gauges that no scrape sets).
    pub fn record(&self, recorder: &dyn metrics::Recorder) {
        let Ok(known) = self.listeners.lock() else {
            return;
        };
        metrics::with_local_recorder(recorder, || {
            describe_gauge!(
                EXPIRY_METRIC,
                "When a TURN-TLS or TURN-DTLS listener's certificate stops being valid (Unix \
                 seconds)"
            );
            for (name, until) in known.iter() {
                gauge!(EXPIRY_METRIC, "name" => name.clone()).set(*until as f64);
            }
        });
    }
}
