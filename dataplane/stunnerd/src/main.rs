//! `stunnerd`: uturn's drop-in replacement for STUNner's dataplane daemon.
//!
//! The one place that depends on both planes: it reads the flags (`flags.rs`, the kubectl ones
//! in `kube_flags.rs`), starts up in stunnerd's order (`startup.rs`: the first config, the log,
//! the checks, the shards), hands the control plane one handle on the dataplane (`handle.rs`,
//! with the offload's and the siblings' parts in `offload.rs` and `siblings.rs`), and waits
//! for SIGTERM or SIGINT to drain (`shutdown.rs`). `logging.rs` prints stunnerd's log format.

mod flags;
mod handle;
mod kube_flags;
mod logging;
mod offload;
mod shutdown;
mod siblings;
mod startup;

use flags::Cli;
use handle::Gateway;
use logging::FollowedLevel;
use startup::{Checked, Refusal};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use uturn_control::{Control, ControlConfig};

fn main() -> ExitCode {
    // Before any thread exists, so that every thread inherits the mask.
    shutdown::block_signals();
    startup::raise_fd_limit();
    let (cli, matches) = flags::parse();
    match run(&cli, &matches) {
        Ok(()) => ExitCode::SUCCESS,
        Err(refusal) => {
            refusal.report();
            ExitCode::from(1)
        }
    }
}

/// Starts the planes as the flags say and runs until drained (a dry run ends once the first
/// config and the flags passed).
fn run(cli: &Cli, matches: &clap::ArgMatches) -> Result<(), Refusal> {
    let checked = Checked::new(cli, matches)?;
    let initial = startup::initial_config(cli, &checked)?;
    let spec = startup::start_logging(cli, &checked, &initial);
    let plan = startup::check_start(cli, &checked, &initial.config)?;
    if cli.dry_run {
        startup::dry_run(&initial.config);
        return Ok(());
    }
    let snapshot = uturn_control::first_snapshot(&initial.config);
    let (siblings, sibling_setup) = checked.siblings.unzip();
    let (dataplane, offload) =
        startup::start_dataplane(cli, &initial.config, &snapshot, &plan, sibling_setup)?;
    let gateway = Arc::new(Gateway::new(
        dataplane,
        offload,
        siblings.is_some().then(|| snapshot.clone()),
        plan.shared_ports,
        FollowedLevel::new(spec, checked.log.is_none()),
    ));
    let control = Control::start(ControlConfig {
        source: initial.source,
        initial: initial.config,
        snapshot,
        kube: checked.kube,
        discovery_timeout: Duration::from_secs(cli.discovery_timeout),
        siblings: siblings.unwrap_or_default(),
        force_ready: cli.force_ready_status,
        license: checked.license,
        dataplane: gateway.clone(),
    })
    .map_err(|e| Refusal::Logged(format!("cannot start the control thread: {e}")))?;
    shutdown::run_until_drained(
        gateway.dataplane(),
        &control,
        cli.drain_timeout.map(Duration::from_secs),
        cli.no_graceful_shutdown,
        &|| gateway.every_second(),
    );
    Ok(())
}
