//! Queue pairs the daemon creates for sessions: an RC QP and its CQ on the device's PD, the
//! ring memfd and wake-up pipes of the data path, the endpoint a peer needs, and the connection
//! to that peer. Teardown releases windows before the QP and the QP before its CQ.

use std::collections::BTreeMap;
use std::net::Ipv6Addr;
use std::sync::{Arc, Mutex};

use rdmad_client::ring::Layout;

use super::datapath::rights::SessionRights;
use super::datapath::wakeup::WakePipe;
use super::{DeviceEntry, EngineError};
use crate::memory::SharedMemory;
use crate::provider::{
    Access, CompletionQueue, Device, GidEntry, GidType, MemoryRegion, MemoryWindow, QpInit,
    QpState, QueuePair, RemoteEndpoint, RtrAttributes, RtsAttributes,
};

pub use super::ids::{ExportId, QpId};

/// What a QP's worker has done with its client's requests (shown by `rdmactl qp`).
#[derive(Debug, Default)]
pub struct QpCounters {
    /// Requests posted to the device.
    pub posted: std::sync::atomic::AtomicU64,
    /// Requests the device completed successfully.
    pub completed: std::sync::atomic::AtomicU64,
    /// Requests the device completed with an error.
    pub failed: std::sync::atomic::AtomicU64,
    /// Requests rdmad refused before the device (malformed, region denied, queue full).
    pub refused: std::sync::atomic::AtomicU64,
}

/// A region made reachable by a peer: a type-2 window bound over it through one QP.
#[derive(Debug)]
pub struct Export {
    pub region: super::RegionId,
    // Field order is drop order: the window before the registration it is bound over
    // (rxe refuses to deregister an MR with a bound window).
    pub window: Arc<dyn MemoryWindow>,
    /// The region's registration, kept as long as the window is.
    pub mr: Arc<dyn MemoryRegion>,
}

/// The largest `max_inline` a client may ask for: small sends are what inline data is for
/// (the device copies them while the request is posted), and a device may take less (its
/// refusal then fails `CreateQueuePair`).
pub const MAX_INLINE: u32 = 256;

/// What a client may ask of a new QP (`CreateQueuePair` options).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpOptions {
    pub send_depth: u32,
    pub recv_depth: u32,
    pub max_sge: u32,
    pub max_inline: u32,
    /// A protection domain of the session's own, by the number the session calls it
    /// (`None`: the daemon's protection domain of the device).
    pub domain: Option<u32>,
}

impl Default for QpOptions {
    fn default() -> Self {
        QpOptions {
            send_depth: 128,
            recv_depth: 128,
            max_sge: 4,
            max_inline: 0,
            domain: None,
        }
    }
}

impl QpOptions {
    /// Checks the options against the device's limits and the ring format.
    pub fn check(&self, dev: &dyn Device) -> Result<(), EngineError> {
        let attrs = dev.attributes()?;
        let invalid = |what: &str| Err(EngineError::InvalidArgument(what.to_owned()));
        for (name, depth) in [
            ("send_depth", self.send_depth),
            ("recv_depth", self.recv_depth),
        ] {
            if depth == 0 || depth > attrs.max_qp_wr.min(16384) {
                return invalid(&format!(
                    "{name} {depth} is out of range: 1 to {} on {}",
                    attrs.max_qp_wr.min(16384),
                    dev.name()
                ));
            }
        }
        let max_sge = (rdmad_client::ring::MAX_SGE as u32).min(attrs.max_sge);
        if self.max_sge == 0 || self.max_sge > max_sge {
            return invalid(&format!(
                "max_sge {} is out of range: 1 to {max_sge}",
                self.max_sge
            ));
        }
        if self.max_inline > MAX_INLINE {
            return invalid(&format!(
                "max_inline {} is out of range: 0 to {MAX_INLINE}",
                self.max_inline
            ));
        }
        Ok(())
    }
}

