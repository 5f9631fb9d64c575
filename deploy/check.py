#!/usr/bin/env python3
"""Checks deploy/ offline: every kustomization renders (kubectl kustomize) and passes
kubernetes-validate --strict against the oldest Kubernetes we support; then what schemas
cannot see: probe and Service ports match the config the ConfigMap carries, the config itself
passes stunnerd's own validation (stunnerd --dry-run), RBAC is read-only on EndpointSlices and
Services, the seccomp profile is RuntimeDefault plus exactly the three io_uring syscalls, the
pod drains for an hour with --force-ready-status, and the image's entrypoint is stunnerd.

  deploy/check.py STUNNERD_BINARY KUBERNETES_VALIDATE    (exit 0: all good; 1: a finding)
"""
import os
import subprocess
import sys
import tempfile
from urllib.parse import urlparse

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
OLDEST = "1.29.0"
IO_URING = {"io_uring_setup", "io_uring_enter", "io_uring_register"}
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def render(directory):
    out = subprocess.run(["kubectl", "kustomize", directory], check=True,
                         capture_output=True, text=True).stdout
    return out, [d for d in yaml.safe_load_all(out) if d]


def find(docs, kind, name=None):
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def port_of(endpoint, default):
    url = urlparse(endpoint if "//" in endpoint else "http://" + endpoint)
    return url.port or default


