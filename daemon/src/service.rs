//! The daemon's life: load the configuration, open devices, serve the bus, tell systemd,
//! handle signals (SIGHUP reloads, SIGTERM/SIGINT stop), release everything on the way out.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use sd_notify::NotifyState;
use tokio::signal::unix::{signal, SignalKind};

use crate::cli::Args;
use crate::config::Config;
use crate::dbus::{self, Bus, Reloader};
use crate::engine::{Engine, EngineError};
use crate::logging::{self, LogHandle};

/// Runs the daemon until SIGTERM or SIGINT.
/// Every queue pair holds several descriptors (its ring, its wake-up pipes, its CQ's
/// channel) and every region one: the soft limit (1,024 by default) would let a single
/// tenant at its quotas leave rdmad none for anyone else. The hard limit is the bound the
/// system sets; quotas keep every tenant well inside it.
fn raise_descriptor_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!("cannot raise the descriptor limit from {soft} to {hard}: {e}");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("cannot read the descriptor limit: {e}"),
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let config = Config::load_or_default(&args.config)?;
    if args.check_config {
        println!("{}: configuration is valid", args.config.display());
        // Devices are not opened here: only the pools can be compared.
        for q in crate::policy::quota::oversized(&config, &config.effective_pools(), &[]) {
            eprintln!("{}: warning: {q}", args.config.display());
        }
        return Ok(());
    }
    let log = logging::init(
        args.log_target,
        args.log_level.unwrap_or(config.daemon.log_level),
    );
    raise_descriptor_limit();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("rdmad")
        .on_thread_park(crate::lock::mark_executor)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(args, config, log))
}

fn notify(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::warn!("cannot notify systemd: {e}");
    }
}

async fn serve(args: Args, config: Config, log: LogHandle) -> anyhow::Result<()> {
    // The engine finds what only the host can tell (a configured device it does not have);
    // its errors name the key, and get their line here.
    let engine = Arc::new(
        Engine::start(config, args.config.clone(), args.provider).map_err(|e| match e {
            EngineError::Config(e) => EngineError::Config(e.located()),
            other => other,
        })?,
    );
    crate::policy::quota::warn_of_oversized(&engine.config(), &engine);
    let reloader = make_reloader(Arc::clone(&engine), log, args.log_level.is_some());

    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut sighup = signal(SignalKind::hangup()).context("cannot handle SIGHUP")?;

    let served = dbus::serve(
        &Bus::parse(&args.bus),
        Arc::clone(&engine),
        Arc::clone(&reloader),
    )
    .await?;
    let status = engine.status_line();
    tracing::info!(bus = %args.bus, "ready: {status}");
    notify(&[NotifyState::Ready, NotifyState::Status(&status)]);

    let watchdog = watchdog_interval();
    let mut watchdog_tick = tokio::time::interval(watchdog.unwrap_or(Duration::from_secs(3600)));

    // STATUS= follows the live counts, sent when they change.
    let mut status_tick = tokio::time::interval(Duration::from_secs(2));
    let mut last_status = status;
    loop {
        tokio::select! {
            _ = status_tick.tick() => {
                // What a device refused to destroy is tried again (the engine also does
                // after every teardown), off the runtime's threads.
                if !engine.lingering().is_empty() {
                    let engine = Arc::clone(&engine);
                    let _ = tokio::task::spawn_blocking(move || engine.retry_lingering()).await;
                }
                let status = engine.status_line();
                if status != last_status {
                    notify(&[NotifyState::Status(&status)]);
                    last_status = status;
                }
            }
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
            _ = sighup.recv() => {
                tracing::info!("SIGHUP: reloading the configuration");
                // The reloader logs and reports its own outcome.
                let reloader = Arc::clone(&reloader);
                let _ = tokio::task::spawn_blocking(move || reloader()).await;
            }
            _ = watchdog_tick.tick(), if watchdog.is_some() => notify(&[NotifyState::Watchdog]),
        }
    }

    tracing::info!("stopping");
    notify(&[NotifyState::Stopping, NotifyState::Status("Stopping")]);
    dbus::unserve(served, &engine).await;
    drop(reloader);
    match Arc::try_unwrap(engine) {
        Ok(engine) => engine.shutdown(),
        Err(_) => tracing::error!("D-Bus objects still hold the engine; it is released on exit"),
    }
    tracing::info!("stopped");
    Ok(())
}

/// Half the watchdog period systemd asked for, as `sd_watchdog_enabled(3)` reads it:
/// `WATCHDOG_USEC` set, and `WATCHDOG_PID` either unset or this process.
fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.parse::<u32>().ok()? != std::process::id() {
            return None;
        }
    }
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// The one reload procedure behind SIGHUP and `Manager.Reload`: tells systemd, swaps the
/// configuration if it is valid, applies what can change at run time.
fn make_reloader(engine: Arc<Engine>, log: LogHandle, log_level_pinned: bool) -> Reloader {
    Arc::new(move || {
        // MONOTONIC_USEC lets systemd (Type=notify-reload) match this reload to its request.
        let mut states = vec![NotifyState::Reloading];
        states.extend(NotifyState::monotonic_usec_now().ok());
        notify(&states);
        // A missing file is refused even at the packaged path, where it means the defaults
        // at start: see `Config::check_present`.
        let outcome = match Config::check_present(engine.config_path())
            .and_then(|()| engine.reload())
        {
            Ok((config, needs_restart)) => {
                if !log_level_pinned {
                    log.set_level(config.daemon.log_level);
                }
                crate::policy::quota::warn_of_oversized(&config, &engine);
                for setting in needs_restart {
                    tracing::warn!("{setting} changed; it takes effect when rdmad restarts");
                }
                tracing::info!(file = %engine.config_path().display(), "configuration reloaded");
                Ok(())
            }
            Err(e) => {
                tracing::error!("configuration not reloaded, the previous one stays in force: {e}");
                Err(e)
            }
        };
        notify(&[
            NotifyState::Ready,
            NotifyState::Status(&engine.status_line()),
        ]);
        outcome
    })
}
