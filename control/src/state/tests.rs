use super::*;
use uturn_shared::config::parse_config;

fn config(clusters: &str, realm: &str) -> StunnerConfig {
    parse_config(&format!(
        "version: v1\nadmin: {{name: t}}\nauth: {{realm: {realm}, credentials: {{username: u, password: p}}}}\n\
         listeners: [{{name: l, address: 127.0.0.1, port: 3478, routes: [k]}}]\nclusters: {clusters}\n"
    ))
    .unwrap()
}

fn slice(ips: &[&str]) -> SliceAddresses {
    SliceAddresses {
        addresses: ips.iter().map(|s| s.parse().unwrap()).collect(),
        terminating: Vec::new(),
    }
}

/// Siblings follow the EndpointSlices of the gateway's own Service: ready and terminating
/// pods alike, not the ClusterIP, not this host's own addresses; a removed pod goes. The
/// Service is watched, but readiness does not wait for it.
#[test]
fn siblings_follow_the_gateways_own_service() {
    let mut state = ControlState::new(config("[]", "r"), 1)
        .with_siblings(Siblings::Service("stunner/udp-gateway".into()));
    assert!(
        state.waiting_for().is_empty(),
        "readiness waits for siblings"
    );
    let svc = "stunner/udp-gateway";
    let watch = state.services()[svc].watch;
    let siblings = |state: &mut ControlState| -> Vec<String> {
        let snap = state.poll_snapshot().expect("a snapshot");
        snap.sibling_ips.iter().map(ToString::to_string).collect()
    };
    assert!(siblings(&mut state).is_empty());
    state.handle_discovery(
        svc,
        watch,
        ServiceChange::UpsertSlice(
            "a".into(),
            SliceAddresses {
                addresses: ["10.244.1.5", "10.244.2.7", "127.0.0.1"]
                    .iter()
                    .map(|s| s.parse().unwrap())
                    .collect(),
                terminating: vec!["10.244.2.7".parse().unwrap()],
            },
        ),
    );
    state.handle_discovery(
        svc,
        watch,
        ServiceChange::ClusterIps(vec!["10.96.0.20".parse().unwrap()]),
    );
    assert_eq!(siblings(&mut state), ["10.244.1.5", "10.244.2.7"]);
    state.handle_discovery(
        svc,
        watch,
        ServiceChange::UpsertSlice("a".into(), slice(&["10.244.1.5"])),
    );
    assert_eq!(siblings(&mut state), ["10.244.1.5"]);
    state.handle_discovery(svc, watch, ServiceChange::RemoveSlice("a".into()));
    assert!(siblings(&mut state).is_empty());
    // Static siblings, this host's own address left out.
    let mut fixed = ControlState::new(config("[]", "r"), 1).with_siblings(Siblings::Static(vec![
        "198.51.100.9".parse().unwrap(),
        "127.0.0.1".parse().unwrap(),
    ]));
    assert_eq!(siblings(&mut fixed), ["198.51.100.9"]);
}

#[test]
fn an_address_leaves_only_when_no_slice_lists_it() {
    let mut state = ControlState::new(
        config(
            "[{name: k, type: KUBERNETES, endpoints: [\"media/srv:<10000-20000>\"]}]",
            "r",
        ),
        1,
    );
    let svc = "media/srv";
    let watch = state.services()[svc].watch;
    state.handle_discovery(
        svc,
        watch,
        ServiceChange::UpsertSlice("a".into(), slice(&["10.0.0.1"])),
    );
    state.handle_discovery(
        svc,
        watch,
        ServiceChange::UpsertSlice("b".into(), slice(&["10.0.0.1", "10.0.0.2"])),
    );
    let snap = state.poll_snapshot().unwrap();
    assert_eq!(snap.generation, 2, "one batch, one snapshot");
    assert!(state.poll_snapshot().is_none());
    let route = snap.route("l").unwrap();
    assert!(snap
        .admits(route, "10.0.0.1:15000".parse().unwrap())
        .is_some());
    assert!(snap
        .admits(route, "10.0.0.1:9999".parse().unwrap())
        .is_none());
    state.handle_discovery(svc, watch, ServiceChange::RemoveSlice("b".into()));
    let snap = state.poll_snapshot().unwrap();
    let route = snap.route("l").unwrap();
    assert!(snap.permits_ip(route, "10.0.0.1".parse().unwrap()));
    assert!(!snap.permits_ip(route, "10.0.0.2".parse().unwrap()));
    state.handle_discovery(
        svc,
        watch,
        ServiceChange::ReplaceSlices(BTreeMap::from([("c".into(), slice(&["fd00::5"]))])),
    );
    state.handle_discovery(
        svc,
        watch,
        ServiceChange::ClusterIps(vec!["10.96.0.9".parse().unwrap()]),
    );
    let snap = state.poll_snapshot().unwrap();
    let route = snap.route("l").unwrap();
    assert!(!snap.permits_ip(route, "10.0.0.1".parse().unwrap()));
    assert!(snap.permits_ip(route, "fd00::5".parse().unwrap()));
    assert!(snap.permits_ip(route, "10.96.0.9".parse().unwrap()));
    // An API error alone changes nothing the dataplane sees.
    state.handle_discovery(svc, watch, ServiceChange::Api(Some("refused".into())));
    assert!(state.poll_snapshot().is_none());
}

