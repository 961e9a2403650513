//! `rdmad-bench ring`: the proxied data path against the device itself.
//!
//! ```text
//! rdmad-bench ring [--iterations N] [--wait spin|block|both] [--batches 1,8,32] [--size BYTES]
//!                  [--idle-qps N] [--idle-sessions N]
//! ```
//!
//! One client and the daemon's worker on `loopback0`: 64 B RDMA WRITEs (`--size` picks
//! another length, up to 1 MiB) from one QP into a region exported through its peer QP
//! (both in one session), in batches of 1, 8 and 32 (`--batches` picks others, up to 64),
//! every request signalled. For each batch size, in one run:
//!
//! - **device**: the same requests posted by this process to its own instance of the
//!   loopback provider (`post_send` of the whole batch, then `poll` until every completion
//!   is there) — the no-proxy floor, what the same work costs without rdmad;
//! - **rdmad, spin**: submitted to the QP's ring one `QueuePairRing::submit` at a time,
//!   completions taken by busy-polling the ring
//!   (`QueuePairRing::wait` in its spinning mode);
//! - **rdmad, block**: the same, waiting on the completion channel (`poll(2)`) as soon as no
//!   completion is there.
//!
//! Each sample is one batch, from the first submission to the last completion. `--iterations`
//! batches per cell (default 20,000), after 200 untimed ones. With `--size` above 64 B a
//! second table gives each cell's bandwidth next to this process's own `memcpy` of the same
//! length between two page-aligned buffers, measured just before that batch size's cells.
//!
//! Then the session creates `--idle-qps` more QPs (default 1,000; 0 skips this) on the same
//! worker (the daemon runs one), never used, and the batch-1 cells run again: what idle
//! QPs cost an active one. Then the first QP of each idle pair gets a SEND its peer never
//! posts a receive for (retried for ever: the QPs are *parked*, with a request in flight
//! that never completes, as a hostile tenant's may be), and the batch-1 cells run once
//! more. Last, `--idle-sessions` sessions (default 1,000; 0 skips this)
//! are opened and left empty: the daemon's resident memory per idle session.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmad::memory::SharedMemory;
use rdmad::provider::{
    loopback, Access, CompletionQueue, Device, MemoryRegion, QpInit, QueuePair, RemoteEndpoint,
    RtrAttributes, RtsAttributes, SendOp, SendWr, Sge, WcStatus, WorkCompletion,
};
use rdmad_client::names::object_id;
use rdmad_client::proxy::{ManagerProxy, Options, QueuePairProxy, RegionProxy, SessionProxy};
use rdmad_client::queue_pair::{QueuePairRing, Wait};
use rdmad_client::ring::{Opcode, RegionSge, Status, Submission};
use rdmad_tests::bus::PrivateBus;
use rdmad_tests::daemon::{Daemon, DaemonOptions};
use zbus::zvariant::{OwnedObjectPath, Value};

use crate::{machine, percentile, us, Result};

const BATCHES: [u32; 3] = [1, 8, 32];
/// The largest batch: the queues' depth.
const MAX_BATCH: u32 = DEPTH;
/// The default length of a write.
const LEN: u32 = 64;
/// The longest write `--size` allows.
const MAX_LEN: u32 = 1 << 20;
const DEPTH: u32 = 64;
const WARMUP: u32 = 200;
/// How long the spinning client spins before it sleeps (far more than any sample here).
const SPIN: Duration = Duration::from_millis(10);
/// No completion within this is an error, not a slow sample.
const TIMEOUT: Duration = Duration::from_secs(10);

const USAGE: &str =
    "usage: rdmad-bench ring [--iterations N] [--wait spin|block|both] [--batches 1,8,32] \
     [--size BYTES] [--idle-qps N] [--idle-sessions N]";

