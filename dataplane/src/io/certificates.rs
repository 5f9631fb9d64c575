//! How long each TURN-TLS and TURN-DTLS listener's certificate stays valid. A listener serves
//! whatever certificate its config carries (refusing an expired one would close the port on
//! clients that do not verify it), so expiry is made visible instead: a certificate is logged
//! when a config brings it expired or ending within [`EXPIRY_WARNING`], and again when, still
//! served, it crosses into either; every scrape exports each certificate's end of validity as
//! a gauge for an alert (`uturn_listener_certificate_expiry_timestamp_seconds{name} - time() <
//! 7 * 86400`).

use super::tls::certificate_expiry;
use metrics::{describe_gauge, gauge};
use std::sync::Mutex;
use uturn_shared::config::{ListenerProtocol, StunnerConfig};

/// A certificate this close to its end is logged as a warning.
pub const EXPIRY_WARNING: i64 = 14 * 86_400;

/// The gauge: when each listener's certificate stops being valid, in Unix seconds.
pub const EXPIRY_METRIC: &str = "uturn_listener_certificate_expiry_timestamp_seconds";

/// Where a certificate stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    Valid,
    EndingSoon,
    Expired,
}

impl Standing {
    fn at(until: i64, now: i64) -> Standing {
        if until <= now {
            Standing::Expired
        } else if until - now < EXPIRY_WARNING {
            Standing::EndingSoon
        } else {
            Standing::Valid
        }
    }
}

/// One served certificate.
#[derive(Debug)]
struct Served {
    listener: String,
    protocol: &'static str,
    /// Its index in the config's listeners, for the field to update.
    index: usize,
    /// End of validity, Unix seconds.
    until: i64,
    /// What was last logged of it (`None`: nothing yet).
    logged: Option<Standing>,
}

impl Served {
    /// Logs where it stands at `now` if that changed since it was last logged.
    fn log_if_changed(&mut self, now: i64) {
        let standing = Standing::at(self.until, now);
        if self.logged == Some(standing) {
            return;
        }
        self.logged = Some(standing);
        let at = openssl::asn1::Asn1Time::from_unix(self.until as libc::time_t)
            .map_or_else(|_| self.until.to_string(), |t| t.to_string());
        let days = (self.until - now).abs() / 86_400;
        let (listener, protocol, index) = (&self.listener, self.protocol, self.index);
        match standing {
            Standing::Valid => {}
            Standing::Expired => tracing::error!(
                target: "stunner",
                "listener {listener:?} ({protocol}): its certificate expired {days} days ago \
                 ({at}): clients that verify it (browsers) fail the handshake; renew it and \
                 update listeners[{index}].cert",
            ),
            Standing::EndingSoon => tracing::warn!(
                target: "stunner",
                "listener {listener:?} ({protocol}): its certificate expires in {days} days \
                 ({at}); renew it and update listeners[{index}].cert",
            ),
        }
    }
}

/// The certificates of the running config's TLS and DTLS listeners.
#[derive(Debug, Default)]
pub struct CertificateExpiry {
    served: Mutex<Vec<Served>>,
}

impl CertificateExpiry {
    /// Nothing served yet.
    pub fn new() -> CertificateExpiry {
        CertificateExpiry::default()
    }

    /// Takes the certificates of `config`, applied at `now` (Unix seconds), and logs each one
    /// that is new or changed and has expired or ends within [`EXPIRY_WARNING`].
    pub fn observe(&self, config: &StunnerConfig, now: i64) {
        let Ok(mut served) = self.served.lock() else {
            return;
        };
        let mut next = Vec::new();
        for (index, listener) in config.listeners.iter().enumerate() {
            let secure = matches!(
                config.listener_protocol(listener),
                Some(ListenerProtocol::TurnTls | ListenerProtocol::TurnDtls)
            );
            // A certificate that does not parse was refused before the config was applied.
            let Some(until) = secure.then(|| certificate_expiry(&listener.cert)).flatten() else {
                continue;
            };
            // The same certificate on the same listener keeps what was logged of it.
            let logged = served
                .iter()
                .find(|s| s.listener == listener.name && s.until == until)
                .and_then(|s| s.logged);
            let mut certificate = Served {
                listener: listener.name.clone(),
                protocol: listener.protocol.as_str(),
                index,
                until,
                logged,
            };
            certificate.log_if_changed(now);
            next.push(certificate);
        }
        *served = next;
    }

    /// Logs each served certificate that expired, or came within [`EXPIRY_WARNING`] of its
    /// end, since it was last logged (call it now and then: a certificate ages while the
    /// config stays).
    pub fn recheck(&self, now: i64) {
        if let Ok(mut served) = self.served.lock() {
            for certificate in served.iter_mut() {
                certificate.log_if_changed(now);
            }
        }
    }

    /// Sets the gauge of every certificate of the running config (one that is not set again
    /// leaves the metrics page: the page drops gauges that no scrape sets).
    pub fn record(&self, recorder: &dyn metrics::Recorder) {
        let Ok(served) = self.served.lock() else {
            return;
        };
        metrics::with_local_recorder(recorder, || {
            describe_gauge!(
                EXPIRY_METRIC,
                "When a TURN-TLS or TURN-DTLS listener's certificate stops being valid (Unix \
                 seconds)"
            );
            for certificate in served.iter() {
                gauge!(EXPIRY_METRIC, "name" => certificate.listener.clone())
                    .set(certificate.until as f64);
            }
        });
    }
}
