//! `rdmad-bench [regions]`: what a region from rdmad's warm pool costs a client, against
//! registering its own memory on the same device.
//!
//! ```text
//! rdmad-bench [regions] [--provider loopback|verbs] [--device NAME] [--iterations N] [--no-cold]
//! ```
//!
//! For each size (4 KiB … 64 MiB), in one run:
//!
//! - **rdmad warm**: `Session.AllocateRegion("bench", size)` + `Region.Free` + closing the
//!   returned memfd, over D-Bus, against the real `rdmad` on a private bus. Before every
//!   timed iteration the benchmark waits (untimed) until the pool's warm set is full
//!   again, so every timed allocation is served from the warm set.
//! - **rdmad cold** (unless `--no-cold`): the same from a pool without warm regions, so the
//!   daemon creates and registers a region on demand.
//! - **raw**: `ProtectionDomain::register` + drop (`ibv_reg_mr` + `ibv_dereg_mr` on verbs)
//!   of a memfd mapping of that size, allocated once and pre-touched, with this process's
//!   own device context and PD on the same device.
//! - **fresh**: what a client without rdmad does for memory it has not touched yet: a new
//!   memfd mapping of that size, a first write to every page, `ibv_reg_mr`, then
//!   `ibv_dereg_mr` and unmapping, all timed.
//!
//! `--iterations N` (default 200) applies to sizes up to 1 MiB; 16 MiB runs N/4 and
//! 64 MiB N/10 iterations (at least 5). Two untimed iterations precede every series.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmad::engine::REGION_ACCESS;
use rdmad::memory::SharedMemory;
use rdmad::provider::{loopback, verbs, Device, ProtectionDomain};
use rdmad_client::names::{pool_path, BUS_NAME, MANAGER_PATH};
use rdmad_client::proxy::{ManagerProxy, Options, PoolProxy, RegionProxy, SessionProxy};
use rdmad_tests::bus::PrivateBus;
use rdmad_tests::daemon::{Daemon, DaemonOptions};

use crate::{machine, percentile, us, Result};
use zbus::proxy::CacheProperties;
use zbus::zvariant::{OwnedFd, OwnedObjectPath};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const SIZES: [u64; 5] = [4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB];
/// Warm regions per size class in the benchmark pool.
const WARM: u64 = 4;
const WARM_POOL: &str = "bench";
const COLD_POOL: &str = "cold";
/// Untimed iterations before every series.
const WARMUP: u32 = 2;
/// Sleep between two reads of the warm count.
const POLL: Duration = Duration::from_micros(500);
/// Longest wait for the warm set to fill (generous: the VM runs under TCG).
const REFILL_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Provider {
    Loopback,
    Verbs,
}

impl Provider {
    fn as_str(self) -> &'static str {
        match self {
            Provider::Loopback => "loopback",
            Provider::Verbs => "verbs",
        }
    }
}

struct Args {
    provider: Option<Provider>,
    device: Option<String>,
    iterations: u32,
    cold: bool,
}

const USAGE: &str = "usage: rdmad-bench [regions] [--provider loopback|verbs] [--device NAME] \
                     [--iterations N] [--no-cold]";

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args> {
    let mut args = Args {
        provider: None,
        device: None,
        iterations: 200,
        cold: true,
    };
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--provider" => {
                args.provider = Some(match value("--provider")?.as_str() {
                    "loopback" => Provider::Loopback,
                    "verbs" => Provider::Verbs,
                    other => return Err(format!("unknown provider {other:?}\n{USAGE}").into()),
                })
            }
            "--device" => args.device = Some(value("--device")?),
            "--iterations" => {
                let n: u32 = value("--iterations")?
                    .parse()
                    .map_err(|e| format!("--iterations: {e}"))?;
                if n == 0 {
                    return Err("--iterations must be at least 1".into());
                }
                args.iterations = n;
            }
            "--no-cold" => args.cold = false,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}").into()),
        }
    }
    Ok(args)
}

/// Iterations for one size: `n` up to 1 MiB, fewer for the large sizes.
fn iterations_for(size: u64, n: u32) -> u32 {
    if size <= MIB {
        n
    } else if size <= 16 * MIB {
        (n / 4).max(5)
    } else {
        (n / 10).max(5)
    }
}

fn size_name(size: u64) -> String {
    if size >= MIB {
        format!("{} MiB", size / MIB)
    } else {
        format!("{} KiB", size / KIB)
    }
}