/// One worker, so that the idle QPs share it with the measured one; room for two regions of
/// the longest write.
const CONFIG: &str = "[daemon]\nlog_level = \"warn\"\nworkers = 1\n\n[[pool]]\n\
                      name = \"bench\"\ncapacity = \"4MiB\"\n\
                      size_classes = [\"4KiB\", \"64KiB\", \"1MiB\"]\n\n\
                      [quota.default]\nregistered_bytes = \"3MiB\"\nqps = 4096\n\
                      sessions = 4096\n";
const MAX_IDLE: u32 = 4000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Spin,
    Block,
}

struct Args {
    iterations: u32,
    modes: Vec<Mode>,
    batches: Vec<u32>,
    /// The length of every write.
    size: u32,
    idle_qps: u32,
    idle_sessions: u32,
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args> {
    let mut args = Args {
        iterations: 20_000,
        modes: vec![Mode::Spin, Mode::Block],
        batches: BATCHES.to_vec(),
        size: LEN,
        idle_qps: 1000,
        idle_sessions: 1000,
    };
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--iterations" => {
                let n: u32 = value("--iterations")?
                    .parse()
                    .map_err(|e| format!("--iterations: {e}\n{USAGE}"))?;
                if n == 0 {
                    return Err(format!("--iterations must be at least 1\n{USAGE}").into());
                }
                args.iterations = n;
            }
            "--wait" => {
                args.modes = match value("--wait")?.as_str() {
                    "spin" => vec![Mode::Spin],
                    "block" => vec![Mode::Block],
                    "both" => vec![Mode::Spin, Mode::Block],
                    other => return Err(format!("--wait: unknown mode {other:?}\n{USAGE}").into()),
                }
            }
            "--batches" => {
                let list = value("--batches")?;
                args.batches = list
                    .split(',')
                    .map(|b| match b.trim().parse::<u32>() {
                        Ok(n) if (1..=MAX_BATCH).contains(&n) => Ok(n),
                        _ => Err(format!(
                            "--batches: {b:?} is not a batch size from 1 to {MAX_BATCH} \
                             (a comma-separated list, e.g. 1,8,32)\n{USAGE}"
                        )),
                    })
                    .collect::<std::result::Result<_, _>>()?;
            }
            "--size" => {
                let v = value("--size")?;
                args.size = match v.parse::<u32>() {
                    Ok(n) if (1..=MAX_LEN).contains(&n) => n,
                    _ => {
                        return Err(format!(
                            "--size: {v:?} is not a length in bytes from 1 to {MAX_LEN}\n{USAGE}"
                        )
                        .into())
                    }
                };
            }
            "--idle-qps" => {
                let n: u32 = value("--idle-qps")?
                    .parse()
                    .map_err(|e| format!("--idle-qps: {e}\n{USAGE}"))?;
                if n > MAX_IDLE {
                    return Err(format!("--idle-qps: at most {MAX_IDLE}\n{USAGE}").into());
                }
                args.idle_qps = n;
            }
            "--idle-sessions" => {
                let n: u32 = value("--idle-sessions")?
                    .parse()
                    .map_err(|e| format!("--idle-sessions: {e}\n{USAGE}"))?;
                if n > MAX_IDLE {
                    return Err(format!("--idle-sessions: at most {MAX_IDLE}\n{USAGE}").into());
                }
                args.idle_sessions = n;
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

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Spin => "spin",
        Mode::Block => "block",
    }
}

/// One cell: the time of every batch, and of all of them together.
struct Cell {
    samples: Vec<Duration>,
    total: Duration,
    batch: u32,
}

impl Cell {
    fn new(batch: u32, n: u32) -> Cell {
        Cell {
            samples: Vec::with_capacity(n as usize),
            total: Duration::ZERO,
            batch,
        }
    }

    fn push(&mut self, sample: Duration) {
        self.samples.push(sample);
        self.total += sample;
    }

    fn sorted(&self) -> Vec<Duration> {
        let mut s = self.samples.clone();
        s.sort_unstable();
        s
    }

    fn median(&self) -> Duration {
        percentile(&self.sorted(), 0.5)
    }

    fn p99(&self) -> Duration {
        percentile(&self.sorted(), 0.99)
    }

