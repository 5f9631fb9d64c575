//! Builds the offload's BPF program (`src/io/offload/offload.c`) with clang, when clang and
//! libbpf's headers are installed (Debian: `clang`, `libbpf-dev`; the README's test command
//! installs them). Without them the dataplane builds all the same, and `--offload` says the
//! build has no program and how to get one.

use std::env;
use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "src/io/offload/offload.c";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(uturn_bpf)");
    println!("cargo::rerun-if-changed={SOURCE}");
    println!("cargo::rerun-if-env-changed=UTURN_CLANG");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("offload.o");
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    // Where Debian keeps <asm/types.h>, which <linux/bpf.h> includes.
    let multiarch = format!("/usr/include/{arch}-linux-gnu");
    let candidates: Vec<String> = match env::var("UTURN_CLANG") {
        Ok(clang) => vec![clang],
        Err(_) => std::iter::once("clang".to_owned())
            .chain((14..=21).rev().map(|v| format!("clang-{v}")))
            .collect(),
    };
    let mut why = String::from("no clang found (install clang and libbpf-dev)");
    for clang in candidates {
        let built = Command::new(&clang)
            .args([
                "-O2", "-target", "bpf", "-Wall", "-Werror", "-I", &multiarch, "-c", SOURCE, "-o",
            ])
            .arg(&out)
            .output();
        match built {
            Ok(output) if output.status.success() => {
                println!("cargo::rustc-cfg=uturn_bpf");
                return;
            }
            Ok(output) => {
                why = format!(
                    "{clang} failed: {}",
                    String::from_utf8_lossy(&output.stderr)
                        .lines()
                        .next()
                        .unwrap_or("")
                );
                break;
            }
            Err(_) => continue,
        }
    }
    println!("cargo::warning=built without the BPF offload program: {why}");
}
