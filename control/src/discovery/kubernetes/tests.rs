use super::api_health::*;
use super::client::*;
use super::follow::*;
use super::*;
use kube::runtime::watcher;

/// A Status as kube-apiserver answers it.
fn status(code: u16, reason: &str, message: &str) -> Box<kube::core::Status> {
    serde_json::from_value(serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    }))
    .unwrap()
}

const RBAC_DENIAL: &str = "endpointslices.discovery.k8s.io is forbidden: User \"uturn\" \
    cannot list resource \"endpointslices\" in API group \"discovery.k8s.io\" in the \
    namespace \"media\"";

#[test]
fn a_403_names_the_user_the_verb_the_resource_and_the_grant() {
    let error =
        watcher::Error::InitialListFailed(kube::Error::Api(status(403, "Forbidden", RBAC_DENIAL)));
    let failure = classify(&error, "endpointslices", "media");
    let want = "Kubernetes API refuses user \"uturn\": cannot list endpointslices in \
                namespace \"media\" (forbidden); grant get, list and watch on \
                endpointslices and services (deploy/base/rbac.yaml); the API server says: ";
    assert_eq!(failure, Failure::Refused(format!("{want}{RBAC_DENIAL}")));
    // /status shows the sentence itself, no debug dump.
    assert_eq!(failure.status(), format!("{want}{RBAC_DENIAL}"));
    assert!(!failure.status().contains("Status {"));

    // A watch refused to a service account: its name and the verb from the message.
    let message = "services \"sfu\" is forbidden: User \"system:serviceaccount:uturn:uturn\" \
                   cannot watch resource \"services\" in API group \"\" in the namespace \"media\"";
    let error =
        watcher::Error::WatchStartFailed(kube::Error::Api(status(403, "Forbidden", message)));
    let Failure::Refused(sentence) = classify(&error, "services", "media") else {
        panic!("not a refusal");
    };
    assert!(
        sentence.starts_with(
            "Kubernetes API refuses user \"system:serviceaccount:uturn:uturn\": cannot \
             watch services in namespace \"media\" (forbidden)"
        ),
        "{sentence}"
    );
    // A 403 that is not RBAC's (a webhook's words): the verb the watcher used.
    let error = watcher::Error::WatchError(status(403, "Forbidden", "denied by policy"));
    let Failure::Refused(sentence) = classify(&error, "services", "media") else {
        panic!("not a refusal");
    };
    assert!(
        sentence.starts_with("Kubernetes API refuses stunnerd's user: cannot watch services"),
        "{sentence}"
    );
}

#[test]
fn a_401_says_the_credentials_are_not_accepted() {
    let error = watcher::Error::InitialListFailed(kube::Error::Api(status(
        401,
        "Unauthorized",
        "Unauthorized",
    )));
    let Failure::Refused(sentence) = classify(&error, "endpointslices", "media") else {
        panic!("not a refusal");
    };
    assert!(
        sentence.starts_with(
            "Kubernetes API does not accept stunnerd's credentials: cannot list \
             endpointslices in namespace \"media\" (unauthorized); give a valid token or \
             client certificate"
        ),
        "{sentence}"
    );
}

#[test]
fn a_410_is_a_relist_and_other_errors_are_unreachable() {
    let error = watcher::Error::WatchError(status(
        410,
        "Expired",
        "too old resource version: 205 (207)",
    ));
    assert_eq!(
        classify(&error, "endpointslices", "media"),
        Failure::Expired(
            "endpointslices in namespace \"media\": 410 Gone (too old resource version: \
             205 (207))"
                .into()
        )
    );
    let error = watcher::Error::InitialListFailed(kube::Error::Api(status(
        500,
        "InternalError",
        "etcd is down",
    )));
    let failure = classify(&error, "endpointslices", "media");
    assert_eq!(
        failure.status(),
        "unreachable, keeping last known endpoints: cannot list endpointslices in namespace \
         \"media\": 500 InternalError; the API server says: etcd is down"
    );
    let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
    let error = watcher::Error::WatchFailed(kube::Error::ReadEvents(refused));
    assert_eq!(
        classify(&error, "services", "media").status(),
        "unreachable, keeping last known endpoints: cannot watch services in namespace \
         \"media\": Error reading events stream: connection refused"
    );
}

#[test]
fn refusals_back_off_to_a_minute_and_a_first_410_relists_at_once() {
    let refused = Failure::Refused(String::new());
    let delays: Vec<u64> = (1..=9)
        .map(|n| retry_delay(&refused, n).as_secs())
        .collect();
    assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
    assert_eq!(retry_delay(&refused, u32::MAX), REFUSED_RETRY_MAX);
    let expired = Failure::Expired(String::new());
    assert_eq!(retry_delay(&expired, 1), Duration::ZERO);
    assert!(retry_delay(&expired, 2) >= UNREACHABLE_RETRY * 2);
    let unreachable = Failure::Unreachable(String::new());
    let first = retry_delay(&unreachable, 1);
    assert!(
        first >= UNREACHABLE_RETRY && first < UNREACHABLE_RETRY * 3 / 2,
        "{first:?}"
    );
    let last = retry_delay(&unreachable, 40);
    assert!(
        last >= UNREACHABLE_RETRY_MAX && last <= UNREACHABLE_RETRY_MAX * 3 / 2,
        "{last:?}"
    );
}