    /// Work requests per second, in millions.
    fn mwrs(&self) -> f64 {
        f64::from(self.batch) * self.samples.len() as f64 / self.total.as_secs_f64() / 1e6
    }

    fn latency(&self) -> String {
        format!("{} ({})", us(self.median()), us(self.p99()))
    }
}

/// The no-proxy floor: this process's own loopback device, two QPs connected to each other,
/// a source MR and a destination MR the peer may write.
struct Floor {
    // Field order is drop order: QPs before CQs before MRs.
    qp: Arc<dyn QueuePair>,
    _peer: Arc<dyn QueuePair>,
    cq: Arc<dyn CompletionQueue>,
    _peer_cq: Arc<dyn CompletionQueue>,
    src: Arc<dyn MemoryRegion>,
    dst: Arc<dyn MemoryRegion>,
    len: u32,
}

/// The length of the regions that hold writes of `len` bytes: whole pages.
fn region_len(len: u32) -> u64 {
    u64::from(len).next_multiple_of(4096)
}

impl Floor {
    fn new(len: u32) -> Result<Floor> {
        let device = loopback::LoopbackDevice::new(loopback::DEFAULT_NAME);
        let pd = device.alloc_pd()?;
        let memory = |name| -> Result<Arc<SharedMemory>> {
            Ok(Arc::new(SharedMemory::create(
                name,
                region_len(len) as usize,
            )?))
        };
        let src = pd.register(memory(c"rdmad-bench-src")?, Access::LOCAL_WRITE)?;
        let dst = pd.register(
            memory(c"rdmad-bench-dst")?,
            Access::LOCAL_WRITE.union(Access::REMOTE_WRITE),
        )?;
        let (cq, peer_cq) = (pd.create_cq(DEPTH)?, pd.create_cq(DEPTH)?);
        let qp_on = |cq: &Arc<dyn CompletionQueue>| {
            pd.create_qp(QpInit {
                send_cq: Arc::clone(cq),
                recv_cq: Arc::clone(cq),
                max_send_wr: DEPTH,
                max_recv_wr: DEPTH,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            })
        };
        let (qp, peer) = (qp_on(&cq)?, qp_on(&peer_cq)?);
        let port = device.query_port(1)?;
        let gid = device
            .gid_table(1)?
            .into_iter()
            .find(|g| g.is_ipv4_mapped())
            .ok_or("the loopback device has no IPv4-mapped GID")?;
        for (me, other) in [(&qp, &peer), (&peer, &qp)] {
            me.to_init(1, Access::LOCAL_WRITE.union(Access::REMOTE_WRITE))?;
            let remote = RemoteEndpoint {
                gid: gid.gid,
                qp_num: other.qp_num(),
                psn: 0,
                lid: port.lid,
            };
            me.to_rtr(
                &remote,
                &RtrAttributes {
                    port: 1,
                    sgid_index: gid.index,
                    path_mtu: port.active_mtu,
                    max_dest_rd_atomic: 1,
                    min_rnr_timer: 12,
                },
            )?;
            me.to_rts(&RtsAttributes {
                psn: 0,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                max_rd_atomic: 1,
            })?;
        }
        Ok(Floor {
            qp,
            _peer: peer,
            cq,
            _peer_cq: peer_cq,
            src,
            dst,
            len,
        })
    }

