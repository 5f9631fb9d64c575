//! How long each TURN-TLS and TURN-DTLS listener's certificate chain stays valid. A listener
//! serves whatever certificate its config carries (refusing an expired or not-yet-valid one
//! would close the port on clients that do not verify it), so its validity is made visible
//! instead. Every certificate of the chain counts (the leaf and the intermediates after it):
//! the chain ends with the first of them to end, and is valid only once the last of them to
//! start has. A chain is logged when a config brings it expired, ending within
//! [`EXPIRY_WARNING`] or not yet valid, and again when, still served, it crosses into either
//! or becomes valid; every scrape exports each chain's end of validity as a gauge for an alert
//! (`uturn_listener_certificate_expiry_timestamp_seconds{name} - time() < 7 * 86400`).

use super::tls::{certificate_chain, ChainCertificate};
use metrics::{describe_gauge, gauge};
use std::sync::Mutex;
use tracing::Level;
use uturn_shared::config::{ListenerProtocol, StunnerConfig};

/// A certificate this close to its end is logged as a warning.
pub const EXPIRY_WARNING: i64 = 14 * 86_400;

/// The gauge: when each listener's certificate chain stops being valid (the earliest notAfter
/// of its certificates), in Unix seconds.
pub const EXPIRY_METRIC: &str = "uturn_listener_certificate_expiry_timestamp_seconds";

/// Where a chain stands towards its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    Valid,
    EndingSoon,
    Expired,
}

impl Expiry {
    fn at(until: i64, now: i64) -> Expiry {
        if until <= now {
            Expiry::Expired
        } else if until - now < EXPIRY_WARNING {
            Expiry::EndingSoon
        } else {
            Expiry::Valid
        }
    }
}

/// Where a chain stands: towards its end, and whether a certificate of it is not valid yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Standing {
    expiry: Expiry,
    pending: bool,
}

/// A line to log.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Notice {
    level: Level,
    text: String,
}

impl Notice {
    fn log(&self) {
        let text = &self.text;
        match self.level {
            Level::ERROR => tracing::error!(target: "stunner", "{text}"),
            Level::WARN => tracing::warn!(target: "stunner", "{text}"),
            _ => tracing::info!(target: "stunner", "{text}"),
        }
    }
}

/// One served certificate chain.
#[derive(Debug)]
struct Served {
    listener: String,
    protocol: &'static str,
    /// Its index in the config's listeners, for the field to update.
    index: usize,
    /// Its certificates, the leaf first.
    chain: Vec<ChainCertificate>,
    /// The position in `chain` of the certificate that ends first (the leaf on a tie).
    ending: usize,
    /// The position in `chain` of the certificate that starts last (the leaf on a tie).
    starting: usize,
    /// What was last logged of it (`None`: nothing yet).
    logged: Option<Standing>,
}

/// A Unix time as openssl prints certificate times (`Jan  2 03:04:05 2026 GMT`).
fn timestamp(unix: i64) -> String {
    openssl::asn1::Asn1Time::from_unix(unix as libc::time_t)
        .map_or_else(|_| unix.to_string(), |t| t.to_string())
}

impl Served {
    fn new(
        listener: String,
        protocol: &'static str,
        index: usize,
        chain: Vec<ChainCertificate>,
    ) -> Served {
        let ending = (0..chain.len())
            .min_by_key(|&i| chain[i].not_after)
            .unwrap_or(0);
        let starting = (0..chain.len())
            .min_by_key(|&i| std::cmp::Reverse(chain[i].not_before))
            .unwrap_or(0);
        Served {
            listener,
            protocol,
            index,
            chain,
            ending,
            starting,
            logged: None,
        }
    }

    /// When the chain stops being valid: the earliest notAfter of its certificates.
    fn until(&self) -> i64 {
        self.chain.get(self.ending).map_or(0, |c| c.not_after)
    }

    /// When the chain becomes valid: the latest notBefore of its certificates.
    fn from(&self) -> i64 {
        self.chain.get(self.starting).map_or(0, |c| c.not_before)
    }

    fn standing(&self, now: i64) -> Standing {
        Standing {
            expiry: Expiry::at(self.until(), now),
            pending: self.from() > now,
        }
    }

