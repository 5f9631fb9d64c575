//! The control plane's Kubernetes discovery end to end, against a real API server: etcd and
//! kube-apiserver (built by `bash .ci/go-components`, started on loopback by
//! `uturn_testkit::kube`), objects written with kubectl as an admin, and the real stunnerd
//! watching through kube-rs as user `uturn`, with exactly the permissions deploy/ grants
//! (deploy/base/rbac.yaml's ClusterRole, bound by `grant_deploy_rbac`; deploy/overlays/siblings
//! adds no RBAC) or, where a test says so, fewer. The API server's audit log shows what uturn
//! asked and was answered; every scenario but the refusal ones checks it was never refused.
//!
//! Outages are real: kube-apiserver is killed and started again on the same port and etcd,
//! while a second kube-apiserver on the same etcd takes the admin's writes; etcd is compacted
//! meanwhile, so the watch that resumes is answered 410 Gone and stunnerd relists.
//!
//! Beyond the scenarios that ran on the fake before: refusals (a 403 on list, a 403 on watch
//! only, a 401) said in one sentence, once, retried with a backoff and recovered from at the
//! first retry after the grant; and the kubectl connection flags without a kubeconfig.
//!
//! The API server refuses loopback endpoint addresses, so a pod that must relay lives in a
//! network namespace of the test's own joined to the host (`uturn_testkit::netns`); a pod only
//! admitted or refused takes an address of 10.218.0.0/24, which no interface holds.
//!
//! No Kubernetes API-server fake is left: every fault these tests need (outages, 410 Gone after
//! etcd compaction, 401 and 403) the real server produces, and its audit log shows what uturn
//! asked, as whom (impersonation included).

use serde_json::Value;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use uturn_testkit::cds;
use uturn_testkit::kube::KubeApi;
use uturn_testkit::netns::Shape;
use uturn_testkit::stunnerd::{free_port, status, temp_dir, temp_file, wait_until, Stunnerd};
use uturn_testkit::turn_client::TurnClient;

const CREATE_PERMISSION: u16 = 0x0008;
const CHANNEL_BIND: u16 = 0x0009;

/// The discovery entry of `service` in `/status`.
fn discovered(health: u16, service: &str) -> Option<Value> {
    status(health)?["discovery"]["kubernetes"]
        .as_array()?
        .iter()
        .find(|s| s["service"] == service)
        .cloned()
}

fn listed(entry: &Option<Value>, field: &str, ip: &str) -> bool {
    entry
        .as_ref()
        .and_then(|e| e[field].as_array().cloned())
        .is_some_and(|a| a.iter().any(|v| v == ip))
}

fn api_of(health: u16, service: &str) -> String {
    discovered(health, service)
        .and_then(|e| e["api"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn kubernetes_config(turn: u16, health: u16, service: &str) -> String {
    format!(
        "version: v1\nadmin: {{name: media/gw, healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\n\
         auth: {{type: static, credentials: {{username: alice, password: s3cret}}}}\n\
         listeners: [{{name: udp, address: 127.0.0.1, port: {turn}, routes: [media]}}]\n\
         clusters: [{{name: media, type: KUBERNETES, endpoints: [\"{service}\"]}}]\n"
    )
}

/// [`kubernetes_config`] as a STUNner v2 document.
fn kubernetes_config_v2(turn: u16, health: u16, service: &str) -> String {
    format!(
        "version: v2\nadmin: {{name: media/gw, healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\n\
         auth: {{type: static, credentials: {{username: alice, password: s3cret}}}}\n\
         listeners: [{{name: udp, port: {turn}, servers: [turn]}}]\n\
         servers: [{{name: turn, clusters: [media]}}]\n\
         clusters: [{{name: media, type: KUBERNETES, protocol: UDP, endpoints: [\"{service}\"], \
         addresses: [127.0.0.1]}}]\n"
    )
}

fn static_config(turn: u16, health: u16) -> String {
    format!(
        "version: v1\nadmin: {{name: media/gw, healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\n\
         auth: {{type: static, credentials: {{username: alice, password: s3cret}}}}\n\
         listeners: [{{name: udp, address: 127.0.0.1, port: {turn}, routes: [media]}}]\n\
         clusters: [{{name: media, endpoints: [127.0.0.1]}}]\n"
    )
}

/// Namespace `namespace`, written before what lives in it.
fn namespace(namespace: &str) -> String {
    format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {namespace}\n")
}

/// A Service without a selector (no controller runs to manage its slices anyway) with the
/// ClusterIPs `cluster_ips` (one per family; two make it dual-stack).
fn service(namespace: &str, name: &str, cluster_ips: &[&str]) -> String {
    let policy = if cluster_ips.len() > 1 {
        "RequireDualStack"
    } else {
        "SingleStack"
    };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {namespace}\n\
         spec:\n  type: ClusterIP\n  ipFamilyPolicy: {policy}\n  clusterIP: {}\n  \
         clusterIPs: [{}]\n  ports:\n  - {{name: rtp, port: 10000, protocol: UDP}}\n",
        cluster_ips[0],
        cluster_ips.join(", ")
    )
}

/// An EndpointSlice of Service `service`, one endpoint per `(address, ready, serving,
/// terminating)`.
fn endpoint_slice(
    namespace: &str,
    name: &str,
    service: &str,
    endpoints: &[(&str, bool, bool, bool)],
) -> String {
    let endpoints: String = endpoints
        .iter()
        .map(|(ip, ready, serving, terminating)| {
            format!(
                "  - addresses: [\"{ip}\"]\n    conditions: {{ready: {ready}, serving: {serving}, \
                 terminating: {terminating}}}\n    nodeName: node-1\n    targetRef: {{kind: Pod, \
                 namespace: {namespace}, name: pod-{}}}\n",
                ip.replace('.', "-")
            )
        })
        .collect();
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  \
         namespace: {namespace}\n  labels:\n    kubernetes.io/service-name: {service}\n\
         addressType: IPv4\nports:\n  - {{name: rtp, port: 10000, protocol: UDP}}\n\
         endpoints:\n{endpoints}"
    )
}

/// A datagram `socket` received, and from where.
fn recv(socket: &std::net::UdpSocket) -> Option<(Vec<u8>, SocketAddr)> {
    let mut buf = [0u8; 2048];
    socket
        .recv_from(&mut buf)
        .ok()
        .map(|(n, from)| (buf[..n].to_vec(), from))
}

fn got(d: &TurnClient, data: &[u8]) -> bool {
    d.received.iter().any(|(_, p)| p == data)
}

fn ready(health: u16) -> Option<u16> {
    uturn_testkit::stunnerd::http_get(health, "/ready").map(|(code, _)| code)
}

/// A stunnerd following the config file `config` as user `uturn` (its kubeconfig), with `args`.
fn stunnerd_as_uturn(api: &KubeApi, config: &std::path::Path, args: &[&str]) -> Stunnerd {
    let origin = format!("file://{}", config.display());
    let kubeconfig = api.uturn_kubeconfig().to_str().unwrap().to_string();
    let mut all = vec!["-c", &origin, "--kubeconfig", &kubeconfig];
    all.extend_from_slice(args);
    Stunnerd::start(&all, &[])
}

/// Seconds since midnight UTC, the audit log's clock ([`uturn_testkit::kube::AuditEvent::received`]).
fn now_of_day() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        % 86_400.0
}