fn toml_size(size: u64) -> String {
    if size % MIB == 0 {
        format!("\"{}MiB\"", size / MIB)
    } else {
        format!("\"{}KiB\"", size / KIB)
    }
}

/// The device this process registers on, opened with the rdmad library's provider.
fn open_raw_device(provider: Provider, name: Option<&str>) -> Result<Arc<dyn Device>> {
    Ok(match provider {
        Provider::Loopback => Arc::new(loopback::LoopbackDevice::new(
            name.unwrap_or(loopback::DEFAULT_NAME),
        )),
        Provider::Verbs => match name {
            Some(name) => Arc::new(verbs::open_device(name)?),
            None => verbs::open_devices()?
                .into_iter()
                .next()
                .ok_or("no RDMA device")?,
        },
    })
}

/// The daemon's configuration: a warm pool and a cold pool with the benchmark's sizes.
fn daemon_config(provider: Provider, device: &str) -> String {
    let sum: u64 = SIZES.iter().sum();
    let classes = SIZES
        .iter()
        .map(|&s| toml_size(s))
        .collect::<Vec<_>>()
        .join(", ");
    // W warm regions of every class plus one allocated region of every class, rounded up
    // to 64 MiB: the warm set always fits beside the region being timed.
    let warm_capacity = (sum * (WARM + 1)).next_multiple_of(64 * MIB);
    let cold_capacity = sum.next_multiple_of(64 * MIB);
    // Quotas count allocated regions only; a user never holds more than one here, so a
    // limit of one region of every size can never be what refuses (and, below the warm
    // pool's capacity, is not a quota rdmad warns about).
    let quota = sum;
    let mut text = String::from("[daemon]\nlog_level = \"warn\"\n\n");
    if provider == Provider::Verbs {
        text.push_str(&format!("[[device]]\nname = \"{device}\"\n\n"));
    }
    for (name, capacity, warm) in [
        (WARM_POOL, warm_capacity, WARM),
        (COLD_POOL, cold_capacity, 0),
    ] {
        text.push_str(&format!(
            "[[pool]]\nname = \"{name}\"\ndevice = \"{device}\"\ncapacity = \"{}MiB\"\n\
             size_classes = [{classes}]\nwarm = {warm}\n\n",
            capacity / MIB
        ));
    }
    text.push_str(&format!(
        "[quota.default]\nregistered_bytes = {}\n",
        toml_size(quota)
    ));
    text
}

#[derive(Debug, Clone, Copy)]
struct Stats {
    median: Duration,
    p90: Duration,
}

/// Median and 90th percentile (nearest rank).
fn stats(samples: &[Duration]) -> Stats {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    Stats {
        median: percentile(&sorted, 0.5),
        p90: percentile(&sorted, 0.9),
    }
}

fn cell(s: Stats) -> String {
    format!("{} ({})", us(s.median), us(s.p90))
}

/// A ratio with three significant digits.
fn ratio(x: f64) -> String {
    if x >= 100.0 || x == 0.0 {
        format!("{x:.0}")
    } else {
        let decimals = (2 - x.log10().floor() as i32).max(0) as usize;
        format!("{x:.decimals$}")
    }
}

/// One size's samples.
struct Series {
    size: u64,
    iterations: u32,
    /// AllocateRegion + Free + close, from the warm pool.
    warm: Vec<Duration>,
    warm_alloc: Vec<Duration>,
    warm_free: Vec<Duration>,
    /// From the end of Free until the warm count was back (polled, untimed).
    refill_wait: Vec<Duration>,
    /// Free + close with the warm set refilled before the Free (no refill running).
    settled_free: Vec<Duration>,
    cold: Vec<Duration>,
    raw: Vec<Duration>,
    fresh: Vec<Duration>,
    /// `GetId` and `Peer.Ping` once each per warm iteration, right before it.
    get_id: Vec<Duration>,
    ping: Vec<Duration>,
    /// The same warm series on a direct connection: `Peer.Ping` on it, `AllocateRegion`,
    /// `Free` + close.
    direct_ping: Vec<Duration>,
    direct_alloc: Vec<Duration>,
    direct_free: Vec<Duration>,
}

struct Floors<'a> {
    bus: zbus::fdo::DBusProxy<'a>,
    rdmad: zbus::fdo::PeerProxy<'a>,
}

impl Floors<'_> {
    /// One call of each: how long `GetId` and `Ping` took.
    async fn sample(&self) -> Result<(Duration, Duration)> {
        let start = Instant::now();
        self.bus.get_id().await?;
        let get_id = start.elapsed();
        let start = Instant::now();
        self.rdmad.ping().await?;
        Ok((get_id, start.elapsed()))
    }
}