    fn series(&self, batch: u32, n: u32) -> Result<Cell> {
        let wrs: Vec<SendWr> = (0..batch)
            .map(|k| SendWr {
                wr_id: u64::from(k),
                op: SendOp::Write {
                    remote_addr: self.dst.addr(),
                    rkey: self.dst.rkey(),
                    imm: None,
                },
                sges: rdmad_client::smallvec::smallvec![Sge {
                    addr: self.src.addr(),
                    length: self.len,
                    lkey: self.src.lkey(),
                }],
                signaled: true,
                inline: false,
            })
            .collect();
        let mut wcs: Vec<WorkCompletion> = Vec::with_capacity(DEPTH as usize);
        let mut cell = Cell::new(batch, n);
        for i in 0..WARMUP + n {
            let start = Instant::now();
            self.qp.post_send(&wrs).map_err(|e| e.error)?;
            let mut got = 0;
            while got < batch {
                wcs.clear();
                self.cq.poll(&mut wcs, DEPTH as usize)?;
                if let Some(wc) = wcs.iter().find(|wc| wc.status != WcStatus::Success) {
                    return Err(format!("device: write {}: {:?}", wc.wr_id, wc.status).into());
                }
                got += wcs.len() as u32;
                if start.elapsed() > TIMEOUT {
                    return Err(format!("device: no completion within {TIMEOUT:?}").into());
                }
            }
            if i >= WARMUP {
                cell.push(start.elapsed());
            }
        }
        Ok(cell)
    }
}

/// The proxied path: a session of rdmad on a private bus, two QPs connected to each other,
/// the destination region exported through the peer QP.
struct Proxied {
    session: SessionProxy<'static>,
    /// QPs made only to sit idle (their rings and descriptors held).
    idle: Vec<QueuePairRing>,
    ring: QueuePairRing,
    src: u64,
    addr: u64,
    rkey: u32,
    len: u32,
    // Held until the end: the daemon tears the session down when its connection goes.
    _connection: zbus::Connection,
}

impl Proxied {
    async fn new(connection: zbus::Connection, len: u32) -> Result<Proxied> {
        let manager = ManagerProxy::new(&connection).await?;
        let session = SessionProxy::builder(&connection)
            .path(manager.open_session(Options::new()).await?)?
            .build()
            .await?;
        let (src_path, _src_fd, _) = session
            .allocate_region("bench", region_len(len), Options::new())
            .await?;
        let (dst_path, _dst_fd, _) = session
            .allocate_region("bench", region_len(len), Options::new())
            .await?;
        let mut rings = Vec::new();
        let mut qps = Vec::new();
        for _ in 0..2 {
            let mut options = Options::new();
            options.insert("send_depth", Value::from(DEPTH));
            let (path, ring, doorbell, completions, info) = session
                .create_queue_pair(loopback::DEFAULT_NAME, options)
                .await?;
            rings.push(QueuePairRing::new(
                ring.into(),
                doorbell.into(),
                completions.into(),
                info,
            )?);
            qps.push((
                path.clone(),
                QueuePairProxy::builder(&connection)
                    .path(path)?
                    .build()
                    .await?,
            ));
        }
        qps[0]
            .1
            .connect(&qps[1].1.endpoint().await?, Options::new())
            .await?;
        qps[1]
            .1
            .connect(&qps[0].1.endpoint().await?, Options::new())
            .await?;
        let mut options = Options::new();
        options.insert("access", Value::from("w"));
        let (addr, rkey, _, _) = RegionProxy::builder(&connection)
            .path(dst_path)?
            .build()
            .await?
            .export_remote(&qps[1].0.as_ref(), options)
            .await?;
        Ok(Proxied {
            session,
            idle: Vec::new(),
            ring: rings.swap_remove(0),
            src: object_id(src_path.as_str()).ok_or("the region's path has no id")?,
            addr,
            rkey,
            len,
            _connection: connection,
        })
    }

    /// Creates `n` more QPs in the session, connected in pairs to each other, never used.
    async fn add_idle(&mut self, n: u32) -> Result<()> {
        let mut unpaired: Option<QueuePairProxy<'static>> = None;
        for _ in 0..n {
            let (path, ring, doorbell, completions, info) = self
                .session
                .create_queue_pair(loopback::DEFAULT_NAME, Options::new())
                .await?;
            self.idle.push(QueuePairRing::new(
                ring.into(),
                doorbell.into(),
                completions.into(),
                info,
            )?);
            let qp = QueuePairProxy::builder(self.session.inner().connection())
                .path(path)?
                .build()
                .await?;
            match unpaired.take() {
                None => unpaired = Some(qp),
                Some(peer) => {
                    qp.connect(&peer.endpoint().await?, Options::new()).await?;
                    peer.connect(&qp.endpoint().await?, Options::new()).await?;
                }
            }
        }
        Ok(())
    }