/// Every request user `uturn` made was granted: deploy/'s RBAC is all it needs.
fn assert_never_refused(api: &KubeApi) {
    assert_never_refused_since(api, 0.0);
}

/// Every request user `uturn` made from `since` (seconds of the day) on was granted. (A
/// kube-apiserver that is starting answers before its RBAC caches are filled, and refuses
/// meanwhile: a test that restarts it counts from its `/readyz`.)
fn assert_never_refused_since(api: &KubeApi, since: f64) {
    let audit = api.audit();
    assert!(!audit.is_empty(), "no request of uturn in the audit log");
    let refused: Vec<_> = audit
        .iter()
        .filter(|e| (e.code == 401 || e.code == 403) && e.received >= since)
        .collect();
    assert!(
        refused.is_empty(),
        "deploy's RBAC did not cover: {refused:#?}"
    );
    assert!(audit.iter().all(|e| e.user == "uturn"), "{audit:#?}");
}

/// The first field report: a media pod that starts draining keeps its calls, and only when
/// its endpoint is finally gone does the gateway refuse it.
#[test]
fn terminating_endpoint_keeps_relaying_until_it_is_deleted() {
    terminating_endpoint_scenario(kubernetes_config);
}

/// The same with a STUNner v2 config: terminating endpoints and the peer policy apply alike.
#[test]
fn terminating_endpoint_keeps_relaying_until_it_is_deleted_v2() {
    terminating_endpoint_scenario(kubernetes_config_v2);
}