/// What a peer needs to connect to this QP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalEndpoint {
    pub gid: Ipv6Addr,
    pub gid_index: u32,
    pub qp_num: u32,
    pub psn: u32,
    pub mtu: u32,
    pub lid: u16,
    pub port: u8,
}

/// What a client may choose of its own end when it connects (`Connect` options): the
/// PSN its sends start from and the GID index they leave from, when it told its peer
/// others than [`LocalEndpoint`]'s (a verbs program picks its own). Checked by
/// `Engine::connect_qp`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LocalChoice {
    pub psn: Option<u32>,
    pub gid_index: Option<u32>,
    /// Stop at RTR (receives only) until [`QueuePairRecord::ready`] moves the QP to RTS,
    /// as a verbs program that moves its QP in two steps does.
    pub receive_only: bool,
}

/// A queue pair owned by a session.
#[derive(Debug)]
pub struct QueuePairRecord {
    pub session: super::SessionId,
    /// What the session's queue pairs may touch: the worker reads it for every batch.
    pub rights: Arc<SessionRights>,
    pub owner_uid: u32,
    pub device: String,
    pub options: QpOptions,
    /// The session's own domain it is in (its number and id), if not the daemon's:
    /// its requests use the session's registrations in that domain.
    pub domain: Option<(u32, super::registry::DomainId)>,
    // Field order is drop order: windows bound through the QP, then the QP (rxe blocks
    // destroying a QP with a valid type-2 window), then its CQ.
    /// Memory windows bound through this QP for peers, by export id.
    pub exports: Mutex<BTreeMap<ExportId, Export>>,
    /// The rdma_cm connection the QP was connected through (`ConnectTo`, `Accept`):
    /// dropped before the QP, which disconnects it.
    pub link: Mutex<Option<super::connections::CmLink>>,
    /// A `ConnectTo` is under way.
    pub connecting: std::sync::atomic::AtomicBool,
    pub qp: Arc<dyn QueuePair>,
    pub cq: Arc<dyn CompletionQueue>,
    /// Submission and completion rings (see `rdmad_client::ring`).
    pub ring: Arc<SharedMemory>,
    pub layout: Layout,
    /// Written by the client after submitting (when the worker asked for wake-ups).
    pub doorbell: WakePipe,
    /// Written by the daemon after delivering completions.
    pub completion_event: WakePipe,
    pub local: LocalEndpoint,
    /// The port's largest message: longer requests are refused before the device.
    pub max_message: u64,
    pub remote: Mutex<Option<RemoteEndpoint>>,
    pub counters: QpCounters,
    /// The data-path worker serving the QP (an index into the engine's), once it is.
    pub worker: std::sync::OnceLock<usize>,
}

/// The GID QPs of this device use: the pinned index, else the RoCE v2 IPv4-mapped GID,
/// else any RoCE v2 GID, else the first.
pub fn select_gid(entry: &DeviceEntry) -> Result<GidEntry, EngineError> {
    let gids = entry.device.gid_table(entry.port)?;
    let pick = match entry.gid_index {
        Some(index) => gids.iter().find(|g| g.index == index).ok_or_else(|| {
            EngineError::DeviceUnusable(format!(
                "{}: gid_index {index} is configured, but port {} has no such GID",
                entry.device.name(),
                entry.port
            ))
        })?,
        None => gids
            .iter()
            .find(|g| g.gid_type == GidType::RoceV2 && g.is_ipv4_mapped())
            .or_else(|| gids.iter().find(|g| g.gid_type == GidType::RoceV2))
            .or_else(|| gids.first())
            .ok_or_else(|| {
                EngineError::DeviceUnusable(format!(
                    "{} port {} has no GID: is its network interface up?",
                    entry.device.name(),
                    entry.port
                ))
            })?,
    };
    Ok(pick.clone())
}

/// A starting packet sequence number from the OS random generator (24 bits).
fn random_psn() -> Result<u32, EngineError> {
    let mut b = [0u8; 4];
    getrandom::fill(&mut b)?;
    Ok(u32::from_le_bytes(b) & 0x00ff_ffff)
}