    /// Posts a SEND on the first QP of each pair of idle ones, which its peer never posts a
    /// receive for: it is retried for ever, and never completes.
    fn park_idle(&mut self) -> Result<()> {
        let sge = RegionSge {
            region: self.src,
            offset: 0,
            length: 64,
        };
        for ring in self.idle.iter_mut().step_by(2) {
            if ring
                .submit(&Submission::new(Opcode::Send, 0, sge))?
                .is_err()
            {
                return Err("an idle QP's ring is full".into());
            }
        }
        Ok(())
    }

    /// Opens `n` sessions on the benchmark's connection and leaves them empty; they close
    /// with it.
    async fn open_idle_sessions(&self, n: u32) -> Result<Vec<OwnedObjectPath>> {
        let manager = ManagerProxy::new(self.session.inner().connection()).await?;
        let mut paths = Vec::with_capacity(n as usize);
        for _ in 0..n {
            paths.push(manager.open_session(Options::new()).await?);
        }
        Ok(paths)
    }

    fn series(&mut self, batch: u32, n: u32, mode: Mode) -> Result<Cell> {
        let write = |wr_id| Submission {
            remote_addr: self.addr,
            rkey: self.rkey,
            ..Submission::new(
                Opcode::Write,
                wr_id,
                RegionSge {
                    region: self.src,
                    offset: 0,
                    length: self.len,
                },
            )
        };
        let wait = match mode {
            Mode::Spin => Wait::Spin(SPIN),
            Mode::Block => Wait::Block,
        };
        let batch_of: Vec<Submission> = (0..batch).map(|k| write(u64::from(k))).collect();
        let mut cell = Cell::new(batch, n);
        for i in 0..WARMUP + n {
            let start = Instant::now();
            for s in &batch_of {
                self.ring
                    .submit(s)?
                    .map_err(|_| "the submission ring is full")?;
            }
            for _ in 0..batch {
                let c = self
                    .ring
                    .wait_with(wait, TIMEOUT)?
                    .ok_or_else(|| format!("rdmad: no completion within {TIMEOUT:?}"))?;
                if c.status != Status::Success {
                    return Err(format!("rdmad: write {}: {:?}", c.wr_id, c.status).into());
                }
            }
            if i >= WARMUP {
                cell.push(start.elapsed());
            }
        }
        Ok(cell)
    }
}