#[test]
fn reconcile_counts_like_stunnerd() {
    let old = config("[{name: k, endpoints: [10.0.0.1]}]", "r");
    let mut new = config(
        "[{name: k, endpoints: [10.0.0.2]}, {name: k2, endpoints: [10.0.0.3]}]",
        "r",
    );
    let summary = reconcile(&old, &new);
    assert_eq!((summary.new, summary.changed, summary.deleted), (1, 1, 0));
    assert_eq!((summary.started, summary.restarted), (0, 0));
    new.auth.realm = "other".into();
    let summary = reconcile(&old, &new);
    assert_eq!(
        summary.restarted, 1,
        "a realm change restarts every listener"
    );
    let mut state = ControlState::new(old.clone(), 1);
    assert_eq!(
        state.handle_config(old.clone(), true),
        Err(Skipped::Duplicate)
    );
    assert_eq!(
        state.handle_config(StunnerConfig::zero("t"), true),
        Err(Skipped::Delete)
    );
    assert!(state.handle_config(new, true).is_ok());
    assert!(state.poll_snapshot().is_some());
}

const ONE_SERVICE: &str = "[{name: k, type: KUBERNETES, endpoints: [\"media/srv:<10000-20000>\"]}]";

#[test]
fn readiness_waits_for_the_first_list_up_to_the_timeout() {
    let timeout = Duration::from_secs(10);
    let t0 = Instant::now();
    let mut state = ControlState::new(config(ONE_SERVICE, "r"), 1).with_discovery_timeout(timeout);
    assert!(!state.ready(), "ready before the Service was listed");
    assert_eq!(state.waiting_for(), vec!["media/srv"]);
    assert!(state.handle_timeout(t0).is_empty());
    assert_eq!(state.poll_timeout(), Some(t0 + timeout));
    let watch = state.services()["media/srv"].watch;
    state.handle_discovery(
        "media/srv",
        watch,
        ServiceChange::UpsertSlice("a".into(), slice(&["10.0.0.1"])),
    );
    assert!(!state.ready(), "a single change is not a complete list");
    state.handle_discovery(
        "media/srv",
        watch,
        ServiceChange::ReplaceSlices(BTreeMap::new()),
    );
    assert!(state.ready());
    assert_eq!(state.poll_timeout(), None);

    let mut state = ControlState::new(config(ONE_SERVICE, "r"), 1).with_discovery_timeout(timeout);
    let watch = state.services()["media/srv"].watch;
    state.handle_discovery(
        "media/srv",
        watch,
        ServiceChange::Api(Some("connection refused".into())),
    );
    assert!(state.handle_timeout(t0).is_empty());
    assert!(state.handle_timeout(t0 + timeout / 2).is_empty());
    assert!(!state.ready());
    let expired = state.handle_timeout(t0 + timeout);
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].service, "media/srv");
    assert!(expired[0].why.contains("connection refused"), "{expired:?}");
    assert!(state.ready(), "the timeout did not make it ready");
    assert!(state.services()["media/srv"].sync_timed_out);
    // Once ready, a Service named later does not take readiness away.
    let mut two = config(ONE_SERVICE, "r");
    two.clusters[0].endpoints.push("media/other".into());
    state.handle_config(two, true).unwrap();
    assert!(state.ready());

    let zero = ControlState::new(config(ONE_SERVICE, "r"), 1);
    assert!(zero.ready(), "a zero discovery timeout waits for nothing");
}

#[test]
fn a_service_named_again_in_one_batch_gets_a_new_watch() {
    let mut state = ControlState::new(config(ONE_SERVICE, "r"), 1);
    let first = state.services()["media/srv"].watch;
    state.handle_discovery(
        "media/srv",
        first,
        ServiceChange::ReplaceSlices(BTreeMap::from([("a".into(), slice(&["10.0.0.1"]))])),
    );
    state.handle_config(config("[]", "r"), true).unwrap();
    state.handle_config(config(ONE_SERVICE, "r"), true).unwrap();
    let second = state.services()["media/srv"].watch;
    assert_ne!(first, second, "the recreated state kept the old watch");
    // A change the old watch queued before it was stopped is not applied to the new state.
    state.handle_discovery(
        "media/srv",
        first,
        ServiceChange::ReplaceSlices(BTreeMap::new()),
    );
    assert!(!state.services()["media/srv"].synced);
    state.handle_discovery(
        "media/srv",
        second,
        ServiceChange::ReplaceSlices(BTreeMap::from([("a".into(), slice(&["10.0.0.1"]))])),
    );
    assert!(state.services()["media/srv"]
        .addresses()
        .contains(&"10.0.0.1".parse::<IpAddr>().unwrap()));
}
