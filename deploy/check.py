#!/usr/bin/env python3
"""Checks deploy/ offline: every kustomization renders (kubectl kustomize) and passes
kubernetes-validate --strict against the oldest Kubernetes we support; then what schemas
cannot see: probe and Service ports match the config the ConfigMap carries, the config itself
passes stunnerd's own validation (stunnerd --dry-run), RBAC is read-only on EndpointSlices and
Services, the seccomp profile is RuntimeDefault plus exactly the three io_uring syscalls, the
pod drains for an hour with --force-ready-status, stunnerd knows every flag it is given, only
the offload overlay adds capabilities (exactly BPF and NET_ADMIN, otherwise the base unchanged),
the image's entrypoint is stunnerd, built with the offload's BPF program, every overlay runs the
one image the base kustomization names, and .dockerignore keeps target/ out of the context.

  deploy/check.py STUNNERD_BINARY KUBERNETES_VALIDATE    (exit 0: all good; 1: a finding)
"""
import copy
import os
import re
import subprocess
import sys
import tempfile
from urllib.parse import urlparse

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
OLDEST = "1.29.0"
IO_URING = {"io_uring_setup", "io_uring_enter", "io_uring_register"}
# What the kernel offload needs (deploy/overlays/offload says why), and the flag that turns it on.
OFFLOAD_CAPS = {"BPF", "NET_ADMIN"}
OFFLOAD_ARG = "--offload=tc"
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


def stunnerd_container(docs):
    (deployment,) = find(docs, "Deployment", "uturn")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "stunnerd"]
    return pod, container


def check_offload(label, docs, base_docs):
    """The offload overlay: the base plus exactly the flag, the two capabilities, UID 0 (added
    capabilities never reach a non-root process) and the namespace's Pod Security level that
    admits them."""
    pod, container = stunnerd_container(docs)
    security = container.get("securityContext", {})
    caps = security.get("capabilities", {})
    check(set(caps.get("add", [])) == OFFLOAD_CAPS and len(caps.get("add", [])) == len(OFFLOAD_CAPS),
          f"{label}: adds exactly capabilities {sorted(OFFLOAD_CAPS)} (has {caps.get('add')})")
    check(caps.get("drop") == ["ALL"], f"{label}: drops every other capability")
    check(security.get("runAsUser") == 0 and security.get("runAsNonRoot") is False,
          f"{label}: stunnerd runs as UID 0, where added capabilities take effect")
    check(security.get("allowPrivilegeEscalation") is False and security.get("readOnlyRootFilesystem") is True,
          f"{label}: no privilege escalation, read-only root filesystem")
    check(container.get("args", []).count(OFFLOAD_ARG) == 1, f"{label}: stunnerd runs with {OFFLOAD_ARG}")
    check(pod.get("securityContext", {}).get("seccompProfile", {}).get("type") == "RuntimeDefault",
          f"{label}: seccomp RuntimeDefault (which allows bpf(2) with CAP_BPF)")
    (namespace,) = find(docs, "Namespace")
    check(namespace["metadata"]["labels"].get("pod-security.kubernetes.io/enforce") == "privileged",
          f"{label}: the namespace enforces Pod Security privileged (the only level admitting BPF, NET_ADMIN)")

    # Nothing else differs from the base.
    def undo(docs):
        docs = copy.deepcopy(docs)
        _, c = stunnerd_container(docs)
        c["args"] = [a for a in c["args"] if a != OFFLOAD_ARG]
        for key in ("runAsUser", "runAsNonRoot"):
            c["securityContext"].pop(key, None)
        c["securityContext"]["capabilities"].pop("add", None)
        for n in find(docs, "Namespace"):
            n["metadata"]["labels"].pop("pod-security.kubernetes.io/enforce", None)
        return docs
    check(undo(docs) == undo(base_docs), f"{label}: otherwise the base unchanged")


def docs_pod(docs):
    pod, _ = stunnerd_container(docs)
    return pod


def check_siblings(label, docs, container):
    """Second-chance forwarding: on, its key from a Secret, its port declared and open only to
    the gateway's own pods."""
    args = [str(a) for a in container.get("args", [])]
    check(any(a.startswith("--siblings") for a in args), f"{label}: --siblings is on")
    # The key: a Secret mounted as the file --sibling-key-file names (re-read on change, so a
    # rotation needs no restart), readable by the pod alone.
    key_file = next((a.split("=", 1)[1] for a in args if a.startswith("--sibling-key-file=")), None)
    pod = docs_pod(docs)
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mount = key_file and mounts.get(os.path.dirname(key_file))
    secret = volumes.get(mount, {}).get("secret", {}) if mount else {}
    check(bool(secret.get("secretName")),
          f"{label}: the sibling key is a Secret mounted as the file --sibling-key-file names")
    check(secret.get("defaultMode", 0o644) & 0o007 == 0,
          f"{label}: the key file is not readable by others (defaultMode {oct(secret.get('defaultMode', 0o644))})")
    ports = {(p["containerPort"], p["protocol"]) for p in container.get("ports", [])}
    check((13479, "UDP") in ports, f"{label}: the container declares sibling port 13479/UDP")
    policies = find(docs, "NetworkPolicy")
    only_siblings = any(
        any(p.get("protocol") == "UDP" and p.get("port") == 13479
            for p in rule.get("ports", []))
        and all("podSelector" in peer for peer in rule.get("from", [{}]))
        for policy in policies for rule in policy["spec"].get("ingress", []))
    check(only_siblings, f"{label}: a NetworkPolicy opens the sibling ports to the gateway's pods only")