/// Creates the provider objects and the ring of a new QP (RESET state), in the
/// session's domain `domain` (number, id, protection domain) or the device's own PD.
pub fn create(
    entry: &DeviceEntry,
    domain: Option<(
        u32,
        super::registry::DomainId,
        Arc<dyn crate::provider::ProtectionDomain>,
    )>,
    session: super::SessionId,
    owner_uid: u32,
    options: QpOptions,
    rights: Arc<SessionRights>,
) -> Result<QueuePairRecord, EngineError> {
    options.check(entry.device.as_ref())?;
    let gid = select_gid(entry)?;
    let port = entry.device.query_port(entry.port)?;
    let pd = domain.as_ref().map_or(&entry.pd, |(_, _, pd)| pd);
    let cq = pd.create_cq(options.send_depth + options.recv_depth)?;
    let qp = pd.create_qp(QpInit {
        send_cq: Arc::clone(&cq),
        recv_cq: Arc::clone(&cq),
        max_send_wr: options.send_depth,
        max_recv_wr: options.recv_depth,
        max_send_sge: options.max_sge,
        max_recv_sge: options.max_sge,
        max_inline_data: options.max_inline,
    })?;
    let layout = Layout::new(
        options.send_depth + options.recv_depth,
        options.send_depth + options.recv_depth,
    )
    .ok_or_else(|| EngineError::InvalidArgument("queue depths too large for a ring".into()))?;
    let ring = new_ring(&layout)?;
    let local = LocalEndpoint {
        gid: gid.gid,
        gid_index: gid.index,
        qp_num: qp.qp_num(),
        psn: random_psn()?,
        mtu: port.active_mtu,
        lid: port.lid,
        port: entry.port,
    };
    Ok(QueuePairRecord {
        session,
        rights,
        owner_uid,
        device: entry.device.name().to_owned(),
        options,
        domain: domain.map(|(number, id, _)| (number, id)),
        exports: Mutex::new(BTreeMap::new()),
        link: Mutex::new(None),
        connecting: std::sync::atomic::AtomicBool::new(false),
        qp,
        cq,
        ring: Arc::new(ring),
        layout,
        doorbell: WakePipe::doorbell()
            .map_err(|e| EngineError::os("cannot create a doorbell pipe", e))?,
        completion_event: WakePipe::completions()
            .map_err(|e| EngineError::os("cannot create a completion pipe", e))?,
        local,
        max_message: port.max_msg_sz,
        remote: Mutex::new(None),
        counters: QpCounters::default(),
        worker: std::sync::OnceLock::new(),
    })
}

/// A QP's submission and completion rings of `layout`, its header written, as
/// `CreateQueuePair` hands them to the client.
pub(super) fn new_ring(layout: &Layout) -> Result<SharedMemory, EngineError> {
    let ring = SharedMemory::create(c"rdmad-qp-ring", layout.size())
        .map_err(|e| EngineError::os("cannot create the QP's ring", e))?;
    for (offset, word) in layout.header_words() {
        ring.write_at(offset, &word.to_le_bytes())
            .map_err(|e| EngineError::os("cannot write the QP's ring header", e))?;
    }
    Ok(ring)
}

/// Connection defaults taken from the device (`Connect` options may lower them later).
#[derive(Debug, Clone, Copy)]
pub struct ConnectDefaults {
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub rd_atomic: u8,
}

impl ConnectDefaults {
    pub fn for_device(dev: &dyn Device) -> Result<ConnectDefaults, EngineError> {
        let attrs = dev.attributes()?;
        Ok(ConnectDefaults {
            // 4.096 µs × 2^16 ≈ 268 ms per try, 6 retries: a peer silent for about two
            // seconds fails the request with RetryExceeded, and an emulated peer that is
            // merely slow (Soft-RoCE under TCG) is not taken for a dead one.
            timeout: 16,
            // Not 7: Soft-RoCE (rxe) takes a retry count of 7 as "retry for ever" (as the
            // specification has it only for the RNR retry count), so a request to a peer
            // that powered off never completed — measured, `rdma statistic` counting
            // hundreds of retries and no `retry_exceeded_err`.
            retry_cnt: 6,
            // 7: retry without limit while the peer has no receive posted.
            rnr_retry: 7,
            min_rnr_timer: 12,
            rd_atomic: u8::try_from(attrs.max_qp_rd_atom.clamp(1, 16)).unwrap_or(16),
        })
    }
}