/// Runs the benchmark with the arguments after `ring`.
pub async fn run(args: impl Iterator<Item = String>) -> Result<()> {
    let args = parse_args(args)?;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    println!("# rdmad-bench ring");
    println!(
        "{} B RDMA WRITEs on loopback0, every one signalled; {} batches per cell after \
         {WARMUP} untimed",
        args.size, args.iterations
    );
    println!("command: {command}");
    println!("machine: {}", machine());

    let bus = PrivateBus::start();
    let daemon = Daemon::start(
        &bus,
        DaemonOptions {
            provider: "loopback",
            config: CONFIG.into(),
            ..DaemonOptions::default()
        },
    )
    .await;
    let mut proxied = Proxied::new(bus.connect().await, args.size).await?;
    let floor = Floor::new(args.size)?;
    let mut copies = (args.size > LEN).then(|| Copies::new(args.size));

    struct Row {
        batch: u32,
        floor: Cell,
        rdmad: Vec<(Mode, Cell)>,
        /// This process's memcpy of the same length just before, bytes per second.
        memcpy: Option<f64>,
    }
    let mut rows = Vec::new();
    for &batch in &args.batches {
        let memcpy = copies
            .as_mut()
            .map(|c| c.rate(u64::from(batch) * u64::from(args.iterations)));
        let floor = floor.series(batch, args.iterations)?;
        let mut rdmad = Vec::new();
        for &mode in &args.modes {
            rdmad.push((mode, proxied.series(batch, args.iterations, mode)?));
        }
        rows.push(Row {
            batch,
            floor,
            rdmad,
            memcpy,
        });
    }
    let mut with_idle = Vec::new();
    let mut with_parked = Vec::new();
    let mut idle_cost = None;
    if args.idle_qps > 0 {
        let pid = daemon.child.id().ok_or("rdmad exited")?;
        let before = Usage::of(pid)?;
        proxied.add_idle(args.idle_qps).await?;
        for &mode in &args.modes {
            with_idle.push((mode, proxied.series(1, args.iterations, mode)?));
        }
        // Nothing moves now: the workers stop spinning after their spin budget and sleep.
        std::thread::sleep(Duration::from_secs(1));
        let quiet = Usage::of(pid)?;
        std::thread::sleep(IDLE_WINDOW);
        let after = Usage::of(pid)?;
        idle_cost = Some((before, quiet, after));
        proxied.park_idle()?;
        for &mode in &args.modes {
            with_parked.push((mode, proxied.series(1, args.iterations, mode)?));
        }
    }
    let mut session_cost = None;
    if args.idle_sessions > 0 {
        let pid = daemon.child.id().ok_or("rdmad exited")?;
        let before = Usage::of(pid)?;
        let sessions = proxied.open_idle_sessions(args.idle_sessions).await?;
        std::thread::sleep(Duration::from_secs(1));
        let after = Usage::of(pid)?;
        session_cost = Some((before, after));
        drop(sessions);
    }
    drop(proxied);
    drop(daemon);

    println!();
    println!("Latency: first submission to last completion of a batch, µs, median (p99).");
    println!("WR/s: work requests per second over all the cell's batches, millions.");
    println!("added: rdmad's median minus the device's.");
    println!();
    print_head(
        &["batch", "device", "device M WR/s"],
        &args.modes,
        &["M WR/s", "added"],
    );
    for row in &rows {
        let mut line = format!(
            "| {} | {} | {:.2} |",
            row.batch,
            row.floor.latency(),
            row.floor.mwrs()
        );
        for (_, cell) in &row.rdmad {
            let added = cell.median().as_secs_f64() - row.floor.median().as_secs_f64();
            line.push_str(&format!(
                " {} | {:.2} | {:.2} |",
                cell.latency(),
                cell.mwrs(),
                added * 1e6
            ));
        }
        println!("{line}");
    }
    if copies.is_some() {
        println!();
        println!(
            "Bandwidth, GB/s (÷ this process's memcpy of {} B between page-aligned buffers, \
             measured before the batch size's cells):",
            args.size
        );
        println!();
        print_head(&["batch", "memcpy", "device"], &args.modes, &[]);
        for row in &rows {
            let memcpy = row.memcpy.unwrap_or(f64::NAN);
            let gbs = |cell: &Cell| cell.mwrs() * 1e6 * f64::from(args.size);
            let mut line = format!(
                "| {} | {:.1} | {:.1} ({:.2}) |",
                row.batch,
                memcpy / 1e9,
                gbs(&row.floor) / 1e9,
                gbs(&row.floor) / memcpy
            );
            for (_, cell) in &row.rdmad {
                line.push_str(&format!(
                    " {:.1} ({:.2}) |",
                    gbs(cell) / 1e9,
                    gbs(cell) / memcpy
                ));
            }
            println!("{line}");
        }
    }
    if !with_idle.is_empty() {
        println!();
        println!(
            "Batch 1 again with {} idle QPs on the same worker, µs, median (p99):",
            args.idle_qps
        );
        println!();
        println!("| wait | alone | with idle QPs | ratio | with them parked | ratio |");
        println!("|---|---:|---:|---:|---:|---:|");
        for (((mode, idle), (_, parked)), (_, alone)) in
            with_idle.iter().zip(&with_parked).zip(&rows[0].rdmad)
        {
            let ratio = |c: &Cell| c.median().as_secs_f64() / alone.median().as_secs_f64();
            println!(
                "| {} | {} | {} | {:.2} | {} | {:.2} |",
                mode_name(*mode),
                alone.latency(),
                idle.latency(),
                ratio(idle),
                parked.latency(),
                ratio(parked)
            );
        }
    }
    if let Some((before, quiet, after)) = idle_cost {
        let cpu = (after.cpu - quiet.cpu).as_secs_f64() / IDLE_WINDOW.as_secs_f64();
        println!();
        println!(
            "Idle: rdmad with {} more QPs (connected in pairs, none used) over {} s: {:.2} % of \
             a core; its resident memory grew by {} KiB ({:.1} KiB per QP, {} KiB of it \
             shared memory: the rings).",
            args.idle_qps,
            IDLE_WINDOW.as_secs(),
            cpu * 100.0,
            quiet.rss_kib.saturating_sub(before.rss_kib),
            quiet.rss_kib.saturating_sub(before.rss_kib) as f64 / f64::from(args.idle_qps),
            quiet.shmem_kib.saturating_sub(before.shmem_kib),
        );
    }
    if let Some((before, after)) = session_cost {
        let grew = after.rss_kib.saturating_sub(before.rss_kib);
        println!();
        println!(
            "Idle sessions: rdmad with {} more sessions (opened, nothing in them): its resident \
             memory grew by {} KiB ({:.1} KiB per session).",
            args.idle_sessions,
            grew,
            grew as f64 / f64::from(args.idle_sessions),
        );
    }
    Ok(())
}