def check_overlay(directory, stunnerd, validate, base_docs):
    label = os.path.relpath(directory, os.path.dirname(HERE))
    text, docs = render(directory)
    result = subprocess.run([validate, "--strict", "-k", OLDEST, "-"], input=text,
                            capture_output=True, text=True)
    check(result.returncode == 0, f"{label}: kubernetes-validate --strict -k {OLDEST}"
          + ("" if result.returncode == 0 else "\n" + result.stdout + result.stderr))

    pod, container = stunnerd_container(docs)
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
    state_dir = next((a.split("=", 1)[1] for a in args if str(a).startswith("--state-dir=")), None)
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    state_mount = next((m for m in mounts if state_dir and state_dir.startswith(m + "/")), None)
    state_volume = volumes.get(mounts.get(state_mount), {}).get("emptyDir", {})
    check(state_volume.get("medium") == "Memory",
          f"{label}: --state-dir ({state_dir}) is inside an emptyDir in memory, which outlives a container restart")
    env = {e["name"]: e for e in container.get("env", [])}
    check(env.get("STUNNER_ADDR", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP",
          f"{label}: STUNNER_ADDR comes from the pod IP")
    res = container.get("resources", {})
    cpu_req, cpu_lim = res.get("requests", {}).get("cpu"), res.get("limits", {}).get("cpu")
    check(cpu_req is not None and str(cpu_req).isdigit() and str(cpu_req) == str(cpu_lim),
          f"{label}: CPU request is whole CPUs and equals the limit ({cpu_req}/{cpu_lim})")
    check(pod.get("securityContext", {}).get("runAsNonRoot") is True, f"{label}: the pod's securityContext says runAsNonRoot")
    help_text = subprocess.run([stunnerd, "--help"], capture_output=True, text=True).stdout
    for arg in container.get("args", []):
        if str(arg).startswith("--"):
            check(arg.split("=")[0] in help_text, f"{label}: stunnerd knows {arg.split('=')[0]}")
    if os.path.basename(directory) == "siblings":
        check_siblings(label, docs, container)
    if os.path.basename(directory) == "offload":
        check_offload(label, docs, base_docs)
    else:
        security = container.get("securityContext", {})
        check(not security.get("capabilities", {}).get("add") and security.get("runAsNonRoot") is not False
              and security.get("runAsUser", 1) != 0,
              f"{label}: stunnerd runs as non-root and adds no capability")
        (namespace,) = find(docs, "Namespace")
        check(namespace["metadata"]["labels"].get("pod-security.kubernetes.io/enforce") == "restricted",
              f"{label}: the namespace enforces Pod Security restricted")
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
    check(os.path.isdir(os.path.join(HERE, "overlays", "offload")), "overlays/offload exists")
    _, base_docs = render(os.path.join(HERE, "base"))
    for directory in overlays:
        check_overlay(directory, stunnerd, validate, base_docs)

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

    # The image: named once, in the base kustomization's `images:`; every overlay's pods run
    # exactly that, and the Dockerfile's build context leaves out what it does not need.
    with open(os.path.join(HERE, "base", "kustomization.yaml")) as f:
        images = yaml.safe_load(f).get("images", [])
    check(len(images) == 1 and images[0].get("newTag"),
          "base/kustomization.yaml: one images: entry, with the tag to run")
    if images:
        want = f"{images[0].get('newName', images[0]['name'])}:{images[0].get('newTag')}"
        for directory in overlays:
            _, docs = render(directory)
            _, container = stunnerd_container(docs)
            label = os.path.relpath(directory, os.path.dirname(HERE))
            check(container["image"] == want, f"{label}: runs {want} (has {container['image']})")
        with open(os.path.join(HERE, "base", "deployment.yaml")) as f:
            raw = [d for d in yaml.safe_load_all(f) if d]
        (deployment,) = find(raw, "Deployment", "uturn")
        (raw_container,) = deployment["spec"]["template"]["spec"]["containers"]
        check(":" not in raw_container["image"] and raw_container["image"] == images[0]["name"],
              "base/deployment.yaml: names the image without a tag (the tag is the kustomization's)")
        check(spec.get("image") == want,
              f"examples/dataplane.yaml: the same image as the manifests, {want} (has {spec.get('image')})")
    dockerignore_path = os.path.join(os.path.dirname(HERE), ".dockerignore")
    ignored = set()
    if os.path.exists(dockerignore_path):
        with open(dockerignore_path) as f:
            ignored = {l.strip().strip("/") for l in f if l.strip() and not l.startswith("#")}
    check({"target", ".git"} <= ignored,
          ".dockerignore leaves target/ and .git/ out of the build context")

    with open(os.path.join(HERE, "Dockerfile")) as f:
        dockerfile = f.read()
    check('ENTRYPOINT ["stunnerd"]' in dockerfile, "Dockerfile: entrypoint is stunnerd")
    # The build stage (from the first FROM to the second) has what dataplane/build.rs compiles offload.c with.
    build_stage = dockerfile.split("\nFROM ")[1].replace("\\\n", " ")
    check(all(re.search(rf"apt-get install[^\n]*\s{p}(\s|$)", build_stage, re.M) for p in ("clang", "libbpf-dev")),
          "Dockerfile: the build stage installs clang and libbpf-dev (else stunnerd has no offload program)")
    users = [l.split()[1] for l in dockerfile.splitlines() if l.startswith("USER ")]
    check(bool(users) and users[-1].split(":")[0] not in ("0", "root"), "Dockerfile: runs as non-root")

    if failures:
        print(f"\n{len(failures)} finding(s)")
        sys.exit(1)
    print("\ndeploy/: all checks passed")


if __name__ == "__main__":
    main()