struct Bench<'a> {
    connection: zbus::Connection,
    session: SessionProxy<'a>,
    warm_pool: PoolProxy<'a>,
    full: u64,
}

impl Bench<'_> {
    /// Waits until the warm pool holds WARM regions of every class; returns how long.
    async fn wait_full(&self) -> Result<Duration> {
        let start = Instant::now();
        loop {
            let warm = self.warm_pool.warm_regions().await?;
            if warm >= self.full {
                return Ok(start.elapsed());
            }
            if start.elapsed() > REFILL_TIMEOUT {
                return Err(format!(
                    "the warm set did not refill within {REFILL_TIMEOUT:?}: {warm} of {} regions",
                    self.full
                )
                .into());
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// `AllocateRegion`: the region's path, its memfd and how long the call took.
    async fn allocate(
        &self,
        pool: &str,
        size: u64,
    ) -> Result<(OwnedObjectPath, OwnedFd, Duration)> {
        let start = Instant::now();
        let (path, fd, got) = self
            .session
            .allocate_region(pool, size, Options::new())
            .await?;
        let took = start.elapsed();
        if got != size {
            return Err(format!("asked for {size} bytes, got a region of {got}").into());
        }
        Ok((path, fd, took))
    }

    /// `Region.Free`, then closing the memfd: how long both took.
    async fn free(&self, path: OwnedObjectPath, fd: OwnedFd) -> Result<Duration> {
        let start = Instant::now();
        let region = RegionProxy::builder(&self.connection)
            .path(path)?
            .cache_properties(CacheProperties::No)
            .build()
            .await?;
        region.free().await?;
        drop(fd);
        Ok(start.elapsed())
    }

    /// One AllocateRegion + Free + close of the fd; returns (allocate, free + close).
    async fn alloc_free(&self, pool: &str, size: u64) -> Result<(Duration, Duration)> {
        let (path, fd, alloc) = self.allocate(pool, size).await?;
        let free = self.free(path, fd).await?;
        Ok((alloc, free))
    }
}

fn raw_series(pd: &dyn ProtectionDomain, size: u64, n: u32) -> Result<Vec<Duration>> {
    let memory = SharedMemory::create(c"rdmad-bench", usize::try_from(size)?)?;
    // Pre-touch every page, so the registration below only pins pages that exist.
    for offset in (0..memory.len()).step_by(4096) {
        memory.write_at(offset, &[1])?;
    }
    let memory = Arc::new(memory);
    let mut samples = Vec::with_capacity(n as usize);
    for i in 0..WARMUP + n {
        let start = Instant::now();
        let mr = pd.register(Arc::clone(&memory), REGION_ACCESS)?;
        drop(mr);
        if i >= WARMUP {
            samples.push(start.elapsed());
        }
    }
    Ok(samples)
}

/// Fresh memory each time: create and map, touch every page, register, deregister, unmap.
fn fresh_series(pd: &dyn ProtectionDomain, size: u64, n: u32) -> Result<Vec<Duration>> {
    let len = usize::try_from(size)?;
    let mut samples = Vec::with_capacity(n as usize);
    for i in 0..WARMUP + n {
        let start = Instant::now();
        let memory = SharedMemory::create(c"rdmad-bench-fresh", len)?;
        for offset in (0..len).step_by(4096) {
            memory.write_at(offset, &[1])?;
        }
        let mr = pd.register(Arc::new(memory), REGION_ACCESS)?;
        // The registration holds the memory: dropping it deregisters, then unmaps.
        drop(mr);
        if i >= WARMUP {
            samples.push(start.elapsed());
        }
    }
    Ok(samples)
}

/// Runs the benchmark with the arguments after `regions`.
pub async fn run(args: impl Iterator<Item = String>) -> Result<()> {
    let args = parse_args(args)?;
    let provider = match args.provider {
        Some(p) => p,
        None => match verbs::open_devices() {
            Ok(devices) if !devices.is_empty() => Provider::Verbs,
            _ => Provider::Loopback,
        },
    };
    let raw_device = open_raw_device(provider, args.device.as_deref())?;
    let device = raw_device.name().to_owned();
    let pd = raw_device.alloc_pd()?;

    let command = std::env::args().collect::<Vec<_>>().join(" ");
    println!("# rdmad-bench");
    println!(
        "provider {}, device {device}, iterations {} (4 KiB-1 MiB) / {} (16 MiB) / {} (64 MiB), \
         warm = {WARM} per class",
        provider.as_str(),
        iterations_for(4 * KIB, args.iterations),
        iterations_for(16 * MIB, args.iterations),
        iterations_for(64 * MIB, args.iterations),
    );
    println!("command: {command}");
    println!("machine: {}", machine());

    let bus = PrivateBus::start();
    let config = daemon_config(provider, &device);
    let _daemon = Daemon::start(
        &bus,
        DaemonOptions {
            provider: provider.as_str(),
            config,
            ..DaemonOptions::default()
        },
    )
    .await;
    let connection = bus.connect().await;
    let manager = ManagerProxy::new(&connection).await?;
    manager.get_device(&device).await?;
    let session_path = manager.open_session(Options::new()).await?;
    let session = SessionProxy::builder(&connection)
        .path(session_path)?
        .cache_properties(CacheProperties::No)
        .build()
        .await?;
    let warm_pool = PoolProxy::builder(&connection)
        .path(pool_path(WARM_POOL))?
        .cache_properties(CacheProperties::No)
        .build()
        .await?;
    let bench = Bench {
        connection: connection.clone(),
        session,
        warm_pool: warm_pool.clone(),
        full: WARM * SIZES.len() as u64,
    };
    // A direct connection (Manager.OpenDirect) with a session of its own.
    let direct_connection = rdmad_client::connect_direct(&connection).await?;
    let direct_session = ManagerProxy::new(&direct_connection)
        .await?
        .open_session(Options::new())
        .await?;
    let direct = Bench {
        connection: direct_connection.clone(),
        session: SessionProxy::builder(&direct_connection)
            .path(direct_session)?
            .cache_properties(CacheProperties::No)
            .build()
            .await?,
        warm_pool,
        full: bench.full,
    };
    let direct_peer = zbus::fdo::PeerProxy::new(&direct_connection, BUS_NAME, MANAGER_PATH).await?;
    let filled = bench.wait_full().await?;
    println!(
        "warm set full ({} regions) {:.1} s after the daemon owned its name",
        bench.full,
        filled.as_secs_f64()
    );

    // The floors of a call: a bare method call answered by the bus daemon itself, and
    // one answered by rdmad's connection without any work (Peer.Ping: to rdmad and back
    // through the bus, two hops each way, as every rdmad call).
    let floors = Floors {
        bus: zbus::fdo::DBusProxy::new(&connection).await?,
        rdmad: zbus::fdo::PeerProxy::new(&connection, BUS_NAME, MANAGER_PATH).await?,
    };

    let mut results = Vec::new();
    for size in SIZES {
        let n = iterations_for(size, args.iterations);
        let mut series = Series {
            size,
            iterations: n,
            warm: Vec::new(),
            warm_alloc: Vec::new(),
            warm_free: Vec::new(),
            refill_wait: Vec::new(),
            settled_free: Vec::new(),
            cold: Vec::new(),
            raw: Vec::new(),
            fresh: Vec::new(),
            get_id: Vec::new(),
            ping: Vec::new(),
            direct_ping: Vec::new(),
            direct_alloc: Vec::new(),
            direct_free: Vec::new(),
        };
        let started = Instant::now();
        for i in 0..WARMUP + n {
            bench.wait_full().await?;
            let (get_id, ping) = floors.sample().await?;
            let (alloc, free) = bench.alloc_free(WARM_POOL, size).await?;
            let wait = bench.wait_full().await?;
            let start = Instant::now();
            direct_peer.ping().await?;
            let direct_ping = start.elapsed();
            let (direct_alloc, direct_free) = direct.alloc_free(WARM_POOL, size).await?;
            bench.wait_full().await?;
            if i >= WARMUP {
                series.warm.push(alloc + free);
                series.warm_alloc.push(alloc);
                series.warm_free.push(free);
                series.refill_wait.push(wait);
                series.get_id.push(get_id);
                series.ping.push(ping);
                series.direct_ping.push(direct_ping);
                series.direct_alloc.push(direct_alloc);
                series.direct_free.push(direct_free);
            }
        }
        // The same, but Free only once the replacement region is made: what Free costs
        // without the refill thread registering at the same time.
        for i in 0..WARMUP + n {
            bench.wait_full().await?;
            let (path, fd, _) = bench.allocate(WARM_POOL, size).await?;
            bench.wait_full().await?;
            let free = bench.free(path, fd).await?;
            if i >= WARMUP {
                series.settled_free.push(free);
            }
        }
        if args.cold {
            for i in 0..WARMUP + n {
                bench.wait_full().await?;
                let (alloc, free) = bench.alloc_free(COLD_POOL, size).await?;
                if i >= WARMUP {
                    series.cold.push(alloc + free);
                }
            }
        }
        series.raw = raw_series(pd.as_ref(), size, n)?;
        series.fresh = fresh_series(pd.as_ref(), size, n)?;
        eprintln!(
            "rdmad-bench: {} done in {:.1} s",
            size_name(size),
            started.elapsed().as_secs_f64()
        );
        results.push(series);
    }
    bench.session.close().await?;
    direct.session.close().await?;

    println!();
    println!("All times in µs, median (p90).");
    println!();
    let cold_head = if args.cold {
        " rdmad cold alloc+free |"
    } else {
        ""
    };
    println!(
        "| size | n | rdmad warm alloc+free |{cold_head} pre-touched register+deregister \
         | ÷ rdmad | fresh map+touch+register+deregister+unmap | ÷ rdmad |"
    );
    println!(
        "|---|---:|---:|{}---:|---:|---:|---:|",
        if args.cold { "---:|" } else { "" }
    );
    for s in &results {
        let warm = stats(&s.warm);
        let raw = stats(&s.raw);
        let fresh = stats(&s.fresh);
        let cold = if args.cold {
            format!(" {} |", cell(stats(&s.cold)))
        } else {
            String::new()
        };
        let per = |x: Stats| ratio(x.median.as_secs_f64() / warm.median.as_secs_f64());
        println!(
            "| {} | {} | {} |{cold} {} | {} | {} | {} |",
            size_name(s.size),
            s.iterations,
            cell(warm),
            cell(raw),
            per(raw),
            cell(fresh),
            per(fresh)
        );
    }
    println!();
    println!("rdmad warm, split (µs, median (p90)). refill: untimed wait after Free until the");
    println!("warm set was full again (polled every {POLL:?}, each poll a Get). settled: a");
    println!("separate series that waits for the refill between AllocateRegion and Free:");
    println!();
    println!(
        "| size | GetId | Peer.Ping | AllocateRegion | ÷ GetId | ÷ Ping | Free + close | ÷ GetId \
         | refill wait | Free + close, settled |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for s in &results {
        let (alloc, free) = (stats(&s.warm_alloc), stats(&s.warm_free));
        let (get_id, ping) = (stats(&s.get_id), stats(&s.ping));
        let per =
            |x: Stats, floor: Stats| ratio(x.median.as_secs_f64() / floor.median.as_secs_f64());
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            size_name(s.size),
            cell(get_id),
            cell(ping),
            cell(alloc),
            per(alloc, get_id),
            per(alloc, ping),
            cell(free),
            per(free, get_id),
            cell(stats(&s.refill_wait)),
            cell(stats(&s.settled_free))
        );
    }
    println!();
    println!("GetId: org.freedesktop.DBus.GetId, answered by the bus daemon; Peer.Ping: answered");
    println!("by rdmad's connection with no work. Both on the benchmark's connection, once each");
    println!("right before every warm iteration; ÷ columns are ratios of the medians.");
    println!();
    println!("The same warm calls on a direct connection (Manager.OpenDirect), right after each");
    println!("bus iteration, from the same warm set; GetId and the bus's alloc+free from the");
    println!("same iterations (µs, median (p90)):");
    println!();
    println!(
        "| size | GetId | Peer.Ping, direct | AllocateRegion, direct | ÷ GetId | Free + close, \
         direct | ÷ GetId | alloc+free, direct | alloc+free, bus | bus ÷ direct |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for s in &results {
        let get_id = stats(&s.get_id);
        let (alloc, free) = (stats(&s.direct_alloc), stats(&s.direct_free));
        let pairs: Vec<Duration> = s
            .direct_alloc
            .iter()
            .zip(&s.direct_free)
            .map(|(a, f)| *a + *f)
            .collect();
        let (pair, bus_pair) = (stats(&pairs), stats(&s.warm));
        let per = |x: Stats, y: Stats| ratio(x.median.as_secs_f64() / y.median.as_secs_f64());
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            size_name(s.size),
            cell(get_id),
            cell(stats(&s.direct_ping)),
            cell(alloc),
            per(alloc, get_id),
            cell(free),
            per(free, get_id),
            cell(pair),
            cell(bus_pair),
            per(bus_pair, pair)
        );
    }
    Ok(())
}
