//! What a watcher's failures mean and how they are reported: a 401 or 403 is a refusal whose
//! sentence names who was refused what and the grant (retried with a backoff up to a minute),
//! a 410 a relist, anything else an outage (retried as client-go does). Each change is logged
//! and sent to `/status` once, and a Service's two watchers share one `api` entry.

use super::follow::Watched;
use super::{ServiceUpdate, ServiceWatch};
use crate::outbox::Outbox;
use crate::state::ServiceChange;
use kube::runtime::watcher;
use std::time::Duration;

/// The first retry after the API server refused the credentials (401) or the permission
/// (403); each further refusal doubles it, up to [`REFUSED_RETRY_MAX`].
pub(super) const REFUSED_RETRY: Duration = Duration::from_secs(1);
/// The longest wait between retries while the API server keeps refusing.
pub(super) const REFUSED_RETRY_MAX: Duration = Duration::from_secs(60);
/// The first retry after any other failure (client-go's reflector: 800 ms, doubling, jittered,
/// up to [`UNREACHABLE_RETRY_MAX`]).
pub(super) const UNREACHABLE_RETRY: Duration = Duration::from_millis(800);
/// The longest wait between retries while the API server is unreachable.
pub(super) const UNREACHABLE_RETRY_MAX: Duration = Duration::from_secs(30);

/// A Service's one `api` entry in `/status`, from its two watchers: the EndpointSlices
/// watcher's failure if it has one, else the Service watcher's, else connected. (One
/// watcher recovering does not hide the other's failure.)
pub(super) struct ApiReport<'a> {
    pub(super) service: &'a ServiceWatch,
    pub(super) updates: &'a Outbox<ServiceUpdate>,
    /// Each watcher's failure (`/status` text), and what was last sent (`None`: connected).
    pub(super) state: std::sync::Mutex<([Option<String>; 2], Option<String>)>,
}

impl ApiReport<'_> {
    pub(super) fn set(&self, slot: usize, failure: Option<String>) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        let (failures, sent) = &mut *state;
        failures[slot] = failure;
        let now = failures.iter().flatten().next().cloned();
        if *sent != now {
            sent.clone_from(&now);
            let _ = self.updates.send(ServiceUpdate {
                service: self.service.clone(),
                change: ServiceChange::Api(now),
            });
        }
    }
}

/// What a failed watcher step means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Failure {
    /// 401 or 403: the API server refuses the credentials or the permission. The sentence
    /// says who was refused what and how to grant it.
    Refused(String),
    /// 410 Gone: the version the watch resumed from is no longer kept (etcd compacted it, or
    /// the API server restarted); the watcher relists at once. Not a failure to report.
    Expired(String),
    /// Anything else (no connection, a timeout, a server error): the last known endpoints stay.
    Unreachable(String),
}

impl Failure {
    /// What `/status` shows under `discovery.kubernetes[].api` (and the log says).
    pub(super) fn status(&self) -> String {
        match self {
            Failure::Refused(sentence) => sentence.clone(),
            Failure::Expired(why) | Failure::Unreachable(why) => {
                format!("unreachable, keeping last known endpoints: {why}")
            }
        }
    }
}

/// Classifies a watcher error on `resource` in `namespace`: who was refused what, or why the
/// API server could not be reached. Never a debug dump of a Status object.
pub(super) fn classify(error: &watcher::Error, resource: &str, namespace: &str) -> Failure {
    use watcher::Error as E;
    let (verb, error) = match error {
        E::InitialListFailed(e) => ("list", e),
        E::WatchStartFailed(e) | E::WatchFailed(e) => ("watch", e),
        E::WatchError(status) => return classify_status(status, "watch", resource, namespace),
        E::NoResourceVersion => {
            return Failure::Unreachable(format!(
                "cannot list {resource} in namespace {namespace:?}: the list carries no \
                 resourceVersion (is this a Kubernetes API server?)"
            ))
        }
    };
    match error {
        kube::Error::Api(status) => classify_status(status, verb, resource, namespace),
        other => Failure::Unreachable(format!(
            "cannot {verb} {resource} in namespace {namespace:?}: {}",
            error_chain(other)
        )),
    }
}

