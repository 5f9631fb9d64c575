//! Writes the seed corpus (`uturn_fuzz::seeds`) to `corpus/<target>/<name>` and replays every
//! seed through its target's checks; `--check` only replays. Exits non-zero if a seed fails.
//!
//! ```sh
//! cd dataplane/fuzz && cargo run --example gen_corpus            # write + replay
//! cd dataplane/fuzz && cargo run --example gen_corpus -- --check # replay only
//! # one input, e.g. a crash, with every engine call printed:
//! cd dataplane/fuzz && UTURN_FUZZ_TRACE=1 cargo run --example gen_corpus -- --replay engine_session FILE
//! ```

use std::path::PathBuf;

fn run(target: &str, data: &[u8]) {
    match target {
        "engine_unauth" => uturn_fuzz::engine::run_unauth(data),
        "engine_session" => uturn_fuzz::engine::run_session(data),
        "framer" => uturn_fuzz::framer::run(data),
        "config" => uturn_fuzz::config::run(data),
        "peer_policy" => uturn_fuzz::peer_policy::run(data),
        "sibling" => uturn_fuzz::sibling::run(data),
        other => panic!("unknown target {other}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--replay") {
        let target = args.get(1).expect("--replay TARGET FILE...");
        for file in &args[2..] {
            let data = std::fs::read(file).expect("read input");
            eprintln!("== {file} ({} bytes)", data.len());
            run(target, &data);
        }
        return;
    }
    let check_only = std::env::args().any(|a| a == "--check");
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let mut failed = 0;
    let seeds = uturn_fuzz::seeds::all();
    for seed in &seeds {
        if !check_only {
            let dir = corpus.join(seed.target);
            std::fs::create_dir_all(&dir).expect("create corpus dir");
            std::fs::write(dir.join(&seed.name), &seed.bytes).expect("write seed");
        }
        let result = std::panic::catch_unwind(|| run(seed.target, &seed.bytes));
        if result.is_err() {
            eprintln!("FAILED: {}/{}", seed.target, seed.name);
            failed += 1;
        }
    }
    let bytes: usize = seeds.iter().map(|s| s.bytes.len()).sum();
    println!(
        "{} seeds ({bytes} bytes), {failed} failed{}",
        seeds.len(),
        if check_only {
            ""
        } else {
            ", written to corpus/"
        }
    );
    if failed > 0 {
        std::process::exit(1);
    }
}