fn terminating_endpoint_scenario(config_of: fn(u16, u16, &str) -> String) {
    let pods = Shape::new("uk").host("pod").build();
    let pod = pods.ip("pod").to_string();
    let api = KubeApi::start();
    api.grant_deploy_rbac();
    let slice = |ready, terminating| {
        endpoint_slice(
            "media",
            "media-server-abc",
            "media-server",
            &[(&pod, ready, true, terminating)],
        )
    };
    api.apply(&namespace("media"));
    api.apply(&format!(
        "{}---\n{}",
        service("media", "media-server", &["10.96.0.10"]),
        slice(true, false)
    ));
    let (turn, health) = (free_port(), free_port());
    let config = temp_file("k8s-seed.yaml");
    std::fs::write(&config, config_of(turn, health, "media/media-server")).unwrap();
    let server = stunnerd_as_uturn(&api, &config, &[]);
    assert!(
        wait_until(20, || listed(
            &discovered(health, "media/media-server"),
            "addresses",
            &pod
        )),
        "the pod was never discovered: {:?}\n{}",
        status(health),
        server.logs()
    );
    let entry = discovered(health, "media/media-server");
    assert!(listed(&entry, "clusterIPs", "10.96.0.10"), "{entry:?}");
    assert_eq!(api_of(health, "media/media-server"), "connected");

    let media = pods.udp_socket("pod", 0);
    media
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let media_addr = media.local_addr().unwrap();
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    let relay = d.allocate().expect("allocation");
    assert!(d.permit(media_addr.ip()), "{:?}", d.responses);
    assert!(d.bind(media_addr));
    d.send(media_addr, b"hello pod");
    // The relay socket is on loopback, the pod is not: the pod sees it at the gateway's address
    // on the pod network, same port, and answers there.
    let (data, relayed_from) = recv(&media).expect("nothing relayed to the pod");
    assert_eq!(data, b"hello pod");
    assert_eq!(
        relayed_from.port(),
        relay.port(),
        "{relayed_from} vs {relay}"
    );
    media.send_to(b"hello client", relayed_from).unwrap();
    d.drive(0.3);
    assert!(got(&d, b"hello client"));

    // The pod is deleted: it drains, its endpoint turns ready=false serving=true terminating=true.
    api.apply(&slice(false, true));
    assert!(
        wait_until(10, || listed(
            &discovered(health, "media/media-server"),
            "terminating",
            &pod
        )),
        "{:?}",
        discovered(health, "media/media-server")
    );
    // Refresh the permission (twice) and the channel: the client thinks minutes have passed.
    let before = d.responses.len();
    d.warp(Duration::from_secs(250));
    d.drive(0.5);
    d.warp(Duration::from_secs(295));
    d.drive(0.5);
    let refreshes = &d.responses[before..];
    let ok = |method| refreshes.iter().any(|r| r.method == method && r.success);
    assert!(
        ok(CREATE_PERMISSION),
        "no successful permission refresh: {refreshes:?}"
    );
    assert!(
        ok(CHANNEL_BIND),
        "no successful channel refresh: {refreshes:?}"
    );
    assert!(refreshes.iter().all(|r| r.success), "{refreshes:?}");
    assert!(
        !d.events.iter().any(|e| e.contains("Failed")),
        "{:?}",
        d.events
    );
    d.send(media_addr, b"still there");
    assert_eq!(
        recv(&media).map(|r| r.0).as_deref(),
        Some(&b"still there"[..])
    );
    media.send_to(b"still here", relayed_from).unwrap();
    d.drive(0.3);
    assert!(got(&d, b"still here"));

    // The endpoint is finally removed.
    api.kubectl(&["delete", "endpointslice", "media-server-abc", "-n", "media"])
        .unwrap();
    assert!(wait_until(10, || {
        let entry = discovered(health, "media/media-server");
        entry.is_some() && !listed(&entry, "addresses", &pod)
    }));
    let mut late = TurnClient::new(turn_addr, "alice", "s3cret");
    late.allocate().expect("allocation");
    assert!(
        !late.permit(media_addr.ip()),
        "permission to a deleted endpoint granted"
    );
    assert!(
        late.responses
            .iter()
            .any(|r| r.method == CREATE_PERMISSION && r.error_code == Some(403)),
        "{:?}",
        late.responses
    );
    d.send(media_addr, b"dropped");
    assert_eq!(
        recv(&media),
        None,
        "a datagram to a deleted endpoint was relayed"
    );
    media.send_to(b"dropped too", relayed_from).unwrap();
    d.drive(0.5);
    assert!(
        !got(&d, b"dropped too"),
        "a datagram from a deleted endpoint was relayed"
    );
    assert_never_refused(&api);
    let _ = std::fs::remove_file(config);
}

