//! One kube-rs watcher of one resource of a Service ([`follow`]): its events become
//! [`ServiceChange`]s, its failures go to [`ApiHealth`], and kube-rs's own warnings about the
//! retries stay out of the log ([`QuietKube`]).

use super::api_health::{classify, ApiHealth, ApiReport, Failure};
use super::{ServiceUpdate, ServiceWatch};
use crate::outbox::Outbox;
use crate::state::ServiceChange;
use futures_util::{Stream, StreamExt};
use kube::runtime::watcher;
use kube::Api;
use std::time::Duration;
use tracing::instrument::WithSubscriber;

/// After a failed watch (not a list), the watcher's next try starts a watch, whose success
/// shows no event: if it stays quiet this long, a probe watch checks that watching works.
const PROBE_QUIET: Duration = Duration::from_secs(2);
/// How long a probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// One resource a watcher follows for a Service.
#[derive(Clone, Copy)]
pub(super) struct Watched<'a> {
    pub(super) service: &'a ServiceWatch,
    pub(super) namespace: &'a str,
    /// For the log: `EndpointSlices`, `the ClusterIPs` (the Service object).
    pub(super) what: &'static str,
    /// The API resource: `endpointslices`, `services`.
    pub(super) resource: &'static str,
    /// Where its failures meet the other watcher's of the same Service, and its place there.
    pub(super) report: &'a ApiReport<'a>,
    pub(super) slot: usize,
}

/// Runs a kube-rs watcher and sends what `translate` makes of each event, tracking whether
/// the API server answers; returns when the receiver goes away.
///
/// The retries are paced here, not by kube-rs's `default_backoff`: that one resets on every
/// event, `Init` included, which the watcher emits before each list try, so a list the API
/// server refuses was retried every 0.8 s forever. Here only a completed list, an event or a
/// probe watch counts as success; a refusal backs off to [`REFUSED_RETRY_MAX`].
pub(super) async fn follow<K>(
    api: Api<K>,
    config: watcher::Config,
    watched: Watched<'_>,
    updates: &Outbox<ServiceUpdate>,
    mut translate: impl FnMut(watcher::Event<K>) -> Option<ServiceChange>,
) where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    let probe_params = kube::api::WatchParams {
        label_selector: config.label_selector.clone(),
        field_selector: config.field_selector.clone(),
        timeout: Some(1),
        ..Default::default()
    };
    let mut watcher = std::pin::pin!(watcher(api.clone(), config));
    let quiet = QuietKube::dispatch();
    let mut stream = futures_util::stream::poll_fn(|cx| {
        tracing::dispatcher::with_default(quiet, || watcher.as_mut().poll_next(cx))
    });
    let mut health = ApiHealth {
        watched,
        failing: None,
        streak: 0,
        expired_streak: 0,
        refusal_deferred: false,
    };
    // When to probe whether watching works again (after a failed watch).
    let mut probe_at: Option<tokio::time::Instant> = None;
    loop {
        let probe = async {
            match probe_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let item = tokio::select! {
            item = stream.next() => item,
            () = probe => {
                probe_at = None;
                let watch = api.watch(&probe_params, "0").with_subscriber(quiet.clone());
                let started = tokio::time::timeout(PROBE_TIMEOUT, watch).await;
                if let Ok(Ok(_events)) = started {
                    health.ok();
                }
                continue;
            }
        };
        let Some(item) = item else { return };
        match item {
            Ok(event) => {
                // `Init` starts a list try, which may still be refused: not a success.
                // `InitApply` is part of a list that succeeded, and `InitDone` ends it.
                if !matches!(event, watcher::Event::Init | watcher::Event::InitApply(_)) {
                    probe_at = None;
                    health.ok();
                }
                if let Some(change) = translate(event) {
                    let update = ServiceUpdate {
                        service: watched.service.clone(),
                        change,
                    };
                    if updates.send(update).is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                let watch_failed = !matches!(
                    e,
                    watcher::Error::InitialListFailed(_) | watcher::Error::NoResourceVersion
                );
                let failure = classify(&e, watched.resource, watched.namespace);
                let expired = matches!(failure, Failure::Expired(_));
                let delay = health.failed(failure);
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                // A failed list is retried by a list, whose success shows; a failed watch is
                // retried by a watch, whose success does not: probe it if all stays quiet.
                probe_at = (watch_failed && !expired && health.failing.is_some())
                    .then(|| tokio::time::Instant::now() + PROBE_QUIET);
            }
        }
    }
}

/// kube-rs's own warnings and errors about the requests a watcher makes repeat, at every
/// retry and as a Rust debug dump, what [`ApiHealth`] reports once and in words
/// (`watch list error with 403: Api(Status { … })`, `failed with error client error
/// (Connect)`, `eof in poll: Custom { … }`): while stunnerd polls its watchers they go to
/// this subscriber, which drops them and hands everything else to the one it wraps (so kube's
/// debug and trace events, and uturn's own, are logged as the log spec says).
struct QuietKube {
    inner: tracing::Dispatch,
    /// The most verbose level enabled when it was made (`LevelFilter::current`), so that it
    /// does not lift the global maximum: the log spec's reloads raise it through `inner`.
    hint: Option<tracing::level_filters::LevelFilter>,
}

impl QuietKube {
    /// The one instance, wrapping the default subscriber at its first use.
    fn dispatch() -> &'static tracing::Dispatch {
        static QUIET: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
        QUIET.get_or_init(|| {
            let inner = tracing::dispatcher::get_default(|d| d.clone());
            tracing::Dispatch::new(QuietKube {
                inner,
                hint: Some(tracing::level_filters::LevelFilter::current()),
            })
        })
    }

    fn noise(meta: &tracing::Metadata<'_>) -> bool {
        meta.is_event()
            && *meta.level() <= tracing::Level::WARN
            && (meta.target().starts_with("kube_runtime")
                || meta.target().starts_with("kube_client"))
    }
}

impl tracing::Subscriber for QuietKube {
    fn register_callsite(
        &self,
        meta: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        if Self::noise(meta) {
            // Asked per event: outside a watcher's poll the default subscriber decides.
            tracing::subscriber::Interest::sometimes()
        } else {
            self.inner.register_callsite(meta)
        }
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        self.hint
    }
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        !Self::noise(meta) && self.inner.enabled(meta)
    }
    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        self.inner.new_span(span)
    }
    fn record(&self, span: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        self.inner.record(span, values)
    }
    fn record_follows_from(&self, span: &tracing::span::Id, follows: &tracing::span::Id) {
        self.inner.record_follows_from(span, follows)
    }
    fn event(&self, event: &tracing::Event<'_>) {
        self.inner.event(event)
    }
    fn enter(&self, span: &tracing::span::Id) {
        self.inner.enter(span)
    }
    fn exit(&self, span: &tracing::span::Id) {
        self.inner.exit(span)
    }
    fn clone_span(&self, id: &tracing::span::Id) -> tracing::span::Id {
        self.inner.clone_span(id)
    }
    fn try_close(&self, id: tracing::span::Id) -> bool {
        self.inner.try_close(id)
    }
    // `current_span` stays the default (unknown): tracing does not name its type, and the
    // wrapped subscriber tracks span parents itself; stunnerd's log lines print no spans.
}
