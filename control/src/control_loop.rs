//! The control loop: it applies every event that is ready (a batch: new configs, Service
//! changes, DNS answers), then publishes at most one snapshot, keeps the tasks and the admin
//! servers in step with the state, and writes the status board.

use crate::admin::{AdminServers, HealthSource, MetricsSource};
use crate::discovery::dns::DnsUpdate;
use crate::discovery::kubernetes::ServiceUpdate;
use crate::outbox::Outbox;
use crate::state::{ControlState, Skipped};
use crate::status::StatusBoard;
use crate::supervisor::Supervisor;
use crate::{ControlConfig, DataplaneHandle};
use std::sync::Arc;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use uturn_shared::config::StunnerConfig;

/// Something the control loop must apply.
#[derive(Debug)]
pub(crate) enum Event {
    /// A new validated config from the watched origin.
    Config(Box<StunnerConfig>),
    /// A change to a watched Kubernetes Service, seen by one watch of it.
    Service(ServiceUpdate),
    /// The addresses a STRICT_DNS hostname resolves to now.
    Dns(DnsUpdate),
    /// Stop following the config origin (graceful shutdown): no later config is applied.
    StopWatching,
}

impl From<Box<StunnerConfig>> for Event {
    fn from(config: Box<StunnerConfig>) -> Event {
        Event::Config(config)
    }
}

impl From<ServiceUpdate> for Event {
    fn from(update: ServiceUpdate) -> Event {
        Event::Service(update)
    }
}

impl From<DnsUpdate> for Event {
    fn from(update: DnsUpdate) -> Event {
        Event::Dns(update)
    }
}

/// Runs the control loop until every sender of `receiver` is gone.
pub(crate) async fn run(
    config: ControlConfig,
    mut admin: AdminServers,
    events: UnboundedSender<Event>,
    mut receiver: UnboundedReceiver<Event>,
    board: Arc<StatusBoard>,
) {
    let generation = config.snapshot.load().generation;
    let mut state = ControlState::new(config.initial, generation)
        .with_discovery_timeout(config.discovery_timeout)
        .with_siblings(config.siblings);
    // Static siblings are known now: the dataplane gets them at once, not with the next event.
    if let Some(snapshot) = state.poll_snapshot() {
        config.snapshot.store(Arc::new(snapshot));
    }
    let mut supervisor = Supervisor::new(
        config.source,
        Outbox::new(events.clone()),
        Outbox::new(events.clone()),
        Outbox::new(events),
        config.kube,
    );
    let health: Arc<dyn HealthSource> = board.clone();
    let dataplane = config.dataplane;
    let metrics: MetricsSource = {
        let dataplane = dataplane.clone();
        Arc::new(move |recorder: &dyn metrics::Recorder| dataplane.record_metrics(recorder))
    };
    admin.commit(&health, &metrics);
    // Discovery fills in KUBERNETES and STRICT_DNS clusters of the initial config as it lands.
    loop {
        supervisor.sync(&state);
        for expired in state.handle_timeout(std::time::Instant::now()) {
            tracing::warn!(
                target: "k8s",
                "Service {} not synced within --discovery-timeout ({:?}): {}; \
                 ready without its endpoints, which peers get once they are listed",
                expired.service,
                state.discovery_timeout(),
                expired.why
            );
        }
        board.update(&state);
        let deadline = state.poll_timeout();
        let first = tokio::select! {
            event = receiver.recv() => event,
            _ = tokio::time::sleep_until(deadline.map_or_else(tokio::time::Instant::now, tokio::time::Instant::from_std)), if deadline.is_some() => continue,
        };
        let Some(first) = first else {
            return;
        };
        let mut next = Some(first);
        while let Some(event) = next.take() {
            match event {
                Event::Config(new) => {
                    let mut new = *new;
                    if let Some(license) = &config.license {
                        license.apply(&mut new);
                    }
                    apply_config(&mut state, &mut admin, new, &*dataplane).await;
                    admin.commit(&health, &metrics);
                }
                Event::Service(ServiceUpdate { service, change }) => {
                    state.handle_discovery(&service.key, service.watch, change)
                }
                Event::Dns(DnsUpdate {
                    hostname,
                    addresses,
                }) => state.handle_dns(&hostname, addresses),
                Event::StopWatching => supervisor.stop_origin(),
            }
            next = receiver.try_recv().ok();
        }
        if let Some(snapshot) = state.poll_snapshot() {
            tracing::debug!(target: "stunner", "publishing dataplane snapshot generation {}", snapshot.generation);
            config.snapshot.store(Arc::new(snapshot));
        }
    }
}

/// Applies `new` if the dataplane can run it and its admin servers can listen: the state takes
/// it, the log says what changed (and what works otherwise than one may expect), and the
/// dataplane hears of it.
async fn apply_config(
    state: &mut ControlState,
    admin: &mut AdminServers,
    new: StunnerConfig,
    dataplane: &dyn DataplaneHandle,
) {
    if let Err(e) = dataplane.check(state.config(), &new) {
        tracing::error!(target: "stunner", "config rejected: {e}; the running config stays");
        return;
    }
    if new != *state.config() && !new.is_zero() {
        if let Err(e) = admin.prepare(&new).await {
            tracing::error!(target: "stunner", "config rejected: {e}; the running config stays");
            return;
        }
    }
    match state.handle_config(new, true) {
        Ok(summary) => {
            tracing::info!(
                target: "stunner",
                "Reconciliation ready: new objects: {}, changed objects: {}, deleted objects: {}, started objects: {}, restarted objects: {}",
                summary.new,
                summary.changed,
                summary.deleted,
                summary.started,
                summary.restarted
            );
            for warning in state.config().empty_warnings() {
                tracing::warn!(target: "stunner", "{warning}");
            }
            for warning in state.config().warnings() {
                tracing::warn!(target: "stunner", "{warning}");
            }
            dataplane.config_applied(state.config());
        }
        Err(skipped) => {
            admin.rollback();
            match skipped {
                Skipped::Duplicate => {
                    tracing::debug!(target: "stunner", "ignoring a config identical to the running one");
                }
                Skipped::Delete => {
                    tracing::info!(target: "stunner", "Ignoring delete configuration update");
                }
            }
        }
    }
}
