//! A local Kubernetes API-server fake for the discovery tests: plain HTTP/1.1 on 127.0.0.1
//! serving LIST and chunked WATCH of `discovery.k8s.io/v1` EndpointSlices and `v1` Services,
//! with resource versions, label and field selectors, bookmarks, a 410 "Expired" for a watch
//! that resumes from a compacted version, and an outage mode that refuses connections.

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The two resources the fake serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Resource {
    /// `discovery.k8s.io/v1` EndpointSlice.
    EndpointSlice,
    /// `v1` Service.
    Service,
}

struct WatchEvent {
    rv: u64,
    resource: Resource,
    event_type: &'static str,
    object: Value,
}

#[derive(Default)]
struct State {
    rv: u64,
    objects: BTreeMap<(Resource, String, String), Value>,
    history: Vec<WatchEvent>,
    /// Watches from a resource version below this get 410 Expired.
    compacted: u64,
    up: bool,
    /// Bumped to cut every open watch.
    epoch: u64,
    requests: Vec<String>,
    /// The header lines of every request, lower-cased names.
    headers: Vec<String>,
    expired_served: usize,
}

struct Inner {
    state: Mutex<State>,
    changed: Condvar,
}

/// The running fake; stops when dropped.
pub struct FakeApiServer {
    inner: Arc<Inner>,
    addr: SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl FakeApiServer {
    /// Starts the fake on a free loopback port.
    pub fn start() -> FakeApiServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                rv: 100,
                up: true,
                ..State::default()
            }),
            changed: Condvar::new(),
        });
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (inner2, stop2) = (inner.clone(), stop.clone());
        std::thread::spawn(move || accept_loop(Some(listener), addr, inner2, stop2));
        FakeApiServer { inner, addr, stop }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig pointing at the fake and returns its path.
    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join(format!("kubeconfig-{}", self.addr.port()));
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
                 users:\n- name: fake\n  user:\n    token: fake-token\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\ncurrent-context: fake\n",
                self.url()
            ),
        )
        .unwrap();
        path
    }

    /// Creates or replaces an object (ADDED or MODIFIED to watchers).
    pub fn apply(&self, resource: Resource, mut object: Value) {
        let mut s = self.inner.state.lock().unwrap();
        s.rv += 1;
        let rv = s.rv;
        let ns = object["metadata"]["namespace"]
            .as_str()
            .unwrap()
            .to_string();
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        object["metadata"]["uid"] = json!(format!("uid-{ns}-{name}"));
        let key = (resource, ns, name);
        let event_type = if s.objects.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        s.objects.insert(key, object.clone());
        s.history.push(WatchEvent {
            rv,
            resource,
            event_type,
            object,
        });
        self.inner.changed.notify_all();
    }

    /// Deletes an object (DELETED to watchers).
    pub fn delete(&self, resource: Resource, namespace: &str, name: &str) {
        let mut s = self.inner.state.lock().unwrap();
        let Some(mut object) =
            s.objects
                .remove(&(resource, namespace.to_string(), name.to_string()))
        else {
            return;
        };
        s.rv += 1;
        let rv = s.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        s.history.push(WatchEvent {
            rv,
            resource,
            event_type: "DELETED",
            object,
        });
        self.inner.changed.notify_all();
    }

    /// Takes the server down (`false`: open watches are cut and connections refused) or up.
    pub fn set_up(&self, up: bool) {
        let mut s = self.inner.state.lock().unwrap();
        s.up = up;
        s.epoch += 1;
        self.inner.changed.notify_all();
    }

    /// Forgets the history: a watch resuming from an older version gets 410 Expired.
    pub fn compact(&self) {
        let mut s = self.inner.state.lock().unwrap();
        s.compacted = s.rv + 1;
        s.history.clear();
    }

    /// How many watches were answered 410 Expired.
    pub fn expired_served(&self) -> usize {
        self.inner.state.lock().unwrap().expired_served
    }

    /// The header lines received so far (`name: value`, names lower-cased).
    pub fn headers(&self) -> Vec<String> {
        self.inner.state.lock().unwrap().headers.clone()
    }

    /// The request lines served so far.
    pub fn requests(&self) -> Vec<String> {
        self.inner.state.lock().unwrap().requests.clone()
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.set_up(false);
    }
}

