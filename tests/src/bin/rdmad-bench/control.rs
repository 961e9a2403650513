//! `rdmad-bench control`: the control plane under load — how many `AllocateRegion` + `Free`
//! pairs rdmad answers per second with 1, 8 and 64 clients at once, next to how many bare
//! `GetId` calls the same bus answers with as many clients, in one run.
//!
//! ```text
//! rdmad-bench control [--provider loopback|verbs] [--device NAME] [--clients 1,8,64] [--seconds S]
//! ```
//!
//! Every client is its own process-like unit: a thread with its own runtime, its own bus
//! connection and (for the rdmad series) its own session. For each client count, three
//! series of `--seconds` (default 3) each, all clients starting together:
//!
//! - **GetId**: each client calls `org.freedesktop.DBus.GetId` back to back (the bus's floor);
//! - **alloc+free**: each client allocates a 4 KiB region from a warm pool, frees it and
//!   closes the descriptor, back to back;
//! - **alloc+free beside a registration**: the same, while one more client allocates and
//!   frees 16 MiB regions from a pool without warm regions, so the daemon registers fresh
//!   memory all the while. If a call waited behind another client's registration, its
//!   latency would grow by a registration's time;
//! - **alloc+free, direct**: the alloc+free series with each client on a direct connection
//!   (`Manager.OpenDirect`) instead of the bus (up to 64 clients: the per-user limit).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use rdmad_client::proxy::{ManagerProxy, Options, RegionProxy, SessionProxy};
use rdmad_tests::bus::PrivateBus;
use rdmad_tests::daemon::{Daemon, DaemonOptions};
use zbus::proxy::CacheProperties;

use crate::{machine, percentile, us, Result};

const USAGE: &str = "usage: rdmad-bench control [--provider loopback|verbs] [--device NAME] \
                     [--clients N,N,...] [--seconds S]";
const WARM_POOL: &str = "small";
const COLD_POOL: &str = "fresh";
/// The size every client allocates, and the size the neighbour registers.
const SMALL: u64 = 4 << 10;
const LARGE: u64 = 16 << 20;

struct Args {
    provider: &'static str,
    device: Option<String>,
    clients: Vec<usize>,
    seconds: f64,
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args> {
    let mut args = Args {
        provider: "loopback",
        device: None,
        clients: vec![1, 8, 64],
        seconds: 3.0,
    };
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--provider" => {
                args.provider = match value("--provider")?.as_str() {
                    "loopback" => "loopback",
                    "verbs" => "verbs",
                    other => return Err(format!("unknown provider {other:?}\n{USAGE}").into()),
                }
            }
            "--device" => args.device = Some(value("--device")?),
            "--clients" => {
                let list = value("--clients")?;
                args.clients = list
                    .split(',')
                    .map(|n| match n.trim().parse::<usize>() {
                        Ok(n) if (1..=200).contains(&n) => Ok(n),
                        _ => Err(format!(
                            "--clients: {n:?} is not a client count from 1 to 200 \
                             (give a comma-separated list, e.g. 1,8,64)"
                        )),
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--seconds" => {
                let s: f64 = value("--seconds")?
                    .parse()
                    .map_err(|e| format!("--seconds: {e}"))?;
                if !(0.1..=600.0).contains(&s) {
                    return Err("--seconds must be between 0.1 and 600".into());
                }
                args.seconds = s;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}").into()),
        }
    }
    Ok(args)
}

fn daemon_config(args: &Args, device: &str, max_clients: usize) -> String {
    let mut text = String::from("[daemon]\nlog_level = \"warn\"\n\n");
    if args.provider == "verbs" {
        text.push_str(&format!("[[device]]\nname = \"{device}\"\n\n"));
    }
    // Every client holds at most one small region; the neighbour one large one.
    let warm = max_clients.max(8);
    text.push_str(&format!(
        "[[pool]]\nname = \"{WARM_POOL}\"\ndevice = \"{device}\"\ncapacity = \"64MiB\"\n\
         size_classes = [\"4KiB\"]\nwarm = {warm}\n\n\
         [[pool]]\nname = \"{COLD_POOL}\"\ndevice = \"{device}\"\ncapacity = \"64MiB\"\n\
         size_classes = [\"16MiB\"]\nwarm = 0\n\n\
         [quota.default]\nsessions = {}\nregions = {}\nregistered_bytes = \"48MiB\"\n",
        max_clients + 8,
        max_clients + 8,
    ));
    text
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    GetId,
    AllocFree,
    /// AllocFree on a direct connection.
    AllocFreeDirect,
}