def check_overlay(directory, stunnerd, validate):
    label = os.path.relpath(directory, os.path.dirname(HERE))
    text, docs = render(directory)
    result = subprocess.run([validate, "--strict", "-k", OLDEST, "-"], input=text,
                            capture_output=True, text=True)
    check(result.returncode == 0, f"{label}: kubernetes-validate --strict -k {OLDEST}"
          + ("" if result.returncode == 0 else "\n" + result.stdout + result.stderr))

    (deployment,) = find(docs, "Deployment", "uturn")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "stunnerd"]
    (configmap,) = find(docs, "ConfigMap")
    config_text = configmap["data"]["stunnerd.conf"]
    config = yaml.safe_load(config_text)

    # The config is valid for stunnerd itself.
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
        f.write(config_text)
    dry = subprocess.run([stunnerd, "--dry-run", "-c", "file://" + f.name],
                         capture_output=True, text=True, env={**os.environ, "STUNNER_ADDR": "10.0.0.1"})
    os.unlink(f.name)
    check(dry.returncode == 0, f"{label}: stunnerd --dry-run accepts the ConfigMap's config"
          + ("" if dry.returncode == 0 else ": " + dry.stderr.strip()))

    # Probes on the health port the config serves; Service exposes it for cloud health checks.
    health = port_of(config["admin"]["healthcheck_endpoint"], 8086)
    for probe, path in [("livenessProbe", "/live"), ("readinessProbe", "/ready")]:
        get = container.get(probe, {}).get("httpGet", {})
        check(get.get("port") == health and get.get("path") == path,
              f"{label}: {probe} is GET {path} on the health port {health}")
    ports = {p["containerPort"]: p["protocol"] for p in container.get("ports", [])}
    check(ports.get(health) == "TCP", f"{label}: the container declares health port {health}/TCP")
    if config["admin"].get("metrics_endpoint"):
        metrics = port_of(config["admin"]["metrics_endpoint"], 8080)
        check(ports.get(metrics) == "TCP", f"{label}: the container declares metrics port {metrics}/TCP")
    (service,) = find(docs, "Service", "uturn")
    service_ports = {(p["targetPort"], p["protocol"]) for p in service["spec"]["ports"]}
    check((health, "TCP") in service_ports, f"{label}: the Service exposes the health port")
    for listener in config["listeners"]:
        proto = "TCP" if listener["protocol"] in ("TURN-TCP", "TURN-TLS") else "UDP"
        check(ports.get(listener["port"]) == proto and (listener["port"], proto) in service_ports,
              f"{label}: listener {listener['name']} port {listener['port']}/{proto} is declared and served")

    # Drain and readiness.
    check(pod.get("terminationGracePeriodSeconds", 0) >= 3600, f"{label}: terminationGracePeriodSeconds >= 3600")
    args = container.get("args", [])
    check("--force-ready-status" in args, f"{label}: --force-ready-status keeps conntrack pinned during a drain")
    env = {e["name"]: e for e in container.get("env", [])}
    check(env.get("STUNNER_ADDR", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP",
          f"{label}: STUNNER_ADDR comes from the pod IP")
    res = container.get("resources", {})
    cpu_req, cpu_lim = res.get("requests", {}).get("cpu"), res.get("limits", {}).get("cpu")
    check(cpu_req is not None and str(cpu_req).isdigit() and str(cpu_req) == str(cpu_lim),
          f"{label}: CPU request is whole CPUs and equals the limit ({cpu_req}/{cpu_lim})")
    check(pod.get("securityContext", {}).get("runAsNonRoot") is True, f"{label}: runs as non-root")
    check(len(find(docs, "PodDisruptionBudget")) == 1, f"{label}: has a PodDisruptionBudget")

    # RBAC: read-only on exactly EndpointSlices and Services.
    allowed = {("discovery.k8s.io", "endpointslices"), ("", "services")}
    for role in find(docs, "ClusterRole") + find(docs, "Role"):
        for rule in role["rules"]:
            verbs = set(rule.get("verbs", []))
            pairs = {(g, r) for g in rule.get("apiGroups", []) for r in rule.get("resources", [])}
            check(verbs <= {"get", "list", "watch"} and pairs <= allowed,
                  f"{label}: {role['kind']} {role['metadata']['name']} rule {sorted(pairs)} is read-only {sorted(verbs)}")

    # Seccomp: RuntimeDefault, or a Localhost profile that is RuntimeDefault + io_uring.
    profile = pod.get("securityContext", {}).get("seccompProfile", {})
    if profile.get("type") == "Localhost":
        profiles = find(docs, "SeccompProfile")
        check(len(profiles) == 1, f"{label}: ships the SeccompProfile it references")
        for p in profiles:
            spec = p["spec"]
            names = {n for s in spec.get("syscalls", []) if s.get("action") == "SCMP_ACT_ALLOW"
                     for n in s.get("names", [])}
            check(spec.get("baseProfileName") == "runtime/default" and names == IO_URING,
                  f"{label}: seccomp profile is runtime/default plus exactly {sorted(IO_URING)} (has {sorted(names)})")
            want = f"operator/{p['metadata']['namespace']}/{p['metadata']['name']}.json"
            check(profile.get("localhostProfile") == want, f"{label}: the pod uses {want}")
    else:
        check(profile.get("type") == "RuntimeDefault", f"{label}: seccomp RuntimeDefault")


def main():
    stunnerd, validate = sys.argv[1], sys.argv[2]
    overlays = [os.path.join(HERE, "base")] + sorted(
        os.path.join(HERE, "overlays", d) for d in os.listdir(os.path.join(HERE, "overlays")))
    for directory in overlays:
        check_overlay(directory, stunnerd, validate)

    # The STUNner operator's Dataplane: the image's stunnerd with stunnerd's flags.
    with open(os.path.join(HERE, "examples", "dataplane.yaml")) as f:
        dataplane = yaml.safe_load(f)
    spec = dataplane["spec"]
    check(dataplane["kind"] == "Dataplane" and spec.get("command") == ["stunnerd"],
          "examples/dataplane.yaml: a Dataplane running stunnerd")
    help_text = subprocess.run([stunnerd, "--help"], capture_output=True, text=True).stdout
    for arg in spec.get("args", []):
        flag = arg.split("=")[0]
        check(flag in help_text, f"examples/dataplane.yaml: stunnerd knows {flag}")

    with open(os.path.join(HERE, "Dockerfile")) as f:
        dockerfile = f.read()
    check('ENTRYPOINT ["stunnerd"]' in dockerfile, "Dockerfile: entrypoint is stunnerd")
    users = [l.split()[1] for l in dockerfile.splitlines() if l.startswith("USER ")]
    check(bool(users) and users[-1].split(":")[0] not in ("0", "root"), "Dockerfile: runs as non-root")

    if failures:
        print(f"\n{len(failures)} finding(s)")
        sys.exit(1)
    print("\ndeploy/: all checks passed")


if __name__ == "__main__":
    main()
