//! The README's Run section, followed word for word: its shell blocks are read from README.md
//! and run as they are written (so the two cannot drift), from the repository's root, the way
//! a newcomer runs them in two terminals.
//!
//! 1. The server on the embedded default (`cargo run --release … turn://…@127.0.0.1…`): it
//!    binds 127.0.0.1 alone, the try-it client relays through it to a peer on this machine,
//!    Ctrl-C says how long the drain waits and how to skip it, a second Ctrl-C exits 0.
//! 2. The server on the example config file: it starts without a warning and exits 0 on
//!    Ctrl-C.
//!
//! The first run builds the release binary (a few minutes); later runs reuse it.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The ```sh blocks of the README's `## Run` section, in order.
fn run_section_blocks() -> Vec<String> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("Run\n"))
        .expect("README.md has a `## Run` section");
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in section.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```sh") => current = Some(String::new()),
            (Some(block), "```") => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            (Some(block), text) => {
                block.push_str(text);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

/// A shell block running in its own process group (as a terminal's foreground job is), its
/// output collected as it comes.
struct Job {
    child: Child,
    output: Arc<Mutex<String>>,
}

impl Job {
    fn start(block: &str) -> Job {
        let mut child = Command::new("bash")
            .arg("-c")
            .arg(block)
            .current_dir(root())
            .env_remove("STUNNER_CONFIG_ORIGIN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let output = Arc::new(Mutex::new(String::new()));
        let pipes: [Box<dyn Read + Send>; 2] = [
            Box::new(child.stdout.take().unwrap()),
            Box::new(child.stderr.take().unwrap()),
        ];
        for pipe in pipes {
            let output = output.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    let mut out = output.lock().unwrap();
                    out.push_str(&line);
                    out.push('\n');
                }
            });
        }
        Job { child, output }
    }

    fn output(&self) -> String {
        self.output.lock().unwrap().clone()
    }

    /// Why a server did not start: how the job ended (if it did), its output without cargo's
    /// progress lines (a build from scratch prints hundreds, which would hide the error), and
    /// what holds UDP port 3478.
    fn report(&mut self) -> String {
        let status = match self.child.try_wait() {
            Ok(Some(status)) => format!("the job ended: {status}"),
            _ => "the job is still running".to_string(),
        };
        let output = self.output();
        let progress = [
            "Compiling ",
            "Downloading ",
            "Downloaded ",
            "Updating ",
            "Locking ",
            "Adding ",
        ];
        let lines: Vec<&str> = output
            .lines()
            .filter(|l| !progress.iter().any(|p| l.trim_start().starts_with(p)))
            .collect();
        let holders = Command::new("ss")
            .args(["-Hlunp", "sport = :3478"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        format!(
            "{status}\noutput (cargo's progress left out):\n{}\nUDP port 3478 is held by: {holders:?}",
            lines.join("\n")
        )
    }

    /// Waits up to `secs` for the output to hold `needle`.
    fn wait_for(&mut self, needle: &str, secs: u64) -> bool {
        let end = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < end {
            if self.output().contains(needle) {
                return true;
            }
            if let Ok(Some(_)) = self.child.try_wait() {
                std::thread::sleep(Duration::from_millis(200));
                return self.output().contains(needle);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// Ctrl-C: SIGINT to the job's process group.
    fn interrupt(&self) {
        self.signal_group(libc::SIGINT);
    }

    fn signal_group(&self, signal: i32) {
        // SAFETY: a signal to the process group this test started.
        unsafe {
            libc::kill(-(self.child.id() as i32), signal);
        }
    }

    /// The exit code, if the job ends within `secs`.
    fn wait_exit(&mut self, secs: f64) -> Option<i32> {
        uturn_testkit::stunnerd::wait_child(&mut self.child, secs)
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.signal_group(libc::SIGKILL);
        let _ = self.child.wait();
    }
}

#[test]
fn the_run_section_relays_and_stops_as_it_says() {
    let blocks = run_section_blocks();
    assert_eq!(
        blocks.len(),
        3,
        "the Run section's shell blocks are the server, the try-it client and the config-file \
         server: {blocks:#?}"
    );
    let (server, try_it, config_file) = (&blocks[0], &blocks[1], &blocks[2]);
    assert!(server.contains("turn://"), "{server}");
    assert!(config_file.contains("file://"), "{config_file}");

    // 1. The embedded default, bound to what its URI says.
    let mut job = Job::start(server);
    assert!(
        job.wait_for("serving on shard", 1200),
        "the server did not start: {}",
        job.report()
    );
    let listening = Command::new("ss")
        .args(["-Hlun", "sport = :3478"])
        .output()
        .unwrap();
    let listening = String::from_utf8_lossy(&listening.stdout);
    assert!(
        listening.contains("127.0.0.1:3478") && !listening.contains("*:3478"),
        "the quickstart must bind 127.0.0.1 alone: {listening}"
    );
    // (cargo itself echoes the command it runs, URI included: stunnerd's lines are the rest.)
    let output = job.output();
    let logged: Vec<&str> = output
        .lines()
        .filter(|l| !l.trim_start().starts_with("Running `"))
        .collect();
    assert!(
        !logged.iter().any(|l| l.contains("pass1")),
        "the password is never logged: {output}"
    );

    // The try-it block relays to the peer and back.
    let mut client = Job::start(try_it);
    assert!(
        client.wait_exit(60.0).is_some(),
        "the try-it block did not end: {}",
        client.output()
    );
    let relayed = client.output();
    assert!(
        relayed.contains("tot_recv_msgs=5") && relayed.contains("Total lost packets 0 "),
        "the try-it client did not relay: {relayed}\nserver: {}",
        job.output()
    );
    drop(client);

    // Ctrl-C with the allocation the client left: the drain says how long and how to skip.
    job.interrupt();
    assert!(job.wait_for("press Ctrl-C again", 5), "{}", job.output());
    assert!(
        job.output().contains("until each is deleted or expires"),
        "{}",
        job.output()
    );
    assert_eq!(
        job.wait_exit(1.0),
        None,
        "exited without draining: {}",
        job.output()
    );
    job.interrupt();
    assert_eq!(job.wait_exit(5.0), Some(0), "{}", job.output());
    drop(job);

    // 2. The example config file: it starts clean, and Ctrl-C with no allocation exits 0.
    let mut job = Job::start(config_file);
    assert!(
        job.wait_for("serving on shard", 600),
        "the config-file server did not start: {}",
        job.report()
    );
    assert!(
        !job.output().contains("WARNING") && !job.output().contains("ERROR"),
        "{}",
        job.output()
    );
    job.interrupt();
    assert_eq!(job.wait_exit(5.0), Some(0), "{}", job.output());
    assert!(
        job.output().contains("Normal exit on graceful shutdown"),
        "{}",
        job.output()
    );
}
