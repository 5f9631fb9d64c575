//! The stunnerd command line: every flag accepted, clear exits for what is not there yet.

use std::process::Command;
use uturn_testkit::stunnerd::{free_port, run_stunnerd, temp_file};

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

/// The options `--help` lists: (long name, takes a value, help text).
fn help_options() -> Vec<(String, bool, String)> {
    let (code, help) = stunnerd(&["--help"]);
    assert_eq!(code, 0, "{help}");
    let mut options: Vec<(String, bool, String)> = Vec::new();
    for line in help.lines() {
        let trimmed = line.trim_start();
        let flag_line = trimmed.starts_with("--")
            || (trimmed.starts_with('-') && trimmed.get(2..4) == Some(", "));
        if line.starts_with("  ") && flag_line && line.len() - trimmed.len() <= 6 {
            let long = trimmed
                .split("--")
                .nth(1)
                .unwrap_or_default()
                .split([' ', '\n'])
                .next()
                .unwrap_or_default()
                .to_owned();
            options.push((long, trimmed.contains(" <"), String::new()));
        } else if let Some((_, _, text)) = options.last_mut() {
            text.push_str(trimmed);
            text.push(' ');
        }
    }
    options
}

/// Every option `--help` lists does what its help says: a flag whose help starts with
/// "Refused" exits 1 saying it is not supported, every other one is accepted by a dry run.
/// A flag added to `--help` without a value here fails the test until it is given one.
#[test]
fn every_flag_in_help_is_accepted_or_refused_as_the_help_says() {
    let origin = write("help.yaml", CONFIG);
    let key = temp_file("sibling.key");
    std::fs::write(&key, "0123456789abcdef0123456789abcdef").unwrap();
    let key = key.to_str().unwrap().to_owned();
    let pem = temp_file("help.pem");
    std::fs::write(
        &pem,
        "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let pem = pem.to_str().unwrap().to_owned();
    // A value each option takes (the flags that take none are given alone).
    let values: &[(&str, &[&str])] = &[
        ("config", &[origin.as_str()]),
        ("log", &["all:INFO,stunner:DEBUG"]),
        ("log-format", &["json"]),
        ("id", &["ns/name"]),
        ("udp-thread-num", &["4"]),
        ("drain-timeout", &["30"]),
        ("io-engine", &["epoll"]),
        ("offload", &["none"]),
        ("state-dir", &["/tmp/uturn-cli-state"]),
        ("discovery-timeout", &["5"]),
        ("max-allocations", &["1000"]),
        ("max-permissions", &["16"]),
        ("challenge-rate", &["100"]),
        ("challenge-burst", &["100"]),
        ("max-unauthenticated-connections", &["100"]),
        ("max-unauthenticated-connections-per-ip", &["10"]),
        ("cds-server-address", &["10.0.0.1:13478"]),
        ("cds-server-namespace", &["stunner"]),
        ("cds-server-port", &["13478"]),
        (
            "siblings",
            &["static:10.0.0.2", "--sibling-key-file", key.as_str()],
        ),
        ("sibling-port", &["13479"]),
        ("sibling-key-file", &[key.as_str()]),
        ("license", &[r#"{"key":"k","hmac":"h"}"#]),
        ("sni", &["example.com"]),
        ("kubeconfig", &["/dev/null"]),
        ("context", &["c"]),
        ("cluster", &["k"]),
        ("user", &["u"]),
        ("namespace", &["media"]),
        ("server", &["https://127.0.0.1:6443"]),
        ("token", &["t"]),
        ("as", &["a"]),
        ("as-group", &["g"]),
        ("as-uid", &["1"]),
        ("certificate-authority", &[pem.as_str()]),
        (
            "client-certificate",
            &[pem.as_str(), "--client-key", pem.as_str()],
        ),
        (
            "client-key",
            &[pem.as_str(), "--client-certificate", pem.as_str()],
        ),
        ("tls-server-name", &["x"]),
        ("request-timeout", &["5s"]),
        ("cache-dir", &["/tmp"]),
        ("username", &["admin"]),
        ("password", &["secret"]),
    ];
    let options = help_options();
    assert!(options.len() > 40, "{options:#?}");
    for (long, takes_value, help) in &options {
        if long == "help" || long == "version" {
            let (code, text) = stunnerd(&[&format!("--{long}")]);
            assert_eq!(code, 0, "--{long}: {text}");
            continue;
        }
        let flag = format!("--{long}");
        let mut args = vec![];
        if long != "dry-run" {
            args.push("-d");
        }
        if long != "config" {
            args.extend(["-c", origin.as_str()]);
        }
        args.push(flag.as_str());
        if *takes_value {
            let Some((_, value)) = values.iter().find(|(name, _)| name == long) else {
                panic!("{flag} is in --help but this test has no value for it: add one")
            };
            args.extend_from_slice(value);
        }
        let (code, text) = stunnerd(&args);
        if help.starts_with("Refused") {
            assert_eq!(code, 1, "{flag}: its help says refused, yet: {text}");
            assert!(text.contains("is not supported"), "{flag}: {text}");
        } else {
            assert_eq!(code, 0, "{flag}: its help ({help}) offers it, yet: {text}");
        }
    }
    // What the help says of values: -c takes no `k8s`, -l refuses an item it cannot read,
    // --offload and --io-engine name their modes, and tunnel mode (three arguments) is refused.
    let (code, text) = stunnerd(&["-d", "-c", "k8s"]);
    assert_eq!(code, 1, "{text}");
    let (code, text) = stunnerd(&["-d", "-c", &origin, "-l", "all:INFOO"]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("did you mean INFO?"), "{text}");
    let (code, text) = stunnerd(&["-d", "-c", &origin, "--offload", "foo"]);
    assert_eq!(code, 1, "--offload foo passed a dry run: {text}");
    assert!(text.contains("use none, tc, xdp or auto"), "{text}");
    let (code, text) = stunnerd(&[
        "-d",
        "udp://127.0.0.1:5000",
        "turn://u:p@127.0.0.1",
        "udp://127.0.0.1:6000",
    ]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("tunnel mode"), "{text}");
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