fn classify_status(
    status: &kube::core::Status,
    verb: &str,
    resource: &str,
    namespace: &str,
) -> Failure {
    let message = status.message.trim();
    let said = if message.is_empty() {
        String::new()
    } else {
        format!("; the API server says: {message}")
    };
    match status.code {
        401 => Failure::Refused(format!(
            "Kubernetes API does not accept stunnerd's credentials: cannot {verb} {resource} in \
             namespace {namespace:?} (unauthorized); give a valid token or client certificate \
             (--token, --client-certificate and --client-key, the kubeconfig's user, or the \
             pod's service account){said}"
        )),
        403 => {
            // kube-apiserver's RBAC denial: `... User "NAME" cannot VERB resource "RESOURCE" ...`.
            let user = quoted_after(message, "User ");
            let verb = message
                .split_once(" cannot ")
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .filter(|v| v.chars().all(|c| c.is_ascii_alphabetic()))
                .unwrap_or(verb);
            let who = match user {
                Some(user) => format!("user {user:?}"),
                None => "stunnerd's user".to_string(),
            };
            Failure::Refused(format!(
                "Kubernetes API refuses {who}: cannot {verb} {resource} in namespace \
                 {namespace:?} (forbidden); grant get, list and watch on endpointslices and \
                 services (deploy/base/rbac.yaml){said}"
            ))
        }
        410 => Failure::Expired(format!(
            "{resource} in namespace {namespace:?}: 410 Gone ({})",
            if message.is_empty() {
                "expired"
            } else {
                message
            }
        )),
        code => Failure::Unreachable(format!(
            "cannot {verb} {resource} in namespace {namespace:?}: {} {}{said}",
            code,
            if status.reason.is_empty() {
                "error"
            } else {
                &status.reason
            }
        )),
    }
}

/// The text between the quotes that follow `prefix` in `text`.
fn quoted_after<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    let rest = &text[text.find(prefix)? + prefix.len()..];
    let rest = rest.strip_prefix('"')?;
    Some(&rest[..rest.find('"')?])
}

/// An error and its sources, `outer: inner: innermost`, each said once.
pub(super) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        let said = inner.to_string();
        if !text.contains(&said) {
            text = format!("{text}: {said}");
        }
        source = inner.source();
    }
    text
}

/// How long to wait before the watcher's next try, after `streak` failures of this kind in a
/// row (1 for the first).
pub(super) fn retry_delay(failure: &Failure, streak: u32) -> Duration {
    let doubled = |first: Duration, max: Duration| {
        first
            .checked_mul(1 << streak.saturating_sub(1).min(16))
            .map_or(max, |d| d.min(max))
    };
    match failure {
        // Deterministic: a refusal is not a load problem, and its retries are far apart.
        Failure::Refused(_) => doubled(REFUSED_RETRY, REFUSED_RETRY_MAX),
        // The watcher relists at once; only a 410 that keeps coming backs off.
        Failure::Expired(_) if streak <= 1 => Duration::ZERO,
        Failure::Expired(_) | Failure::Unreachable(_) => {
            // Jittered by up to half, so that the pods of a gateway spread their retries.
            let delay = doubled(UNREACHABLE_RETRY, UNREACHABLE_RETRY_MAX);
            delay.mul_f64(1.0 + 0.5 * jitter())
        }
    }
}

/// A number in `[0, 1)` that differs from call to call and process to process.
fn jitter() -> f64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    let mut x = u64::from(nanos) ^ (u64::from(std::process::id()) << 32) | 1;
    // xorshift64*
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
}

