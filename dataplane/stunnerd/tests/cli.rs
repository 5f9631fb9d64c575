//! The stunnerd command line: every flag accepted, clear exits for what is not there yet.

use std::process::Command;

fn stunnerd(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_stunnerd"))
        .args(args)
        .env_remove("STUNNER_CONFIG_ORIGIN")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
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
        "--cds-server-address",
        "1.2.3.4:13478",
        "--cds-server-namespace",
        "stunner",
        "--cds-server-port",
        "13478",
        "--kubeconfig",
        "/dev/null",
        "--context",
        "c",
        "--cluster",
        "k",
        "--user",
        "u",
        "-n",
        "default",
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
        "ca",
        "--client-certificate",
        "cc",
        "--client-key",
        "ck",
        "--insecure-skip-tls-verify",
        "--tls-server-name",
        "x",
        "--request-timeout",
        "5s",
        "--cache-dir",
        "/tmp",
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
