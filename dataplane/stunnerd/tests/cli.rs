//! The stunnerd command line: every flag accepted, clear exits for what is not there yet.

use std::process::Command;
use uturn_testkit::apiserver;
use uturn_testkit::stunnerd::{free_port, run_stunnerd, temp_file, wait_until, Stunnerd};

fn stunnerd(args: &[&str]) -> (i32, String) {
    run_stunnerd(args)
}

fn write(name: &str, text: &str) -> String {
    let path = std::env::temp_dir().join(format!("uturn-cli-{}-{name}", std::process::id()));
    std::fs::write(&path, text).unwrap();
    format!("file://{}", path.display())
}

const CONFIG: &str = "version: v1\nauth: {credentials: {username: u, password: p}}\nlisteners: [{name: l, address: 127.0.0.1, port: 3478}]\n";

#[test]
fn every_stunnerd_flag_is_accepted() {
    let origin = write("ok.yaml", CONFIG);
    let pem = temp_file("dummy.pem");
    std::fs::write(
        &pem,
        "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let pem = pem.to_str().unwrap();
    let (code, text) = stunnerd(&[
        "-c",
        &origin,
        "-l",
        "all:INFO",
        "--log-format",
        "json",
        "-i",
        "ns/name",
        "-u",
        "16",
        "-d",
        "--force-ready-status",
        "-v",
        "--discovery-timeout",
        "5",
        "--kubeconfig",
        "/dev/null",
        "--context",
        "c",
        "--cluster",
        "k",
        "--user",
        "u",
        "-s",
        "https://127.0.0.1:6443",
        "--token",
        "t",
        "--as",
        "a",
        "--as-group",
        "g",
        "--as-uid",
        "1",
        "--certificate-authority",
        pem,
        "--client-certificate",
        pem,
        "--client-key",
        pem,
        "--insecure-skip-tls-verify",
        "--tls-server-name",
        "x",
        "--request-timeout",
        "5s",
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("\"msg\":\"starting stunnerd id \\\"ns/name\\\""),
        "{text}"
    );
}

#[test]
fn an_origin_not_implemented_yet_exits_naming_it() {
    let (code, text) = stunnerd(&["-c", "10.0.0.1:13478"]);
    assert_eq!(code, 1);
    assert!(text.contains("http://10.0.0.1:13478"), "{text}");
    let (code, text) = stunnerd(&["-c", "k8s"]);
    assert_eq!(code, 1);
    assert!(text.contains("\"k8s\""), "{text}");
    // No flag, no env: stunnerd's default origin :13478 (CDS).
    let (code, text) = stunnerd(&[]);
    assert_eq!(code, 1);
    assert!(text.contains(":13478"), "{text}");
}

#[test]
fn a_bad_config_names_the_field_and_exits_1() {
    let origin = write("bad.yaml", &CONFIG.replace("127.0.0.1", "not-an-ip"));
    let (code, text) = stunnerd(&["-c", &origin, "-d"]);
    assert_eq!(code, 1);
    assert!(
        text.contains("listeners[0].address") && text.contains("not-an-ip"),
        "{text}"
    );
    let (code, text) = stunnerd(&["-d", "turn://nopass@127.0.0.1:3478"]);
    assert_eq!(code, 1);
    assert!(text.contains("TURN-URI"), "{text}");
}

/// kubectl and CDS flags that uturn would only parse and drop are refused, naming the fix.
#[test]
fn flags_uturn_would_ignore_are_refused() {
    let origin = write("refused.yaml", CONFIG);
    for (flag, value, fix) in [
        ("--namespace", "media", "<namespace>/<service>"),
        ("-n", "media", "<namespace>/<service>"),
        ("--cache-dir", "/tmp", "no API discovery cache"),
        ("--username", "admin", "--token"),
        ("--password", "secret", "--token"),
        ("--cds-server-address", "10.0.0.1:13478", "-c http://"),
        ("--cds-server-namespace", "stunner", "-c http://"),
        ("--cds-server-port", "13478", "-c http://"),
    ] {
        let (code, text) = stunnerd(&["-c", &origin, "-d", flag, value]);
        assert_eq!(code, 1, "{flag} was accepted: {text}");
        assert!(
            text.contains("is not supported") && text.contains(fix),
            "{flag}: {text}"
        );
    }
    for (flags, named) in [
        (
            &["--certificate-authority", "/nonexistent/ca.pem"][..],
            "--certificate-authority",
        ),
        (
            &[
                "--client-certificate",
                "/nonexistent/c.pem",
                "--client-key",
                "/nonexistent/k.pem",
            ][..],
            "--client-certificate",
        ),
        (&["--request-timeout", "5 seconds"][..], "--request-timeout"),
    ] {
        let mut args = vec!["-c", origin.as_str(), "-d"];
        args.extend_from_slice(flags);
        let (code, text) = stunnerd(&args);
        assert_eq!(code, 1, "{flags:?}: {text}");
        assert!(text.contains(named), "{flags:?}: {text}");
    }
    // The operator's environment may carry CDS_SERVER_ADDR: it is logged, not fatal.
    let out = Command::new(env!("CARGO_BIN_EXE_stunnerd"))
        .args(["-c", &origin, "-d"])
        .env("CDS_SERVER_ADDR", "10.0.0.1:13478")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("CDS_SERVER_ADDR") && text.contains("ignored"),
        "{text}"
    );
}

/// --as, --as-group and --as-uid reach the API server as impersonation headers.
#[test]
fn kubectl_impersonation_flags_reach_the_api_server() {
    let api = apiserver::FakeApiServer::start();
    let kubeconfig = api.kubeconfig(&std::env::temp_dir());
    let (turn, health) = (free_port(), free_port());
    let config = write(
        &format!("impersonate-{turn}.yaml"),
        &format!(
            "version: v1\nadmin: {{healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\n\
             auth: {{credentials: {{username: u, password: p}}}}\n\
             listeners: [{{name: l, address: 127.0.0.1, port: {turn}, routes: [k]}}]\n\
             clusters: [{{name: k, type: KUBERNETES, endpoints: [\"media/svc\"]}}]\n"
        ),
    );
    let server = Stunnerd::start(
        &[
            "-c",
            &config,
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--as",
            "gateway-bot",
            "--as-group",
            "media-admins",
            "--as-uid",
            "1234",
            "--request-timeout",
            "20s",
        ],
        &[],
    );
    let has = |line: &str| api.headers().iter().any(|h| h == line);
    assert!(
        wait_until(20, || has("impersonate-user: gateway-bot")
            && has("impersonate-group: media-admins")
            && has("impersonate-uid: 1234")),
        "{:?}\n{}",
        api.headers(),
        server.logs()
    );
    let _ = std::fs::remove_file(kubeconfig);
}

/// TURN-URI mode names the user it runs with but never logs the password.
#[test]
fn turn_uri_mode_does_not_log_the_password() {
    let port = free_port();
    let (code, text) = stunnerd(&[
        "-d",
        "-l",
        "all:TRACE",
        &format!("turn://gateway-user:Pa55-word-xyz@127.0.0.1:{port}"),
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("gateway-user"), "{text}");
    assert!(text.contains("the password from the TURN URI"), "{text}");
    assert!(
        !text.contains("Pa55-word-xyz"),
        "the password was logged: {text}"
    );
}