/// Two slices for one dual-stack Service; kube-apiserver goes away (killed), one slice is
/// deleted meanwhile (through a second kube-apiserver on the same etcd) and etcd compacted past
/// the deletion. kube-apiserver comes back on the same port and etcd: the watch resumes from
/// its old resource version and is answered 410 Gone (expired), stunnerd relists, and the
/// deleted slice's addresses go.
#[test]
fn relist_after_an_outage_drops_slices_deleted_meanwhile() {
    let mut api = KubeApi::start_with(&["--service-cluster-ip-range=10.96.0.0/16,fd00::/108"]);
    api.grant_deploy_rbac();
    api.apply(&namespace("media"));
    api.apply(&format!(
        "{}---\n{}---\n{}",
        service("media", "sfu", &["10.96.0.20", "fd00::20"]),
        endpoint_slice(
            "media",
            "sfu-a",
            "sfu",
            &[("10.218.0.3", true, true, false)]
        ),
        endpoint_slice(
            "media",
            "sfu-b",
            "sfu",
            &[("10.218.0.4", true, true, false)]
        ),
    ));
    let (turn, health) = (free_port(), free_port());
    let config = temp_file("k8s-relist.yaml");
    std::fs::write(&config, kubernetes_config(turn, health, "media/sfu")).unwrap();
    let server = stunnerd_as_uturn(&api, &config, &[]);
    let both = || {
        let e = discovered(health, "media/sfu");
        listed(&e, "addresses", "10.218.0.3") && listed(&e, "addresses", "10.218.0.4")
    };
    assert!(
        wait_until(20, both),
        "{:?}\n{}",
        status(health),
        server.logs()
    );
    assert!(listed(
        &discovered(health, "media/sfu"),
        "clusterIPs",
        "fd00::20"
    ));
    let lists = |api: &KubeApi| {
        api.audit()
            .iter()
            .filter(|e| e.verb == "list" && e.resource == "endpointslices" && e.code == 200)
            .count()
    };
    let lists_before = lists(&api);

    assert_never_refused(&api);
    let peer = api.start_peer();
    let stopped = now_of_day();
    api.stop_apiserver();
    assert!(
        wait_until(20, || api_of(health, "media/sfu")
            .starts_with("unreachable")),
        "{:?}",
        discovered(health, "media/sfu")
    );
    assert!(
        server.logs().contains("Kubernetes API unreachable"),
        "{}",
        server.logs()
    );
    peer.kubectl(&["delete", "endpointslice", "sfu-b", "-n", "media"])
        .unwrap();
    let compacted = api.compact_etcd();
    peer.stop();
    // Meanwhile the last known endpoints stay in force.
    assert!(
        both(),
        "endpoints were dropped while the API server was away"
    );
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    d.allocate().expect("allocation");
    assert!(d.permit("10.218.0.4".parse::<IpAddr>().unwrap()));

    api.start_apiserver();
    let ready_again = now_of_day();
    assert!(
        wait_until(30, || {
            let e = discovered(health, "media/sfu");
            listed(&e, "addresses", "10.218.0.3")
                && !listed(&e, "addresses", "10.218.0.4")
                && e.is_some_and(|e| e["api"] == "connected")
        }),
        "{:?}\n{}",
        discovered(health, "media/sfu"),
        server.logs()
    );
    let logs = server.logs();
    assert!(
        logs.contains(
            "Kubernetes API reachable again: watching EndpointSlices of Service media/sfu"
        ),
        "{logs}"
    );
    // The watch resumed from its old resource version and was answered 410 Gone…
    assert!(
        logs.contains("watch of EndpointSlices of Service media/sfu expired")
            && logs.contains("410 Gone"),
        "the watch never resumed from the compacted version (compacted to {compacted}): {logs}"
    );
    // …after which stunnerd listed again (one list of slices before the outage, one after).
    let watches_after: Vec<_> = api
        .audit()
        .into_iter()
        .filter(|e| e.verb == "watch" && e.resource == "endpointslices")
        .collect();
    assert!(
        watches_after
            .iter()
            .any(|e| e.uri.contains("resourceVersion=")),
        "{watches_after:#?}"
    );
    assert!(lists(&api) > lists_before, "no relist: {:#?}", api.audit());
    let mut late = TurnClient::new(turn_addr, "alice", "s3cret");
    late.allocate().expect("allocation");
    assert!(!late.permit("10.218.0.4".parse::<IpAddr>().unwrap()));
    // The restarted kube-apiserver may answer before its RBAC caches are filled, and refuse
    // meanwhile: stunnerd retries a refusal that follows an outage once (1 s) before it
    // reports it. So unless the audit shows one watcher refused twice in a row, no refusal is
    // logged: the outage ends with "reachable again", not with a call to grant RBAC.
    let logs = server.logs();
    for resource in ["endpointslices", "services"] {
        let codes: Vec<u16> = api
            .audit()
            .iter()
            .filter(|e| e.resource == resource && e.received >= stopped)
            .map(|e| e.code)
            .collect();
        if !codes.windows(2).any(|w| w == [403, 403]) {
            let refusal = format!(" {resource} in namespace \"media\" (forbidden)");
            assert_eq!(error_lines(&logs, &refusal), 0, "{codes:?}: {logs}");
        }
    }
    assert_never_refused_since(&api, ready_again);
    let _ = std::fs::remove_file(config);
}

/// A new pod must not report ready before it knows the endpoints of its Services, or it
/// answers 403 to every peer while taking traffic; with the API server down it becomes ready
/// after --discovery-timeout and says why.
#[test]
fn ready_waits_for_the_first_endpoint_list_up_to_the_discovery_timeout() {
    let mut api = KubeApi::start();
    api.grant_deploy_rbac();
    api.apply(&namespace("media"));
    api.apply(&format!(
        "{}---\n{}",
        service("media", "ready-svc", &["10.96.0.30"]),
        endpoint_slice(
            "media",
            "ready-svc-a",
            "ready-svc",
            &[("10.218.0.5", true, true, false)],
        )
    ));
    api.stop_apiserver();
    let start = |api: &KubeApi, timeout: &str| {
        let (turn, health) = (free_port(), free_port());
        let config = temp_file("k8s-ready.yaml");
        std::fs::write(&config, kubernetes_config(turn, health, "media/ready-svc")).unwrap();
        let server = stunnerd_as_uturn(api, &config, &["--discovery-timeout", timeout]);
        (server, health, config)
    };

    // The API server stays down: 503 until the timeout, then 200 and a warning naming the Service.
    let started = std::time::Instant::now();
    let (server, health, config) = start(&api, "4");
    assert!(
        wait_until(10, || ready(health).is_some()),
        "{}",
        server.logs()
    );
    assert_eq!(
        ready(health),
        Some(503),
        "ready before the Service was listed"
    );
    let entry = discovered(health, "media/ready-svc");
    assert!(
        entry
            .as_ref()
            .is_some_and(|e| e["synced"] == false && e["syncTimedOut"] == false),
        "{entry:?}"
    );
    assert!(
        status(health).is_some_and(|s| s["discovery"]["readyWaitsFor"][0] == "media/ready-svc"),
        "{:?}",
        status(health)
    );
    std::thread::sleep(Duration::from_secs(2).saturating_sub(started.elapsed()));
    assert_eq!(ready(health), Some(503));
    assert!(
        wait_until(10, || ready(health) == Some(200)),
        "{}",
        server.logs()
    );
    assert!(
        started.elapsed() >= Duration::from_secs(4),
        "ready before the timeout"
    );
    let logs = server.logs();
    assert!(
        logs.contains("Service media/ready-svc not synced within --discovery-timeout"),
        "{logs}"
    );
    assert!(discovered(health, "media/ready-svc").is_some_and(|e| e["syncTimedOut"] == true));
    assert!(api_of(health, "media/ready-svc").starts_with("unreachable, keeping last known endpoints: cannot list endpointslices in namespace \"media\""), "{:?}", discovered(health, "media/ready-svc"));
    drop(server);
    let _ = std::fs::remove_file(config);

    // The API server comes back before the timeout: ready exactly once the list is in.
    let (server, health, config) = start(&api, "60");
    assert!(
        wait_until(10, || ready(health).is_some()),
        "{}",
        server.logs()
    );
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(ready(health), Some(503));
    api.start_apiserver();
    let ready_again = now_of_day();
    assert!(
        wait_until(30, || ready(health) == Some(200)),
        "{}",
        server.logs()
    );
    let entry = discovered(health, "media/ready-svc");
    assert!(
        listed(&entry, "addresses", "10.218.0.5"),
        "ready without the endpoints: {entry:?}"
    );
    assert!(
        !server.logs().contains("not synced within"),
        "{}",
        server.logs()
    );
    assert_never_refused_since(&api, ready_again);
    let _ = std::fs::remove_file(config);
}

