//! What both two-process examples do first: a session, a region, a queue pair on the first
//! device, and the endpoint exchange over stdio (one JSON line each way).

// Each example uses part of it.
#![allow(dead_code)]

use std::io::Lines;
use std::os::fd::OwnedFd;

use rdmad_client::names::object_id;
use rdmad_client::proxy::{ManagerProxy, Options, QueuePairProxy, SessionProxy};
use rdmad_client::queue_pair::{QueuePairRing, Wait};
use rdmad_client::types::Endpoint;
use rdmad_client::RegionMapping;
use zbus::zvariant::OwnedObjectPath;

pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// One side of a connection, before it is connected.
pub struct Side {
    pub connection: zbus::Connection,
    pub device: String,
    pub region_path: OwnedObjectPath,
    /// The region's id, as work requests name it.
    pub region: u64,
    pub buffer: RegionMapping,
    pub qp_path: OwnedObjectPath,
    pub qp: QueuePairProxy<'static>,
    pub ring: QueuePairRing,
}

/// How the two sides find each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Meet {
    /// Endpoints exchanged as JSON lines over stdin and stdout.
    Stdio,
    /// `--connect ADDRESS:PORT`: connect by address to a `--listen` side (or any
    /// rdma_cm listener).
    Connect(String, u16),
    /// `--listen [ADDRESS:]PORT`: wait for one connection by address.
    Listen(String, u16),
}

impl Meet {
    /// Takes `--connect ADDRESS:PORT` or `--listen [ADDRESS:]PORT` out of `args`.
    pub fn from_args(args: &mut Vec<String>) -> Result<Meet> {
        let Some(at) = args
            .iter()
            .position(|a| a == "--connect" || a == "--listen")
        else {
            return Ok(Meet::Stdio);
        };
        let flag = args.remove(at);
        if at >= args.len() {
            return Err(format!("{flag} needs ADDRESS:PORT").into());
        }
        let value = args.remove(at);
        let (address, port) = match value.rsplit_once(':') {
            Some((a, p)) => (
                a.trim_start_matches('[').trim_end_matches(']').to_owned(),
                p,
            ),
            None => (String::new(), value.as_str()),
        };
        let port: u16 = port
            .parse()
            .map_err(|_| format!("{flag} {value}: {port:?} is not a port"))?;
        Ok(if flag == "--connect" {
            if address.is_empty() {
                return Err("--connect needs the listener's ADDRESS:PORT".into());
            }
            Meet::Connect(address, port)
        } else {
            Meet::Listen(address, port)
        })
    }
}

/// Opens a session, allocates `region_size` bytes from the `default` pool and creates a
/// queue pair on the first device with `qp_options` — or, with `Meet::Listen`, listens
/// and takes the queue pair `Accept` makes for the first connection.
pub async fn setup_meeting(region_size: u64, qp_options: Options<'_>, meet: &Meet) -> Result<Side> {
    let connection = rdmad_client::connect(None).await?;
    let manager = ManagerProxy::new(&connection).await?;
    let session = SessionProxy::builder(&connection)
        .path(manager.open_session(Options::new()).await?)?
        .build()
        .await?;
    let devices = manager.list_devices().await?;
    let device = devices
        .first()
        .ok_or("rdmad serves no device")?
        .name
        .clone();
    let (region_path, fd, size) = session
        .allocate_region("default", region_size, Options::new())
        .await?;
    let region = object_id(region_path.as_str()).ok_or("region id")?;
    let buffer = RegionMapping::map(OwnedFd::from(fd), size as usize, true)?;
    let (qp_path, ring_fd, doorbell, completions, info) = match meet {
        Meet::Listen(address, port) => {
            let (listener, on, port) = session.listen(address, *port, qp_options).await?;
            eprintln!("listening on {on}:{port}");
            let mut options = Options::new();
            options.insert("timeout_ms", zbus::zvariant::Value::from(600_000u32));
            let (qp, ring, doorbell, completions, info, peer) =
                session.accept(listener, options).await?;
            eprintln!("accepted a connection from {}", describe(&peer));
            session.stop_listening(listener).await?;
            (qp, ring, doorbell, completions, info)
        }
        _ => session.create_queue_pair(&device, qp_options).await?,
    };
    let ring = QueuePairRing::new(ring_fd.into(), doorbell.into(), completions.into(), info)?;
    let qp = QueuePairProxy::builder(&connection)
        .path(qp_path.clone())?
        .build()
        .await?;
    let side = Side {
        connection,
        device,
        region_path,
        region,
        buffer,
        qp_path,
        qp,
        ring,
    };
    if let Meet::Connect(address, port) = meet {
        let peer = side.qp.connect_to(address, *port, Options::new()).await?;
        eprintln!("connected to {}", describe(&peer));
    }
    Ok(side)
}

/// Opens a session, allocates `region_size` bytes from the `default` pool and creates a
/// queue pair on the first device with `qp_options`.
pub async fn setup(region_size: u64, qp_options: Options<'_>) -> Result<Side> {
    setup_meeting(region_size, qp_options, &Meet::Stdio).await
}

/// A connection by address as `Accept` and `ConnectTo` describe it: `ADDRESS:PORT (QPN n)`.
fn describe(c: &std::collections::HashMap<String, zbus::zvariant::OwnedValue>) -> String {
    use zbus::zvariant::Value;
    let text = |k: &str| match c.get(k).map(|v| &**v) {
        Some(Value::Str(s)) => s.to_string(),
        Some(Value::U16(n)) => n.to_string(),
        Some(Value::U32(n)) => n.to_string(),
        Some(other) => format!("{other:?}"),
        None => "?".to_owned(),
    };
    format!(
        "{}:{} (QPN {})",
        text("address"),
        text("port"),
        text("qp_num")
    )
}

impl Side {
    /// Prints this QP's endpoint on stdout, reads the peer's from the next line of
    /// `input`, and connects to it.
    pub async fn connect_over_stdio<B: std::io::BufRead>(
        &self,
        input: &mut Lines<B>,
    ) -> Result<Endpoint> {
        println!("{}", serde_json::to_string(&self.qp.endpoint().await?)?);
        let line = input
            .next()
            .ok_or("stdin closed before the peer's endpoint")??;
        let peer: Endpoint = serde_json::from_str(line.trim())?;
        self.qp.connect(&peer, Options::new()).await?;
        Ok(peer)
    }
}

/// The program's arguments without `--spin`, and how to wait for completions: with
/// `--spin`, busy-poll the ring (for up to 10 ms, then sleep); without, sleep at once.
pub fn args_and_wait() -> (Vec<String>, Wait) {
    let mut wait = Wait::Block;
    let args = std::env::args()
        .filter(|a| {
            let spin = a == "--spin";
            if spin {
                wait = Wait::Spin(std::time::Duration::from_millis(10));
            }
            !spin
        })
        .collect();
    (args, wait)
}

/// How the figures were made: the wait mode and the CPUs this process may run on.
pub fn conditions(wait: Wait) -> String {
    let cpus = std::thread::available_parallelism().map_or(0, std::num::NonZeroUsize::get);
    let mode = match wait {
        Wait::Block => "blocking".to_owned(),
        Wait::Spin(budget) => format!("busy-polling (up to {budget:?}, then blocking)"),
    };
    format!("{mode}, {cpus} CPUs")
}
