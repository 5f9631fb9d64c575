//! The stunnerd process driver and the helpers a test uses to wait on it: its log, its
//! health-check and metrics endpoints, its ports; plus scratch files and ports that no other
//! test in the process gets.

use serde_json::Value;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The path of the workspace binary `name`: beside the running test's executable
/// (`target/<profile>/deps/<test>` is next to `target/<profile>/<name>`). Cargo builds a
/// crate's binaries before its integration tests; `cargo test --workspace` builds them all.
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let path = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test executable sits in target/<profile>/deps")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: build it first (cargo build --bin {name}), or run the workspace's \
         tests (cargo test --workspace)",
        path.display()
    );
    path
}

/// The `stunnerd` binary of this workspace (see [`workspace_binary`]).
pub fn stunnerd_binary() -> PathBuf {
    workspace_binary("stunnerd")
}

/// Runs `stunnerd ARGS` to its end (without `STUNNER_CONFIG_ORIGIN` from the environment):
/// its exit code and its output, stdout then stderr.
pub fn run_stunnerd(args: &[&str]) -> (i32, String) {
    let out = Command::new(stunnerd_binary())
        .args(args)
        .env_remove("STUNNER_CONFIG_ORIGIN")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// A port free for UDP and TCP that no other test in this process gets (see
/// `uturn_perf::ports`: two stunnerds sharing a port by chance split one client's packets).
pub use uturn_perf::ports::free_port;

/// A fresh path in the temp dir for a test's file called `name`.
pub fn temp_file(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "uturn-{}-{}-{name}",
        std::process::id(),
        free_port()
    ))
}

/// A fresh directory under the system temp dir.
pub fn temp_dir(label: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "uturn-{label}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A child process killed (and reaped) when dropped.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Killed {
    /// Kills the process and returns what it wrote to its (piped) stdout.
    pub fn stdout(mut self) -> String {
        use std::io::Read;
        let _ = self.0.kill();
        let _ = self.0.wait();
        let mut out = String::new();
        if let Some(mut s) = self.0.stdout.take() {
            let _ = s.read_to_string(&mut out);
        }
        out
    }
}

/// A stunnerd process, killed when dropped; its output goes to `log`.
pub struct Stunnerd {
    child: Child,
    /// Where stdout and stderr go.
    pub log: std::path::PathBuf,
}

impl Stunnerd {
    /// Starts `stunnerd ARGS` with `envs` (one shard unless `envs` sets `UTURN_SHARDS`).
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Stunnerd {
        Stunnerd::start_under(&[], args, envs)
    }

    /// As [`Stunnerd::start`], run through `wrapper` (a command that execs the rest, such as
    /// `prlimit --memlock=…` or `taskset -c 0`).
    pub fn start_under(wrapper: &[&str], args: &[&str], envs: &[(&str, &str)]) -> Stunnerd {
        Stunnerd::start_with(wrapper, args, envs, |_| {})
    }