fn cds_kubernetes_config(turn: u16, health: u16, with_service: bool) -> String {
    let (routes, clusters) = if with_service {
        (
            r#"["media/static","media/svc"]"#,
            r#"[{"name":"media/static","type":"STATIC","endpoints":["127.0.0.9"]},{"name":"media/svc","type":"KUBERNETES","endpoints":["media/batch-svc"]}]"#,
        )
    } else {
        (
            r#"["media/static"]"#,
            r#"[{"name":"media/static","type":"STATIC","endpoints":["127.0.0.9"]}]"#,
        )
    };
    format!(
        r#"{{"version":"v1","admin":{{"name":"media/gw","healthcheck_endpoint":"http://127.0.0.1:{health}"}},"auth":{{"type":"static","credentials":{{"username":"alice","password":"s3cret"}}}},"listeners":[{{"name":"media/gw/udp","protocol":"TURN-UDP","address":"127.0.0.1","port":{turn},"routes":{routes}}}],"clusters":{clusters}}}"#
    )
}

/// A Service whose cluster is removed and added again in one config batch keeps its
/// endpoints: its watch restarts (a kept watch only sends changes, never the list again).
#[test]
fn a_service_removed_and_readded_in_one_batch_keeps_its_endpoints() {
    let api = KubeApi::start();
    api.grant_deploy_rbac();
    api.apply(&namespace("media"));
    api.apply(&format!(
        "{}---\n{}",
        service("media", "batch-svc", &["10.96.0.40"]),
        endpoint_slice(
            "media",
            "batch-svc-a",
            "batch-svc",
            &[("10.218.0.6", true, true, false)],
        )
    ));
    let cds = cds::FakeCds::start("127.0.0.1:0");
    let (turn, health) = (free_port(), free_port());
    cds.push("media/gw", &cds_kubernetes_config(turn, health, true));
    let kubeconfig = api.uturn_kubeconfig().to_str().unwrap().to_string();
    let server = Stunnerd::start(
        &[
            "-w",
            "-c",
            &format!("http://{}", cds.addr()),
            "--id",
            "media/gw",
            "--kubeconfig",
            &kubeconfig,
        ],
        &[],
    );
    let known = || {
        listed(
            &discovered(health, "media/batch-svc"),
            "addresses",
            "10.218.0.6",
        )
    };
    assert!(
        wait_until(20, known),
        "{:?}\n{}",
        status(health),
        server.logs()
    );
    let slice_lists = || {
        api.audit()
            .iter()
            .filter(|e| {
                e.verb == "list"
                    && e.resource == "endpointslices"
                    && e.uri.contains("batch-svc")
                    && e.code == 200
            })
            .count()
    };
    let first = slice_lists();
    assert_eq!(first, 1, "{:#?}", api.audit());

    cds.push_many(
        "media/gw",
        &[
            &cds_kubernetes_config(turn, health, false),
            &cds_kubernetes_config(turn, health, true),
        ],
    );
    // Both configs applied (two reconciliations), then the endpoints are back.
    assert!(
        wait_until(10, || server.logs().matches("Reconciliation ready").count()
            >= 3),
        "{}",
        server.logs()
    );
    assert!(
        wait_until(10, known),
        "the Service lost its endpoints: {:?}\n{}",
        discovered(health, "media/batch-svc"),
        server.logs()
    );
    assert!(
        wait_until(10, || slice_lists() > first),
        "the watch was not restarted (no new list): {:#?}",
        api.audit()
    );
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    d.allocate().expect("allocation");
    assert!(
        d.permit("10.218.0.6".parse::<IpAddr>().unwrap()),
        "{:?}",
        d.responses
    );
    assert_never_refused(&api);
}