impl QueuePairRecord {
    /// Moves the QP RESET → INIT → RTR → RTS towards `remote`.
    #[cfg(test)]
    pub fn connect(&self, dev: &dyn Device, remote: RemoteEndpoint) -> Result<(), EngineError> {
        self.connect_with_mtu(dev, remote, self.local.mtu, LocalChoice::default())
    }

    /// As [`QueuePairRecord::connect`], with the path MTU agreed with the peer.
    pub fn connect_with_mtu(
        &self,
        dev: &dyn Device,
        remote: RemoteEndpoint,
        path_mtu: u32,
        local: LocalChoice,
    ) -> Result<(), EngineError> {
        let mut slot = self.remote.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return Err(EngineError::InvalidArgument(
                "the queue pair is connected already; create another one for another peer".into(),
            ));
        }
        if remote.qp_num == 0 || remote.qp_num > 0x00ff_ffff {
            return Err(EngineError::InvalidArgument(format!(
                "remote QPN {} is not a 24-bit queue pair number",
                remote.qp_num
            )));
        }
        if remote.psn > 0x00ff_ffff {
            return Err(EngineError::InvalidArgument(format!(
                "remote PSN {} is not a 24-bit packet sequence number",
                remote.psn
            )));
        }
        let d = ConnectDefaults::for_device(dev)?;
        let remote_rights = Access::LOCAL_WRITE
            .union(Access::REMOTE_WRITE)
            .union(Access::REMOTE_READ)
            .union(Access::REMOTE_ATOMIC);
        self.qp.to_init(self.local.port, remote_rights)?;
        self.qp.to_rtr(
            &remote,
            &RtrAttributes {
                port: self.local.port,
                sgid_index: local.gid_index.unwrap_or(self.local.gid_index),
                path_mtu,
                max_dest_rd_atomic: d.rd_atomic,
                min_rnr_timer: d.min_rnr_timer,
            },
        )?;
        if !local.receive_only {
            self.qp.to_rts(&RtsAttributes {
                psn: local.psn.unwrap_or(self.local.psn),
                timeout: d.timeout,
                retry_cnt: d.retry_cnt,
                rnr_retry: d.rnr_retry,
                max_rd_atomic: d.rd_atomic,
            })?;
        }
        *slot = Some(remote);
        Ok(())
    }

    /// RTR → RTS for a QP connected receive-only, its sends starting at `psn` (else the
    /// endpoint's).
    pub fn ready(&self, dev: &dyn Device, psn: Option<u32>) -> Result<(), EngineError> {
        let connected = self
            .remote
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        if !connected || self.state() != QpState::Rtr {
            return Err(EngineError::InvalidArgument(
                "Ready moves a queue pair connected with {\"state\": \"rtr\"} to RTS; this \
                 one is not in RTR"
                    .into(),
            ));
        }
        if psn.is_some_and(|p| p > 0x00ff_ffff) {
            return Err(EngineError::InvalidArgument(format!(
                "psn {} is not a 24-bit packet sequence number",
                psn.unwrap_or(0)
            )));
        }
        let d = ConnectDefaults::for_device(dev)?;
        self.qp.to_rts(&RtsAttributes {
            psn: psn.unwrap_or(self.local.psn),
            timeout: d.timeout,
            retry_cnt: d.retry_cnt,
            rnr_retry: d.rnr_retry,
            max_rd_atomic: d.rd_atomic,
        })?;
        Ok(())
    }

    pub fn state(&self) -> QpState {
        self.qp.state().unwrap_or(QpState::Error)
    }
}