    /// As [`Stunnerd::start_under`], with `customize` applied to the command last (a
    /// `pre_exec` hook, say).
    pub fn start_with(
        wrapper: &[&str],
        args: &[&str],
        envs: &[(&str, &str)],
        customize: impl FnOnce(&mut Command),
    ) -> Stunnerd {
        let log = std::env::temp_dir().join(format!(
            "uturn-stunnerd-{}-{}.log",
            std::process::id(),
            free_port()
        ));
        let out = std::fs::File::create(&log).unwrap();
        let binary = stunnerd_binary();
        let mut command = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut command = Command::new(program);
                command.args(rest).arg(binary);
                command
            }
            None => Command::new(binary),
        };
        command
            .args(args)
            .env("UTURN_SHARDS", "1")
            .envs(envs.iter().copied())
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out));
        customize(&mut command);
        let child = command.spawn().unwrap();
        Stunnerd { child, log }
    }

    /// What the process logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` to the process.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, signal);
        }
    }

    /// Waits up to `secs` for the process to exit; its exit code.
    pub fn wait_exit_for(&mut self, secs: f64) -> Option<i32> {
        wait_child(&mut self.child, secs)
    }

    /// Waits for the process to exit (up to 10 s) and returns its exit code.
    pub fn wait_exit(&mut self) -> Option<i32> {
        for _ in 0..200 {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

/// Waits up to `secs` for `child` to exit; its exit code (`None`: still running, or killed by
/// a signal).
pub fn wait_child(child: &mut Child, secs: f64) -> Option<i32> {
    let deadline = std::time::Instant::now() + Duration::from_secs_f64(secs);
    while std::time::Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return status.code();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

impl Drop for Stunnerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// `GET path` from `127.0.0.1:port`: the status code and body (`None` if nothing answers).
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    http_get_from(SocketAddr::from(([127, 0, 0, 1], port)), path)
}

/// The `/status` document, if the health server answers.
pub fn status(port: u16) -> Option<Value> {
    let (code, body) = http_get(port, "/status")?;
    (code == 200).then(|| serde_json::from_str(&body).ok())?
}

/// Polls `check` every 50 ms for up to `secs`; true as soon as it holds.
pub fn wait_until(secs: u64, mut check: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// Waits until something accepts TCP connections on `addr`.
pub fn wait_for_tcp(addr: SocketAddr, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("nothing listens on tcp {addr} after {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The value of the first `/metrics` sample on `port` whose line starts with `line_start`
/// (a metric name and its labels, with the trailing space).
pub fn metric(port: u16, line_start: &str) -> Option<f64> {
    let (_, body) = http_get(port, "/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix(line_start))
        .and_then(|v| v.trim().parse().ok())
}

/// `GET path` from `addr` (any family): the status code and body (`None` if nothing answers).
pub fn http_get_from(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

/// A seccomp filter (classic BPF) that fails syscall `nr` with EPERM and allows every other:
/// what containerd 2.x's and Docker 25+'s RuntimeDefault profiles do to `io_uring_setup` (and
/// to `bpf` without CAP_BPF).
fn seccomp_denying(nr: libc::c_long) -> Vec<libc::sock_filter> {
    #[cfg(target_arch = "x86_64")]
    const AUDIT_ARCH: u32 = 0xC000_003E;
    #[cfg(target_arch = "aarch64")]
    const AUDIT_ARCH: u32 = 0xC000_00B7;
    const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    const ALLOW: u32 = 0x7fff_0000; // SECCOMP_RET_ALLOW
    const ERRNO: u32 = 0x0005_0000; // SECCOMP_RET_ERRNO
    let op = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    vec![
        op(LD_W_ABS, 0, 0, 4), // seccomp_data.arch
        op(JEQ_K, 0, 3, AUDIT_ARCH),
        op(LD_W_ABS, 0, 0, 0), // seccomp_data.nr
        op(JEQ_K, 0, 1, nr as u32),
        op(RET_K, 0, 0, ERRNO | libc::EPERM as u32),
        op(RET_K, 0, 0, ALLOW),
    ]
}

/// A [`Stunnerd::start_with`] customization: the process runs under a seccomp filter that fails
/// syscall `nr` with EPERM.
pub fn denying(nr: libc::c_long) -> impl FnOnce(&mut Command) {
    move |command| {
        use std::os::unix::process::CommandExt;
        let filter = seccomp_denying(nr);
        // SAFETY: runs in the child between fork and exec and only makes two prctl calls
        // (async-signal-safe) on memory that the parent built before forking.
        unsafe {
            command.pre_exec(move || {
                let program = libc::sock_fprog {
                    len: filter.len() as u16,
                    filter: filter.as_ptr() as *mut libc::sock_filter,
                };
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                    || libc::prctl(
                        libc::PR_SET_SECCOMP,
                        libc::SECCOMP_MODE_FILTER,
                        &program as *const libc::sock_fprog,
                    ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

/// Runs coturn's `turnutils_uclient ARGS`, given up after `secs` seconds: (messages sent,
/// messages received, its output).
pub fn uclient(secs: u32, args: &[&str]) -> (u64, u64, String) {
    uclient_under(&[], secs, args)
}

/// As [`uclient`], run through `wrapper` (`ip netns exec NAME`, say).
pub fn uclient_under(wrapper: &[&str], secs: u32, args: &[&str]) -> (u64, u64, String) {
    let output = Command::new("timeout")
        .arg(secs.to_string())
        .args(wrapper)
        .arg("turnutils_uclient")
        .args(args)
        .output()
        .expect("turnutils_uclient (apt-get install coturn)");
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    let last = |key: &str| {
        text.lines()
            .rev()
            .find_map(|l| l.split(key).nth(1))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    (last("tot_send_msgs="), last("tot_recv_msgs="), text)
}

/// STUNner's own stunnerd (github.com/l7mp/stunner v1.2.1, `cmd/stunnerd`), the reference a
/// differential test runs beside [`stunnerd_binary`]: `target/go/bin/stunnerd-stunner`, which
/// `bash .ci/go-components` builds from the Go module proxy (or `UTURN_STUNNER_BINARY`, if set).
/// Panics, with that command, when it is missing: a differential test never skips.
pub fn stunner_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("UTURN_STUNNER_BINARY") {
        let path = PathBuf::from(path);
        assert!(
            path.exists(),
            "UTURN_STUNNER_BINARY={} does not exist",
            path.display()
        );
        return path;
    }
    // target/<profile>/deps/<test> → target/go/bin/stunnerd-stunner.
    let exe = std::env::current_exe().expect("the test executable's path");
    let target = exe
        .ancestors()
        .nth(3)
        .expect("the test executable sits in target/<profile>/deps");
    let path = target.join("go/bin/stunnerd-stunner");
    assert!(
        path.exists(),
        "STUNner's stunnerd is missing at {}: build it with `bash .ci/go-components` (from the \
         repository's root; it builds github.com/l7mp/stunner v1.2.1 cmd/stunnerd from the Go \
         module proxy into target/go/bin/stunnerd-stunner)",
        path.display()
    );
    path
}

/// Runs `binary ARGS` with `envs` to its end (without `STUNNER_CONFIG_ORIGIN` from the
/// environment), given up (and killed) after `secs`: its exit code (`None`: still running
/// after `secs`, or killed by a signal) and its output, stdout then stderr. [`run_stunnerd`]
/// for any stunnerd binary.
pub fn run_binary(
    binary: &Path,
    args: &[&str],
    envs: &[(&str, &str)],
    secs: f64,
) -> (Option<i32>, String) {
    let out_path = temp_file("run.out");
    let err_path = temp_file("run.err");
    let mut child = Command::new(binary)
        .args(args)
        .env_remove("STUNNER_CONFIG_ORIGIN")
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::from(std::fs::File::create(&out_path).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(&err_path).unwrap()))
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", binary.display()));
    let code = wait_child(&mut child, secs);
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&out_path).unwrap_or_default()
        + &std::fs::read_to_string(&err_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    let _ = std::fs::remove_file(&err_path);
    (code, text)
}

impl Stunnerd {
    /// Starts `binary ARGS` with `envs`, as [`Stunnerd::start`] starts this workspace's
    /// stunnerd (`UTURN_SHARDS=1` unless `envs` sets it; other binaries ignore it): for a
    /// differential test that runs another stunnerd ([`stunner_binary`]) the same way.
    pub fn start_binary(binary: &Path, args: &[&str], envs: &[(&str, &str)]) -> Stunnerd {
        let log = std::env::temp_dir().join(format!(
            "uturn-stunnerd-{}-{}.log",
            std::process::id(),
            free_port()
        ));
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(binary)
            .args(args)
            .env_remove("STUNNER_CONFIG_ORIGIN")
            .env("UTURN_SHARDS", "1")
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", binary.display()));
        Stunnerd { child, log }
    }
}