/// Second-chance forwarding's siblings, with `--siblings k8s:<ns>/<service>`, follow the
/// EndpointSlices of the gateway's own Service through the real kube-rs client: ready and
/// terminating pods are siblings (a draining pod still owns its calls), a removed one goes,
/// and `/status` lists them. deploy/overlays/siblings adds no RBAC: deploy/base's is enough.
#[test]
fn siblings_follow_the_gateway_services_endpoint_slices() {
    let overlay = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../deploy/overlays/siblings/kustomization.yaml"),
    )
    .unwrap();
    assert!(
        !overlay.contains("rbac") && !overlay.contains("Role"),
        "deploy/overlays/siblings now changes RBAC: grant what it grants here too"
    );
    let api = KubeApi::start();
    api.grant_deploy_rbac();
    api.apply(&namespace("stunner"));
    let slice = |endpoints: &[(&str, bool, bool, bool)]| {
        endpoint_slice("stunner", "udp-gateway-abc", "udp-gateway", endpoints)
    };
    api.apply(&format!(
        "{}---\n{}",
        service("stunner", "udp-gateway", &["10.96.0.30"]),
        slice(&[
            ("10.244.1.5", true, true, false),
            ("10.244.2.7", false, true, true),
        ])
    ));
    let (turn, health) = (free_port(), free_port());
    let config = temp_file("k8s-siblings.yaml");
    std::fs::write(&config, static_config(turn, health)).unwrap();
    let sibling_port = free_port().to_string();
    let kubeconfig = api.uturn_kubeconfig().to_str().unwrap().to_string();
    let server = Stunnerd::start(
        &[
            "-c",
            &format!("file://{}", config.display()),
            "--siblings",
            "k8s:stunner/udp-gateway",
            "--sibling-port",
            &sibling_port,
        ],
        &[
            ("KUBECONFIG", &kubeconfig),
            ("UTURN_SIBLING_KEY", "a key of at least sixteen bytes"),
        ],
    );
    let siblings = || -> Vec<String> {
        status(health)
            .and_then(|s| s["siblings"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|s| s["address"].as_str().map(str::to_owned))
            .collect()
    };
    assert!(
        wait_until(20, || siblings() == ["10.244.1.5", "10.244.2.7"]),
        "{:?}\n{}",
        status(health),
        server.logs()
    );
    // The terminating pod is deleted.
    api.apply(&slice(&[("10.244.1.5", true, true, false)]));
    assert!(
        wait_until(10, || siblings() == ["10.244.1.5"]),
        "{:?}",
        status(health)
    );
    api.kubectl(&[
        "delete",
        "endpointslice",
        "udp-gateway-abc",
        "-n",
        "stunner",
    ])
    .unwrap();
    assert!(
        wait_until(10, || siblings().is_empty()),
        "{:?}",
        status(health)
    );
    assert!(api
        .audit()
        .iter()
        .any(|e| e.resource == "endpointslices" && e.namespace == "stunner"));
    assert_never_refused(&api);
    let _ = std::fs::remove_file(config);
}

/// The sentence stunnerd reports when the API server refuses user `uturn` `verb` on
/// `resource` in namespace `media`.
fn refusal(verb: &str, resource: &str) -> String {
    format!(
        "Kubernetes API refuses user \"uturn\": cannot {verb} {resource} in namespace \"media\" \
         (forbidden); grant get, list and watch on endpointslices and services \
         (deploy/base/rbac.yaml)"
    )
}

/// How many of stunnerd's k8s ERROR lines say `text`. (The discovery timeout's warning quotes
/// the API's failure too.)
fn error_lines(logs: &str, text: &str) -> usize {
    logs.lines()
        .filter(|l| l.contains(" k8s ERROR: ") && l.contains(text))
        .count()
}

/// Namespace `media` with Service `media-server` (ClusterIP 10.96.0.10) and one slice holding
/// `ip`, ready; a KUBERNETES config naming the Service in temp file `file`: (TURN port,
/// health port, config path).
fn media_with_one_endpoint(api: &KubeApi, ip: &str, file: &str) -> (u16, u16, std::path::PathBuf) {
    api.apply(&namespace("media"));
    api.apply(&format!(
        "{}---\n{}",
        service("media", "media-server", &["10.96.0.10"]),
        endpoint_slice(
            "media",
            "media-server-abc",
            "media-server",
            &[(ip, true, true, false)]
        )
    ));
    let (turn, health) = (free_port(), free_port());
    let config = temp_file(file);
    std::fs::write(
        &config,
        kubernetes_config(turn, health, "media/media-server"),
    )
    .unwrap();
    (turn, health, config)
}