/// The most direct connections one user (the benchmark's) may hold.
const MAX_DIRECT: usize = 64;

/// Runs one client on its own thread, runtime and connection; it waits at `start`, runs
/// `op` until `stop` is set, and returns how long each call (or pair) took.
fn client(
    address: String,
    op: Op,
    pool: &'static str,
    size: u64,
    start: Arc<Barrier>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Result<Vec<Duration>, String>> {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        runtime
            .block_on(run_client(address, op, pool, size, start, stop))
            .map_err(|e| e.to_string())
    })
}

async fn run_client(
    address: String,
    op: Op,
    pool: &str,
    size: u64,
    start: Arc<Barrier>,
    stop: Arc<AtomicBool>,
) -> Result<Vec<Duration>> {
    let bus_connection = zbus::connection::Builder::address(address.as_str())?
        .build()
        .await?;
    let bus = zbus::fdo::DBusProxy::new(&bus_connection).await?;
    let connection = match op {
        Op::AllocFreeDirect => rdmad_client::connect_direct(&bus_connection).await?,
        Op::GetId | Op::AllocFree => bus_connection.clone(),
    };
    let session = match op {
        Op::GetId => None,
        Op::AllocFree | Op::AllocFreeDirect => {
            let manager = ManagerProxy::new(&connection).await?;
            let path = manager.open_session(Options::new()).await?;
            Some(
                SessionProxy::builder(&connection)
                    .path(path)?
                    .cache_properties(CacheProperties::No)
                    .build()
                    .await?,
            )
        }
    };
    // Nothing is in flight on this connection while the thread waits here.
    start.wait();
    let mut samples = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let began = Instant::now();
        match &session {
            None => {
                bus.get_id().await?;
            }
            Some(session) => {
                let (path, fd, got) = session.allocate_region(pool, size, Options::new()).await?;
                if got != size {
                    return Err(format!("asked for {size} bytes, got {got}").into());
                }
                RegionProxy::builder(&connection)
                    .path(path)?
                    .cache_properties(CacheProperties::No)
                    .build()
                    .await?
                    .free()
                    .await?;
                drop(fd);
            }
        }
        samples.push(began.elapsed());
    }
    if let Some(session) = session {
        session.close().await?;
    }
    Ok(samples)
}

/// One series: `n` clients doing `op` for `seconds`, and with `neighbour` one more client
/// registering fresh 16 MiB regions all the while.
struct Series {
    per_second: f64,
    median: Duration,
    p99: Duration,
    neighbour_per_second: Option<f64>,
}

fn series(address: &str, n: usize, op: Op, neighbour: bool, seconds: f64) -> Result<Series> {
    let start = Arc::new(Barrier::new(n + usize::from(neighbour) + 1));
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles: Vec<_> = (0..n)
        .map(|_| {
            client(
                address.to_owned(),
                op,
                WARM_POOL,
                SMALL,
                Arc::clone(&start),
                Arc::clone(&stop),
            )
        })
        .collect();
    let neighbour_handle = neighbour.then(|| {
        client(
            address.to_owned(),
            Op::AllocFree,
            COLD_POOL,
            LARGE,
            Arc::clone(&start),
            Arc::clone(&stop),
        )
    });
    start.wait();
    let began = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for handle in handles.drain(..) {
        let result = handle.join().map_err(|_| "a client thread panicked")??;
        all.extend(result);
    }
    // Every client finishes the call it is in after `stop`: the series lasted until the
    // last one came back.
    let elapsed = began.elapsed().as_secs_f64();
    let neighbour_per_second = match neighbour_handle {
        Some(handle) => {
            let result = handle
                .join()
                .map_err(|_| "the neighbour thread panicked")??;
            Some(result.len() as f64 / elapsed)
        }
        None => None,
    };
    if all.is_empty() {
        return Err(format!("{n} clients finished no call in {seconds} s").into());
    }
    all.sort_unstable();
    Ok(Series {
        per_second: all.len() as f64 / elapsed,
        median: percentile(&all, 0.5),
        p99: percentile(&all, 0.99),
        neighbour_per_second,
    })
}