/// The `api` changes a test's watchers report, in order.
fn api_changes(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<ServiceUpdate>,
) -> Vec<Option<String>> {
    std::iter::from_fn(|| rx.try_recv().ok())
        .filter_map(|u| match u.change {
            ServiceChange::Api(api) => Some(api),
            _ => None,
        })
        .collect()
}

#[test]
fn failures_are_reported_once_and_the_slices_failure_shows_first() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<ServiceUpdate>();
    let updates = Outbox::new(tx);
    let service = ServiceWatch {
        key: "media/sfu".into(),
        watch: 1,
    };
    let report = ApiReport {
        service: &service,
        updates: &updates,
        state: std::sync::Mutex::new(([None, None], None)),
    };
    let slices = Watched {
        service: &service,
        namespace: "media",
        what: "EndpointSlices",
        resource: "endpointslices",
        report: &report,
        slot: 0,
    };
    let new = |watched| ApiHealth {
        watched,
        failing: None,
        streak: 0,
        expired_streak: 0,
        refusal_deferred: false,
    };
    let mut slice_health = new(slices);
    let mut service_health = new(Watched {
        what: "the ClusterIPs",
        resource: "services",
        slot: 1,
        ..slices
    });
    let refused = |what: &str| Failure::Refused(format!("refused {what}"));

    // The same refusal three times: reported once, retried 1, 2, 4 s apart.
    let delays: Vec<_> = (0..3)
        .map(|_| slice_health.failed(refused("slices")).as_secs())
        .collect();
    assert_eq!(delays, [1, 2, 4]);
    assert_eq!(api_changes(&mut rx), [Some("refused slices".to_string())]);
    // The other watcher's failure does not hide the slices' one; its recovery neither.
    service_health.failed(refused("service"));
    service_health.ok();
    assert_eq!(api_changes(&mut rx), []);
    // A 410 is no failure: nothing reported, and a first one is retried at once.
    let expired = Failure::Expired("gone".into());
    assert_eq!(slice_health.failed(expired), Duration::ZERO);
    assert_eq!(api_changes(&mut rx), []);
    slice_health.ok();
    assert_eq!(api_changes(&mut rx), [None]);

    // An outage is one report however its errors vary; a refusal right after it is
    // retried once (1 s) before it is reported (a starting kube-apiserver refuses).
    let unreachable = |why: &str| Failure::Unreachable(why.into());
    slice_health.failed(unreachable("refused"));
    slice_health.failed(unreachable("reset"));
    assert_eq!(
        api_changes(&mut rx),
        [Some(
            "unreachable, keeping last known endpoints: refused".to_string()
        )]
    );
    assert_eq!(slice_health.failed(refused("slices")), REFUSED_RETRY);
    assert_eq!(api_changes(&mut rx), []);
    assert_eq!(slice_health.failed(refused("slices")), REFUSED_RETRY);
    assert_eq!(api_changes(&mut rx), [Some("refused slices".to_string())]);
}

#[test]
fn server_urls_are_https_unless_said() {
    assert_eq!(
        server_url("https://10.0.0.1:6443").unwrap().to_string(),
        "https://10.0.0.1:6443/"
    );
    assert_eq!(
        server_url("10.0.0.1:6443").unwrap().to_string(),
        "https://10.0.0.1:6443/"
    );
    assert_eq!(
        server_url("http://[::1]:8080").unwrap().to_string(),
        "http://[::1]:8080/"
    );
    for bad in ["https://", "a b", ""] {
        assert!(server_url(bad).unwrap_err().contains("--server"), "{bad:?}");
    }
}

#[test]
fn request_timeouts_parse_as_kubectl_does() {
    assert_eq!(parse_request_timeout("0"), Ok(None));
    assert_eq!(parse_request_timeout("5"), Ok(Some(Duration::from_secs(5))));
    assert_eq!(
        parse_request_timeout("5s"),
        Ok(Some(Duration::from_secs(5)))
    );
    assert_eq!(
        parse_request_timeout("1m30s"),
        Ok(Some(Duration::from_secs(90)))
    );
    assert_eq!(
        parse_request_timeout("500ms"),
        Ok(Some(Duration::from_millis(500)))
    );
    for bad in ["", "5x", "s", "-1s", "1.2.3s"] {
        assert!(
            parse_request_timeout(bad)
                .unwrap_err()
                .contains("--request-timeout"),
            "{bad}"
        );
    }
}