/// Without RBAC the API server refuses uturn (403): stunnerd says so in one sentence naming
/// the user, the verb, the resource and the namespace and what to grant, logs it once, shows it
/// in `/status`, and backs off (1, 2, 4, 8… s, up to 60 s) instead of retrying every second.
/// Granted later, the endpoints arrive at the next retry, within the backoff.
#[test]
fn a_refused_permission_is_reported_once_backs_off_and_recovers_when_granted() {
    let api = KubeApi::start();
    let (_, health, config) = media_with_one_endpoint(&api, "10.218.0.7", "k8s-refused.yaml");
    let started = std::time::Instant::now();
    let server = stunnerd_as_uturn(&api, &config, &[]);
    let sentence = refusal("list", "endpointslices");
    assert!(
        wait_until(20, || {
            let api = api_of(health, "media/media-server");
            api.starts_with(&sentence[..]) || api.starts_with(&refusal("list", "services")[..])
        }),
        "/status never said the list was refused: {:?}\n{}",
        discovered(health, "media/media-server"),
        server.logs()
    );
    // /status holds a sentence, not a Rust debug dump of the Status object.
    let shown = api_of(health, "media/media-server");
    assert!(
        !shown.contains("Status {") && !shown.contains("ApiError"),
        "{shown}"
    );
    assert!(shown.contains("the API server says: "), "{shown}");

    // Twelve seconds of refusals: retries 1, 2, 4, 8 s apart (not every second), one log line.
    std::thread::sleep(Duration::from_secs(12).saturating_sub(started.elapsed()));
    let refused_lists: Vec<f64> = api
        .audit()
        .iter()
        .filter(|e| e.verb == "list" && e.resource == "endpointslices" && e.code == 403)
        .map(|e| e.received)
        .collect();
    assert!(
        (3..=5).contains(&refused_lists.len()),
        "{} refused lists of endpointslices in 12 s (want about 4, backing off): {refused_lists:?}",
        refused_lists.len()
    );
    let gaps: Vec<f64> = refused_lists.windows(2).map(|w| w[1] - w[0]).collect();
    for pair in gaps.windows(2) {
        assert!(
            pair[1] > pair[0] * 1.5,
            "the retries do not back off: gaps {gaps:?}"
        );
    }
    let logs = server.logs();
    for resource in ["endpointslices", "services"] {
        let lines = error_lines(&logs, &refusal("list", resource));
        assert_eq!(
            lines, 1,
            "the refusal of {resource} is not logged once: {logs}"
        );
    }
    assert!(
        !logs.contains("reachable again") && !logs.contains("unreachable"),
        "{logs}"
    );
    // No debug dump in the log either (kube-rs's own warning carries one).
    assert!(!logs.contains("Status {"), "{logs}");

    // Granted: the endpoints arrive at the next retry (the next gap, 16 s at most from here).
    let granted = std::time::Instant::now();
    api.grant_deploy_rbac();
    assert!(
        wait_until(20, || listed(
            &discovered(health, "media/media-server"),
            "addresses",
            "10.218.0.7"
        )),
        "the endpoints never came once granted: {:?}\n{}",
        discovered(health, "media/media-server"),
        server.logs()
    );
    assert!(
        granted.elapsed() < Duration::from_secs(17),
        "recovered {:?} after the grant",
        granted.elapsed()
    );
    assert!(
        wait_until(20, || api_of(health, "media/media-server") == "connected"),
        "{:?}",
        discovered(health, "media/media-server")
    );
    let logs = server.logs();
    assert_eq!(
        logs.matches("Kubernetes API reachable again").count(),
        2,
        "one recovery per watcher (EndpointSlices, the Service): {logs}"
    );
    let _ = std::fs::remove_file(config);
}

/// deploy's ClusterRole without `watch` on endpointslices: the list works, the watch is
/// refused, and stunnerd says "cannot watch". Granted, it recovers without any change to the
/// slices (a started watch shows no event: stunnerd probes it), and changes flow again.
#[test]
fn a_refused_watch_is_named_and_its_grant_is_noticed_without_an_event() {
    let api = KubeApi::start();
    let role = uturn_testkit::kube::deploy_cluster_role();
    let granted = r#"verbs: ["get", "list", "watch"]"#;
    let at = role.find("endpointslices").unwrap();
    let verbs = at + role[at..].find(granted).unwrap();
    let no_watch = format!(
        "{}{}{}",
        &role[..verbs],
        r#"verbs: ["get", "list"]"#,
        &role[verbs + granted.len()..]
    )
    .replace("name: uturn-endpoint-reader", "name: uturn-no-watch");
    api.grant_cluster_role(&no_watch);
    let (_, health, config) = media_with_one_endpoint(&api, "10.218.0.8", "k8s-no-watch.yaml");
    let server = stunnerd_as_uturn(&api, &config, &[]);
    let sentence = refusal("watch", "endpointslices");
    assert!(
        wait_until(20, || api_of(health, "media/media-server")
            .starts_with(&sentence[..])),
        "{:?}\n{}",
        discovered(health, "media/media-server"),
        server.logs()
    );
    // The list went through: the endpoints are known.
    assert!(listed(
        &discovered(health, "media/media-server"),
        "addresses",
        "10.218.0.8"
    ));
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        error_lines(&server.logs(), &sentence),
        1,
        "{}",
        server.logs()
    );

    api.grant_deploy_rbac();
    assert!(
        wait_until(20, || api_of(health, "media/media-server") == "connected"),
        "the granted watch was not noticed: {:?}\n{}",
        discovered(health, "media/media-server"),
        server.logs()
    );
    api.apply(&endpoint_slice(
        "media",
        "media-server-abc",
        "media-server",
        &[("10.218.0.9", true, true, false)],
    ));
    assert!(
        wait_until(10, || {
            let e = discovered(health, "media/media-server");
            listed(&e, "addresses", "10.218.0.9") && !listed(&e, "addresses", "10.218.0.8")
        }),
        "{:?}\n{}",
        discovered(health, "media/media-server"),
        server.logs()
    );
    let _ = std::fs::remove_file(config);
}

