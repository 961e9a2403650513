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

/// Opens a session, allocates `region_size` bytes from the `default` pool and creates a
/// queue pair on the first device with `qp_options`.
pub async fn setup(region_size: u64, qp_options: Options<'_>) -> Result<Side> {
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
    let (qp_path, ring_fd, doorbell, completions, info) =
        session.create_queue_pair(&device, qp_options).await?;
    let ring = QueuePairRing::new(ring_fd.into(), doorbell.into(), completions.into(), info)?;
    let qp = QueuePairProxy::builder(&connection)
        .path(qp_path.clone())?
        .build()
        .await?;
    Ok(Side {
        connection,
        device,
        region_path,
        region,
        buffer,
        qp_path,
        qp,
        ring,
    })
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