/// Prints the head of a table of right-aligned columns: `fixed`, then for each wait mode a
/// column `rdmad MODE` followed by `per_mode`.
fn print_head(fixed: &[&str], modes: &[Mode], per_mode: &[&str]) {
    let mut columns: Vec<String> = fixed.iter().map(|c| (*c).to_owned()).collect();
    for mode in modes {
        columns.push(format!("rdmad {}", mode_name(*mode)));
        columns.extend(per_mode.iter().map(|c| (*c).to_owned()));
    }
    println!("| {} |", columns.join(" | "));
    println!("|{}", "---:|".repeat(columns.len()));
}

/// The raw alternative to a long write: this process copying the same length between two
/// page-aligned buffers of its own (page-aligned as regions are: see `bandwidth`'s note on
/// the CPU's string copy and addresses just past a page).
struct Copies {
    from: Vec<u8>,
    to: Vec<u8>,
    len: usize,
}

impl Copies {
    const PAGE: usize = 4096;

    fn new(len: u32) -> Copies {
        let len = len as usize;
        Copies {
            from: vec![1; len + Self::PAGE],
            to: vec![0; len + Self::PAGE],
            len,
        }
    }

    /// Bytes per second over `n` copies.
    fn rate(&mut self, n: u64) -> f64 {
        let (from_at, to_at) = (
            self.from.as_ptr().align_offset(Self::PAGE),
            self.to.as_ptr().align_offset(Self::PAGE),
        );
        let from = &self.from[from_at..from_at + self.len];
        let to = &mut self.to[to_at..to_at + self.len];
        let start = Instant::now();
        for _ in 0..n {
            to.copy_from_slice(std::hint::black_box(from));
            std::hint::black_box(&mut *to);
        }
        (n * self.len as u64) as f64 / start.elapsed().as_secs_f64()
    }
}

/// How long the idle daemon's CPU time is measured.
const IDLE_WINDOW: Duration = Duration::from_secs(10);

/// A process's CPU time and resident memory.
struct Usage {
    cpu: Duration,
    rss_kib: u64,
    shmem_kib: u64,
}

impl Usage {
    fn of(pid: u32) -> Result<Usage> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        // Fields after the command name (which may hold spaces), from field 3 on.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .ok_or("malformed /proc/PID/stat")?
            .1
            .split_whitespace()
            .collect();
        let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
        let hz =
            nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.ok_or("no CLK_TCK")? as u64;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let kib = |key: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        Ok(Usage {
            cpu: Duration::from_secs_f64(ticks as f64 / hz as f64),
            rss_kib: kib("VmRSS:"),
            shmem_kib: kib("RssShmem:"),
        })
    }
}