/// An EndpointSlice of Service `service` listing `endpoints` as (address, ready, serving,
/// terminating).
pub fn endpoint_slice(
    namespace: &str,
    name: &str,
    service: &str,
    endpoints: &[(&str, bool, bool, bool)],
) -> Value {
    let family = if endpoints.iter().any(|(a, ..)| a.contains(':')) {
        "IPv6"
    } else {
        "IPv4"
    };
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": family,
        "ports": [{"name": "rtp", "port": 10000, "protocol": "UDP"}],
        "endpoints": endpoints.iter().map(|(address, ready, serving, terminating)| json!({
            "addresses": [address],
            "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
            "nodeName": "node-1",
            "targetRef": {"kind": "Pod", "namespace": namespace, "name": format!("pod-{address}")},
        })).collect::<Vec<_>>(),
    })
}

/// A ClusterIP Service.
pub fn service(namespace: &str, name: &str, cluster_ips: &[&str]) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": cluster_ips.first().copied().unwrap_or("None"),
            "clusterIPs": cluster_ips,
            "ports": [{"name": "rtp", "port": 10000, "protocol": "UDP"}],
        },
    })
}

fn accept_loop(
    mut listener: Option<TcpListener>,
    addr: SocketAddr,
    inner: Arc<Inner>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let up = inner.state.lock().unwrap().up;
        if !up {
            // Refuse connections while down, like an API server that is not there.
            listener = None;
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let l = match &listener {
            Some(l) => l,
            None => match TcpListener::bind(addr) {
                Ok(l) => {
                    l.set_nonblocking(true).unwrap();
                    listener.insert(l)
                }
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            },
        };
        l.set_nonblocking(true).unwrap();
        match l.accept() {
            Ok((stream, _)) => {
                let inner = inner.clone();
                std::thread::spawn(move || {
                    let _ = serve(stream, &inner);
                });
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

fn serve(stream: TcpStream, inner: &Inner) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut headers = Vec::new();
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header == "\r\n" {
            break;
        }
        if let Some((name, value)) = header.trim_end().split_once(':') {
            headers.push(format!("{}: {}", name.to_ascii_lowercase(), value.trim()));
        }
    }
    inner.state.lock().unwrap().headers.extend(headers);
    let target = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let params: BTreeMap<String, String> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| (k.to_string(), percent_decode(v)))
        .collect();
    inner.state.lock().unwrap().requests.push(target.clone());
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (resource, namespace) = match parts.as_slice() {
        ["apis", "discovery.k8s.io", "v1", "namespaces", ns, "endpointslices"] => {
            (Resource::EndpointSlice, ns.to_string())
        }
        ["api", "v1", "namespaces", ns, "services"] => (Resource::Service, ns.to_string()),
        _ => {
            return respond(
                stream,
                404,
                &status_body(404, "NotFound", "no such resource"),
            )
        }
    };
    let filter = Filter {
        resource,
        namespace,
        label: params.get("labelSelector").cloned(),
        field: params.get("fieldSelector").cloned(),
    };
    if params.get("watch").map(String::as_str) == Some("true") {
        watch(stream, inner, &filter, &params)
    } else {
        list(stream, inner, &filter)
    }
}

struct Filter {
    resource: Resource,
    namespace: String,
    label: Option<String>,
    field: Option<String>,
}

impl Filter {
    fn matches(&self, resource: Resource, object: &Value) -> bool {
        if resource != self.resource || object["metadata"]["namespace"] != json!(self.namespace) {
            return false;
        }
        if let Some((key, value)) = self.label.as_deref().and_then(|l| l.split_once('=')) {
            if object["metadata"]["labels"][key] != json!(value) {
                return false;
            }
        }
        if let Some(name) = self
            .field
            .as_deref()
            .and_then(|f| f.strip_prefix("metadata.name="))
        {
            if object["metadata"]["name"] != json!(name) {
                return false;
            }
        }
        true
    }

    fn list_kind(&self) -> (&'static str, &'static str) {
        match self.resource {
            Resource::EndpointSlice => ("discovery.k8s.io/v1", "EndpointSlice"),
            Resource::Service => ("v1", "Service"),
        }
    }
}

fn list(stream: TcpStream, inner: &Inner, filter: &Filter) -> std::io::Result<()> {
    let body = {
        let s = inner.state.lock().unwrap();
        let items: Vec<Value> = s
            .objects
            .iter()
            .filter(|((resource, ..), object)| filter.matches(*resource, object))
            .map(|(_, object)| object.clone())
            .collect();
        let (api_version, kind) = filter.list_kind();
        json!({
            "apiVersion": api_version,
            "kind": format!("{kind}List"),
            "metadata": {"resourceVersion": s.rv.to_string()},
            "items": items,
        })
        .to_string()
    };
    respond(stream, 200, &body)
}

fn watch(
    mut stream: TcpStream,
    inner: &Inner,
    filter: &Filter,
    params: &BTreeMap<String, String>,
) -> std::io::Result<()> {
    let mut from: u64 = params
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bookmarks = params.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let timeout = params
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(290));
    stream.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
    )?;
    let started = Instant::now();
    let mut last_bookmark = Instant::now();
    let mut guard = inner.state.lock().unwrap();
    let epoch = guard.epoch;
    if from < guard.compacted {
        guard.expired_served += 1;
        drop(guard);
        let expired = json!({"type": "ERROR", "object": status_object(410, "Expired", "too old resource version")});
        chunk(&mut stream, &expired.to_string())?;
        return stream.write_all(b"0\r\n\r\n");
    }
    loop {
        if guard.epoch != epoch || !guard.up {
            // Cut mid-stream, as a crashed API server would: no final chunk.
            return Ok(());
        }
        let lines: Vec<String> = guard
            .history
            .iter()
            .filter(|e| e.rv > from && filter.matches(e.resource, &e.object))
            .map(|e| json!({"type": e.event_type, "object": e.object}).to_string())
            .collect();
        let latest = guard.rv;
        drop(guard);
        for line in &lines {
            chunk(&mut stream, line)?;
        }
        from = from.max(latest);
        if bookmarks && last_bookmark.elapsed() >= Duration::from_secs(1) {
            let (api_version, kind) = filter.list_kind();
            let bookmark = json!({"type": "BOOKMARK", "object": {
                "apiVersion": api_version, "kind": kind,
                "metadata": {"resourceVersion": latest.to_string()},
            }});
            chunk(&mut stream, &bookmark.to_string())?;
            last_bookmark = Instant::now();
        }
        if started.elapsed() >= timeout {
            return stream.write_all(b"0\r\n\r\n");
        }
        guard = inner.state.lock().unwrap();
        if guard.rv == latest && guard.epoch == epoch {
            guard = inner
                .changed
                .wait_timeout(guard, Duration::from_millis(250))
                .unwrap()
                .0;
        }
    }
}

fn chunk(stream: &mut TcpStream, line: &str) -> std::io::Result<()> {
    let data = format!("{line}\n");
    write!(stream, "{:x}\r\n{data}\r\n", data.len())?;
    stream.flush()
}

fn status_object(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn status_body(code: u16, reason: &str, message: &str) -> String {
    status_object(code, reason, message).to_string()
}

fn respond(mut stream: TcpStream, status: u16, body: &str) -> std::io::Result<()> {
    let reason = if status == 200 { "OK" } else { "Error" };
    write!(
        stream,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(if bytes[i] == b'+' { b' ' } else { bytes[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}