/// Tracks whether the API server answers one watcher, reporting each change once: a refusal
/// or an outage when it starts (not at every retry), and a recovery only once a list or a
/// watch actually succeeded.
pub(super) struct ApiHealth<'a> {
    pub(super) watched: Watched<'a>,
    /// What was last reported, while failing.
    pub(super) failing: Option<Failure>,
    /// Failures of the last one's kind in a row since the last success (a refusal after an
    /// outage starts its backoff anew), and 410s in a row.
    pub(super) streak: u32,
    pub(super) expired_streak: u32,
    /// A refusal that came right after the API server was unreachable is retried once before
    /// it is reported: a kube-apiserver that is starting answers before its RBAC caches are
    /// filled, and refuses meanwhile.
    pub(super) refusal_deferred: bool,
}

impl ApiHealth<'_> {
    /// A list completed, an event arrived or a probe watch started.
    pub(super) fn ok(&mut self) {
        self.streak = 0;
        self.expired_streak = 0;
        self.refusal_deferred = false;
        let w = self.watched;
        if let Some(failure) = self.failing.take() {
            let granted = match failure {
                Failure::Refused(_) => " (it grants what it refused)",
                _ => "",
            };
            tracing::info!(target: "k8s", "Kubernetes API reachable again: watching {} of Service {}{granted}", w.what, w.service);
        }
        // Also clears a failure reported before the watch started (no client yet).
        w.report.set(w.slot, None);
    }

    /// A watcher step failed: reports it if it is news, and returns how long to wait before
    /// the watcher's next try.
    pub(super) fn failed(&mut self, failure: Failure) -> Duration {
        let w = self.watched;
        if let Failure::Expired(why) = &failure {
            self.expired_streak += 1;
            tracing::info!(target: "k8s", "watch of {} of Service {} expired: {why}; relisting", w.what, w.service);
            return retry_delay(&failure, self.expired_streak);
        }
        if matches!(failure, Failure::Refused(_))
            && matches!(self.failing, Some(Failure::Unreachable(_)))
            && !self.refusal_deferred
        {
            self.refusal_deferred = true;
            tracing::debug!(target: "k8s", "watching {} of Service {}: refused right after the API server was unreachable (is it starting?): {}; retrying in {REFUSED_RETRY:?} before reporting it", w.what, w.service, failure.status());
            return REFUSED_RETRY;
        }
        self.refusal_deferred = false;
        let same_kind = matches!(
            (&self.failing, &failure),
            (Some(Failure::Refused(_)), Failure::Refused(_))
                | (Some(Failure::Unreachable(_)), Failure::Unreachable(_))
        );
        self.streak = if same_kind { self.streak + 1 } else { 1 };
        let delay = retry_delay(&failure, self.streak);
        // An outage is one news item however its errors vary; a refusal is news when it
        // changes (another verb, another resource) or follows an outage.
        let news = match (&self.failing, &failure) {
            (None, _) => true,
            (Some(Failure::Unreachable(_)), Failure::Unreachable(_)) => false,
            (Some(before), now) => before != now,
        };
        if news {
            match &failure {
                Failure::Refused(sentence) => tracing::error!(
                    target: "k8s",
                    "{sentence} (watching {} of Service {}; its last known endpoints stay; \
                     retrying in {}s, backing off to {}s while refused)",
                    w.what,
                    w.service,
                    delay.as_secs_f64().ceil(),
                    REFUSED_RETRY_MAX.as_secs()
                ),
                Failure::Unreachable(why) | Failure::Expired(why) => tracing::warn!(
                    target: "k8s",
                    "Kubernetes API unreachable while watching {} of Service {}: {why}; keeping its last known endpoints",
                    w.what,
                    w.service
                ),
            }
            w.report.set(w.slot, Some(failure.status()));
        } else {
            tracing::debug!(target: "k8s", "watching {} of Service {} failed again: {}; retrying in {delay:?}", w.what, w.service, failure.status());
        }
        self.failing = Some(failure);
        delay
    }
}