/// kubectl's connection flags alone, no kubeconfig anywhere (an empty HOME, no KUBECONFIG) and
/// not in a pod: `--server` with `--token` and `--certificate-authority`, or with
/// `--client-certificate`, `--client-key` and `--insecure-skip-tls-verify`, is the whole config
/// (as kubectl's). A wrong token is a 401, reported as such.
#[test]
fn kubectl_connection_flags_work_without_a_kubeconfig() {
    let api = KubeApi::start();
    api.grant_deploy_rbac();
    api.apply(&namespace("media"));
    api.apply(&format!(
        "{}---\n{}",
        service("media", "media-server", &["10.96.0.10"]),
        endpoint_slice(
            "media",
            "media-server-abc",
            "media-server",
            &[("10.218.0.10", true, true, false)],
        )
    ));
    let home = temp_dir("k8s-home");
    let home = home.to_str().unwrap().to_string();
    let url = api.url().to_string();
    let start = |flags: &[&str]| {
        let (turn, health) = (free_port(), free_port());
        let config = temp_file("k8s-flags.yaml");
        std::fs::write(
            &config,
            kubernetes_config(turn, health, "media/media-server"),
        )
        .unwrap();
        let origin = format!("file://{}", config.display());
        let mut args = vec!["-c", &origin, "--server", &url];
        args.extend_from_slice(flags);
        let server = Stunnerd::start(&args, &[("HOME", &home), ("KUBECONFIG", "")]);
        (server, health, config)
    };
    let discovers = |(server, health, config): (Stunnerd, u16, std::path::PathBuf)| {
        assert!(
            wait_until(20, || listed(
                &discovered(health, "media/media-server"),
                "addresses",
                "10.218.0.10"
            )),
            "{:?}\n{}",
            discovered(health, "media/media-server"),
            server.logs()
        );
        assert!(
            !server.logs().contains("no Kubernetes credentials"),
            "{}",
            server.logs()
        );
        assert_eq!(api_of(health, "media/media-server"), "connected");
        let _ = std::fs::remove_file(config);
    };

    let ca = api.ca_file().to_str().unwrap().to_string();
    discovers(start(&[
        "--token",
        api.uturn_token(),
        "--certificate-authority",
        &ca,
    ]));
    let (cert, key) = api.uturn_client_certificate();
    let (cert, key) = (cert.to_str().unwrap(), key.to_str().unwrap());
    discovers(start(&[
        "--client-certificate",
        cert,
        "--client-key",
        key,
        "--insecure-skip-tls-verify",
    ]));
    // Both authenticated as uturn (the token, then the certificate's CN), never refused.
    assert_never_refused(&api);

    let (server, health, config) = start(&[
        "--token",
        "not-a-token-the-api-server-knows",
        "--certificate-authority",
        &ca,
    ]);
    let unauthorized = "Kubernetes API does not accept stunnerd's credentials: cannot list \
                        endpointslices in namespace \"media\" (unauthorized)";
    assert!(
        wait_until(20, || api_of(health, "media/media-server")
            .starts_with(unauthorized)),
        "{:?}\n{}",
        discovered(health, "media/media-server"),
        server.logs()
    );
    assert_eq!(
        error_lines(&server.logs(), unauthorized),
        1,
        "{}",
        server.logs()
    );
    let _ = std::fs::remove_dir_all(&home);
    let _ = std::fs::remove_file(config);
}

/// The kubectl impersonation flags reach the API server: with `--as`, `--as-group` and
/// `--as-uid`, uturn's requests are made as that user, group and uid (the API server's audit
/// log names them), when its user may impersonate them.
#[test]
fn kubectl_impersonation_flags_reach_the_api_server() {
    let api = KubeApi::start();
    api.grant_cluster_role(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\n\
         metadata:\n  name: uturn-impersonator\nrules:\n\
         - apiGroups: [\"\"]\n  resources: [users, groups]\n  verbs: [impersonate]\n\
         - apiGroups: [authentication.k8s.io]\n  resources: [uids]\n  verbs: [impersonate]\n",
    );
    let (_, _, config) = media_with_one_endpoint(&api, "10.218.0.9", "k8s-impersonate.yaml");
    let server = stunnerd_as_uturn(
        &api,
        &config,
        &[
            "--as",
            "gateway-bot",
            "--as-group",
            "media-admins",
            "--as-uid",
            "1234",
        ],
    );
    let impersonated = || {
        api.audit().into_iter().any(|e| {
            e.resource == "endpointslices"
                && e.impersonated_user.as_deref() == Some("gateway-bot")
                && e.impersonated_uid.as_deref() == Some("1234")
                && e.impersonated_groups.iter().any(|g| g == "media-admins")
        })
    };
    assert!(
        wait_until(20, impersonated),
        "{:?}\n{}",
        api.audit(),
        server.logs()
    );
    let _ = std::fs::remove_file(config);
}