/// Runs the benchmark with the arguments after `control`.
pub async fn run(args: impl Iterator<Item = String>) -> Result<()> {
    let args = parse_args(args)?;
    let device = match (&args.device, args.provider) {
        (Some(name), _) => name.clone(),
        (None, "verbs") => "rxe0".to_owned(),
        (None, _) => rdmad::provider::loopback::DEFAULT_NAME.to_owned(),
    };
    let max_clients = args.clients.iter().copied().max().unwrap_or(1);
    println!("# rdmad-bench control");
    println!(
        "provider {}, device {device}, clients {:?}, {} s per series",
        args.provider, args.clients, args.seconds
    );
    println!(
        "command: {}",
        std::env::args().collect::<Vec<_>>().join(" ")
    );
    println!("machine: {}", machine());

    let bus = PrivateBus::start();
    let _daemon = Daemon::start(
        &bus,
        DaemonOptions {
            provider: args.provider,
            config: daemon_config(&args, &device, max_clients),
            ..DaemonOptions::default()
        },
    )
    .await;
    // Untimed: every client's first allocation would otherwise race the first refill.
    series(&bus.address, 1, Op::AllocFree, false, 0.2)?;

    let mut rows = Vec::new();
    for &n in &args.clients {
        let get_id = series(&bus.address, n, Op::GetId, false, args.seconds)?;
        let alone = series(&bus.address, n, Op::AllocFree, false, args.seconds)?;
        let beside = series(&bus.address, n, Op::AllocFree, true, args.seconds)?;
        let direct = (n <= MAX_DIRECT)
            .then(|| series(&bus.address, n, Op::AllocFreeDirect, false, args.seconds))
            .transpose()?;
        eprintln!("rdmad-bench: {n} clients done");
        rows.push((n, get_id, alone, beside, direct));
    }

    println!();
    println!(
        "Calls per second over all clients; latency of one call (or pair) in µs, median (p99)."
    );
    println!();
    println!(
        "| clients | GetId/s | GetId µs | alloc+free/s | ÷ GetId/s | alloc+free µs \
         | beside a registration: alloc+free/s | µs | its 16 MiB registrations/s \
         | direct: alloc+free/s | ÷ GetId/s | µs |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (n, get_id, alone, beside, direct) in &rows {
        let direct = match direct {
            Some(d) => format!(
                "{:.0} | {:.2} | {} ({})",
                d.per_second,
                d.per_second / get_id.per_second,
                us(d.median),
                us(d.p99)
            ),
            None => format!("— (over {MAX_DIRECT} clients) | — | —"),
        };
        println!(
            "| {n} | {:.0} | {} ({}) | {:.0} | {:.2} | {} ({}) | {:.0} | {} ({}) | {:.1} | {direct} |",
            get_id.per_second,
            us(get_id.median),
            us(get_id.p99),
            alone.per_second,
            alone.per_second / get_id.per_second,
            us(alone.median),
            us(alone.p99),
            beside.per_second,
            us(beside.median),
            us(beside.p99),
            beside.neighbour_per_second.unwrap_or(0.0),
        );
    }
    println!();
    println!("Each client: its own thread, runtime, bus connection and session. alloc+free: a");
    println!("4 KiB region from a warm pool, freed, its descriptor closed. The neighbour");
    println!("allocates and frees 16 MiB regions from a pool without warm regions, so the");
    println!("daemon registers fresh memory for every one of them. direct: the alloc+free series");
    println!("with every client on a direct connection (Manager.OpenDirect) instead of the bus.");
    Ok(())
}