    /// Which certificate of the chain is meant (at `position`), for a log line: `does` says
    /// what makes it the one (`the first to end`) when the chain has more than one.
    fn which(&self, position: usize, does: &str) -> String {
        let subject = self.chain.get(position).map_or("", |c| c.subject.as_str());
        match self.chain.len() {
            1 => format!("the leaf, subject {subject:?}"),
            n => {
                let role = if position == 0 {
                    "the leaf"
                } else {
                    "an intermediate"
                };
                format!(
                    "of the {n} certificates in the chain, {does}: certificate {} ({role}), \
                     subject {subject:?}",
                    position + 1
                )
            }
        }
    }

    /// What to log of where it stands at `now`, if that changed since it was last logged.
    fn news(&mut self, now: i64) -> Vec<Notice> {
        let standing = self.standing(now);
        let before = self.logged.replace(standing);
        let mut news = Vec::new();
        if before == Some(standing) {
            return news;
        }
        let (listener, protocol, index) = (&self.listener, self.protocol, self.index);
        let was_pending = before.is_some_and(|b| b.pending);
        if standing.pending && !was_pending {
            let from = self.from();
            let (at, days) = (timestamp(from), (from - now) / 86_400);
            let which = self.which(self.starting, "the last to become valid");
            news.push(Notice {
                level: Level::ERROR,
                text: format!(
                    "listener {listener:?} ({protocol}): its certificate is not valid until {at} \
                     (in {days} days; {which}): clients that verify it (browsers) refuse it \
                     until then; check the issuer's clock and this host's, or issue it with a \
                     notBefore in the past, and update listeners[{index}].cert"
                ),
            });
        } else if !standing.pending && was_pending {
            let at = timestamp(self.from());
            news.push(Notice {
                level: Level::INFO,
                text: format!(
                    "listener {listener:?} ({protocol}): its certificate became valid ({at}): \
                     clients that verify it accept it from now on"
                ),
            });
        }
        if before.map(|b| b.expiry) != Some(standing.expiry) {
            let until = self.until();
            let (at, days) = (timestamp(until), (until - now).abs() / 86_400);
            let which = self.which(self.ending, "the first to end");
            match standing.expiry {
                Expiry::Valid => {}
                Expiry::Expired => news.push(Notice {
                    level: Level::ERROR,
                    text: format!(
                        "listener {listener:?} ({protocol}): its certificate expired {days} days \
                         ago ({at}; {which}): clients that verify it (browsers) fail the \
                         handshake; renew it and update listeners[{index}].cert"
                    ),
                }),
                Expiry::EndingSoon => news.push(Notice {
                    level: Level::WARN,
                    text: format!(
                        "listener {listener:?} ({protocol}): its certificate expires in {days} \
                         days ({at}; {which}); renew it and update listeners[{index}].cert"
                    ),
                }),
            }
        }
        news
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

    /// Takes the certificate chains of `config`, applied at `now` (Unix seconds), and logs
    /// each one that is new or changed and has expired, ends within [`EXPIRY_WARNING`] or is
    /// not valid yet.
    pub fn observe(&self, config: &StunnerConfig, now: i64) {
        self.observe_news(config, now).iter().for_each(Notice::log);
    }

    fn observe_news(&self, config: &StunnerConfig, now: i64) -> Vec<Notice> {
        let Ok(mut served) = self.served.lock() else {
            return Vec::new();
        };
        let mut news = Vec::new();
        let mut next = Vec::new();
        for (index, listener) in config.listeners.iter().enumerate() {
            let secure = matches!(
                config.listener_protocol(listener),
                Some(ListenerProtocol::TurnTls | ListenerProtocol::TurnDtls)
            );
            // A certificate that does not parse was refused before the config was applied.
            let Some(chain) = secure.then(|| certificate_chain(&listener.cert)).flatten() else {
                continue;
            };
            // The same chain on the same listener keeps what was logged of it.
            let logged = served
                .iter()
                .find(|s| s.listener == listener.name && s.chain == chain)
                .and_then(|s| s.logged);
            let mut certificate = Served::new(
                listener.name.clone(),
                listener.protocol.as_str(),
                index,
                chain,
            );
            certificate.logged = logged;
            news.extend(certificate.news(now));
            next.push(certificate);
        }
        *served = next;
        news
    }

    /// Logs each served chain that expired, came within [`EXPIRY_WARNING`] of its end, or
    /// became valid, since it was last logged (call it now and then: a certificate ages while
    /// the config stays).
    pub fn recheck(&self, now: i64) {
        self.recheck_news(now).iter().for_each(Notice::log);
    }

    fn recheck_news(&self, now: i64) -> Vec<Notice> {
        let Ok(mut served) = self.served.lock() else {
            return Vec::new();
        };
        served
            .iter_mut()
            .flat_map(|certificate| certificate.news(now))
            .collect()
    }

    /// Sets the gauge of every certificate chain of the running config, its earliest notAfter
    /// (one that is not set again leaves the metrics page: the page drops gauges that no
    /// scrape sets).
    pub fn record(&self, recorder: &dyn metrics::Recorder) {
        let Ok(served) = self.served.lock() else {
            return;
        };
        metrics::with_local_recorder(recorder, || {
            describe_gauge!(
                EXPIRY_METRIC,
                "When a TURN-TLS or TURN-DTLS listener's certificate chain stops being valid: \
                 the earliest notAfter of its certificates (Unix seconds)"
            );
            for certificate in served.iter() {
                gauge!(EXPIRY_METRIC, "name" => certificate.listener.clone())
                    .set(certificate.until() as f64);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::tls::{certificate_between, Issuer};
    use base64::Engine as _;
    use uturn_shared::config::parse_config;

    const DAY: i64 = 86_400;
    /// The tests' present.
    const NOW: i64 = 1_700_000_000;

    fn b64(pem: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(pem)
    }

    /// A chain PEM (leaf, then intermediate) and the leaf's key: the leaf valid over `leaf`,
    /// the intermediate (CN=uturn test intermediate) over `intermediate`, under a root valid
    /// for years.
    fn chain(leaf: (i64, i64), intermediate: (i64, i64)) -> (String, String) {
        let (root, root_key) = certificate_between(
            "uturn test root",
            NOW - 900 * DAY,
            NOW + 900 * DAY,
            None,
            true,
        )
        .unwrap();
        let by_root = Issuer {
            cert: &root,
            key: &root_key,
        };
        let (middle, middle_key) = certificate_between(
            "uturn test intermediate",
            intermediate.0,
            intermediate.1,
            Some(by_root),
            true,
        )
        .unwrap();
        let by_middle = Issuer {
            cert: &middle,
            key: &middle_key,
        };
        let (leaf, leaf_key) =
            certificate_between("127.0.0.1", leaf.0, leaf.1, Some(by_middle), false).unwrap();
        (format!("{leaf}{middle}"), leaf_key)
    }

    /// A config whose TURN-TLS listener "secure" (`listeners[1]`, after a plain UDP one)
    /// serves `pair`.
    fn config(pair: &(String, String)) -> StunnerConfig {
        let yaml = format!(
            "version: v1\nadmin: {{name: t}}\nauth: {{type: static, credentials: {{username: u, password: p}}}}\n\
             listeners:\n\
             - {{name: plain, protocol: TURN-UDP, address: 127.0.0.1, port: 3478, routes: [c]}}\n\
             - {{name: secure, protocol: TURN-TLS, address: 127.0.0.1, port: 443, routes: [c], cert: \"{}\", key: \"{}\"}}\n\
             clusters: [{{name: c, type: STATIC, endpoints: [127.0.0.1]}}]\n",
            b64(&pair.0),
            b64(&pair.1),
        );
        parse_config(&yaml).unwrap()
    }

    fn gauge(expiry: &CertificateExpiry) -> Vec<(String, i64)> {
        let served = expiry.served.lock().unwrap();
        served
            .iter()
            .map(|s| (s.listener.clone(), s.until()))
            .collect()
    }

    fn assert_says(notice: &Notice, level: Level, needles: &[&str]) {
        assert_eq!(notice.level, level, "{}", notice.text);
        for needle in needles {
            assert!(
                notice.text.contains(needle),
                "{needle:?} missing: {}",
                notice.text
            );
        }
    }

    #[test]
    fn a_chain_whose_intermediate_ends_before_its_leaf_ends_with_the_intermediate() {
        let ends = NOW + 5 * DAY + 3600;
        let pair = chain((NOW - DAY, NOW + 300 * DAY), (NOW - 2 * DAY, ends));
        let expiry = CertificateExpiry::new();
        let news = expiry.observe_news(&config(&pair), NOW);
        // The gauge is the intermediate's end, not the leaf's.
        assert_eq!(gauge(&expiry), [("secure".to_string(), ends)]);
        assert_eq!(news.len(), 1, "{news:?}");
        assert_says(
            &news[0],
            Level::WARN,
            &[
                "listener \"secure\" (TLS)",
                "its certificate expires in 5 days",
                &timestamp(ends),
                "of the 2 certificates in the chain, the first to end: certificate 2 (an \
                 intermediate), subject \"CN=uturn test intermediate\"",
                "listeners[1].cert",
            ],
        );
        // The same config again logs nothing; the intermediate's end is logged when it comes.
        assert_eq!(expiry.observe_news(&config(&pair), NOW + 60), []);
        assert_eq!(expiry.recheck_news(NOW + 2 * DAY), []);
        let news = expiry.recheck_news(ends);
        assert_eq!(news.len(), 1, "{news:?}");
        assert_says(
            &news[0],
            Level::ERROR,
            &[
                "its certificate expired 0 days ago",
                "certificate 2 (an intermediate)",
                "listeners[1].cert",
            ],
        );
        assert_eq!(expiry.recheck_news(ends + DAY), []);

        // A lone leaf is named as the leaf.
        let leaf = crate::io::tls::self_signed_between("127.0.0.1", NOW - DAY, NOW - 3600).unwrap();
        let news = expiry.observe_news(&config(&leaf), NOW);
        assert_eq!(gauge(&expiry), [("secure".to_string(), NOW - 3600)]);
        assert_eq!(news.len(), 1, "{news:?}");
        assert_says(
            &news[0],
            Level::ERROR,
            &[
                "its certificate expired 0 days ago",
                "the leaf, subject \"CN=127.0.0.1\"",
                "listeners[1].cert",
            ],
        );
    }

    #[test]
    fn a_not_yet_valid_certificate_is_an_error_until_it_becomes_valid() {
        let starts = NOW + 2 * DAY + 3600;
        let leaf =
            crate::io::tls::self_signed_between("127.0.0.1", starts, NOW + 300 * DAY).unwrap();
        let expiry = CertificateExpiry::new();
        let news = expiry.observe_news(&config(&leaf), NOW);
        assert_eq!(gauge(&expiry), [("secure".to_string(), NOW + 300 * DAY)]);
        assert_eq!(news.len(), 1, "{news:?}");
        assert_says(
            &news[0],
            Level::ERROR,
            &[
                "listener \"secure\" (TLS)",
                &format!("its certificate is not valid until {}", timestamp(starts)),
                "in 2 days",
                "the leaf, subject \"CN=127.0.0.1\"",
                "listeners[1].cert",
            ],
        );
        assert_eq!(expiry.observe_news(&config(&leaf), NOW + 60), []);
        assert_eq!(expiry.recheck_news(starts - 1), []);
        // The recheck notices when it becomes valid, and says so once.
        let news = expiry.recheck_news(starts);
        assert_eq!(news.len(), 1, "{news:?}");
        assert_says(
            &news[0],
            Level::INFO,
            &["listener \"secure\"", "its certificate became valid"],
        );
        assert_eq!(expiry.recheck_news(starts + DAY), []);

        // An intermediate that starts after its leaf: the chain is valid when it is.
        let starts = NOW + 3600;
        let pair = chain((NOW - DAY, NOW + 300 * DAY), (starts, NOW + 200 * DAY));
        let news = expiry.observe_news(&config(&pair), NOW);
        assert_eq!(gauge(&expiry), [("secure".to_string(), NOW + 200 * DAY)]);
        assert_eq!(news.len(), 1, "{news:?}");
        assert_says(
            &news[0],
            Level::ERROR,
            &[
                &format!("its certificate is not valid until {}", timestamp(starts)),
                "in 0 days",
                "of the 2 certificates in the chain, the last to become valid: certificate 2 \
                 (an intermediate), subject \"CN=uturn test intermediate\"",
                "listeners[1].cert",
            ],
        );
        let news = expiry.recheck_news(starts + 1);
        assert_eq!(news.len(), 1, "{news:?}");
        assert_says(&news[0], Level::INFO, &["its certificate became valid"]);
    }
}
