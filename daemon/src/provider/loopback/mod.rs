//! The loopback provider: an in-process RDMA device with verbs semantics, served where the
//! host has no RDMA device and used by the unit tests. Anything that works here and fails on
//! a real device (or the other way round) is a bug here; Soft-RoCE (rxe) is the reference.
//!
//! # Design
//!
//! - **Keys.** One table maps MR keys (lkey = rkey) to registrations; another maps memory
//!   window table indices to the window's current binding. Both kinds of key are
//!   `index << 8 | variant byte`, drawn from one index counter, so they never collide.
//! - **Data path.** Work requests run synchronously: `post_send` appends to the send queue
//!   and then runs the queue as far as it can under the device's *execution lock*
//!   ([`Shared::exec`]). Everything that consumes a queue or produces a completion (running a
//!   send queue, the responder side, flushing) happens under that one lock, so completions
//!   are ordered per QP and two QPs talking to each other cannot deadlock. A SEND that finds
//!   no receive waits at the head of its send queue (RNR) and is retried when the peer posts
//!   a receive, changes state or goes away; finite `rnr_retry` counts are honoured with a
//!   short-lived timer thread.
//! - **Lock order.** `exec` → one QP's `data` at a time → leaf locks (key tables, QP table,
//!   CQ queues). A QP lock is never held while taking `exec` or another QP's lock. Temporary
//!   strong references to other QPs are only taken (from the QP table) while holding `exec`,
//!   and a QP handle's `Drop` takes `exec` before unpublishing itself, so the last reference
//!   to a QP is always its handle's and object counts are exact.
//! - **No threads** besides the RNR timers, no `unsafe`: data moves with
//!   [`SharedMemory::read_at`]/[`SharedMemory::write_at`]; atomics are a read-modify-write
//!   under `exec`, atomic with respect to every other loopback atomic
//!   ([`AtomicSupport::Hca`], like a real HCA).

mod cq;
mod qp;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::Ipv6Addr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::counters::{Counters, Tracked};
use super::{
    Access, AtomicSupport, CompletionQueue, Device, DeviceAttributes, GidEntry, GidType, LinkLayer,
    MemoryRegion, MemoryWindow, MwType, ObjectCounts, ObjectKind, PortAttributes, PortState,
    ProtectionDomain, ProviderError, ProviderKind, QpInit, QueuePair, Result,
};
use crate::lock::lock;
use crate::memory::SharedMemory;

/// Name of the loopback device the daemon serves when there is no RDMA hardware.
pub const DEFAULT_NAME: &str = "loopback0";

/// Limits chosen to match a Soft-RoCE device, so quotas and tests behave alike.
const MAX_MR: u32 = 524_287;
const MAX_MW: u32 = 524_287;
const MAX_PD: u32 = 1_048_576;
const MAX_QP: u32 = 1 << 20;
const MAX_QP_WR: u32 = 1 << 14;
const MAX_SGE: u32 = 32;
const MAX_CQ: u32 = 1 << 20;
const MAX_CQE: u32 = 32_767;
const MAX_INLINE_DATA: u32 = 4096;
const MAX_QP_RD_ATOM: u32 = 128;
const PORT_MTU: u32 = 4096;

/// A registration as the device's translation table sees it.
#[derive(Debug, Clone)]
struct Registration {
    addr: u64,
    len: u64,
    access: Access,
    /// The PD it was registered in ([`PdInner::id`]).
    pd: u64,
    /// Kept here so a transfer racing a deregistration still copies into mapped memory
    /// (as DMA racing `ibv_dereg_mr` would).
    memory: Arc<SharedMemory>,
}

impl Registration {
    fn contains(&self, addr: u64, len: u64) -> bool {
        range_inside(addr, len, self.addr, self.len)
    }
}

/// `[addr, addr + len)` lies inside `[base, base + base_len)` (overflow-safe).
fn range_inside(addr: u64, len: u64, base: u64, base_len: u64) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let Some(base_end) = base.checked_add(base_len) else {
        return false;
    };
    addr >= base && end <= base_end
}

/// A memory window's entry in the device's key table.
#[derive(Debug, Clone)]
struct WindowEntry {
    kind: MwType,
    /// The rkey of the current binding (index in the upper 24 bits, a variant byte below).
    rkey: u32,
    pd: u64,
    binding: Option<Binding>,
}

/// What a bound window grants.
#[derive(Debug, Clone)]
struct Binding {
    /// The MR the window was bound over (looked up again at every access, so a
    /// deregistered MR stops the window from working).
    mr_key: u32,
    addr: u64,
    len: u64,
    access: Access,
    /// For type-2 windows, [`qp::QpInner::id`] of the QP it was bound through.
    qp: Option<u64>,
}

#[derive(Debug)]
struct Shared {
    name: String,
    counters: Arc<Counters>,
    /// lkey (= rkey) → registration: what the device checks a work request against.
    translations: Mutex<HashMap<u32, Registration>>,
    /// Window table index (`rkey >> 8`) → window.
    windows: Mutex<HashMap<u32, WindowEntry>>,
    /// qp_num → QP; strong references are only taken from it while holding `exec`.
    qps: Mutex<HashMap<u32, Weak<qp::QpInner>>>,
    /// The execution lock (see the module documentation).
    exec: Mutex<()>,
    next_index: AtomicU32,
    next_qpn: AtomicU32,
    next_id: AtomicU64,
}

impl Shared {
    /// A fresh key-table index (24 bits, never 0).
    fn alloc_index(&self) -> u32 {
        loop {
            let index = self.next_index.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
            if index != 0 {
                return index;
            }
        }
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn registration(&self, key: u32) -> Option<Registration> {
        lock(&self.translations).get(&key).cloned()
    }

    fn gids(&self) -> Vec<GidEntry> {
        gid_table()
    }
}

fn gid_table() -> Vec<GidEntry> {
    vec![
        GidEntry {
            index: 0,
            gid: Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0xff, 0xfe00, 1),
            gid_type: GidType::RoceV2,
        },
        GidEntry {
            index: 1,
            gid: std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped(),
            gid_type: GidType::RoceV2,
        },
    ]
}

/// The loopback device.
#[derive(Debug, Clone)]
pub struct LoopbackDevice {
    shared: Arc<Shared>,
}

impl LoopbackDevice {
    pub fn new(name: &str) -> LoopbackDevice {
        LoopbackDevice {
            shared: Arc::new(Shared {
                name: name.to_owned(),
                counters: Arc::default(),
                translations: Mutex::default(),
                windows: Mutex::default(),
                qps: Mutex::default(),
                exec: Mutex::default(),
                next_index: AtomicU32::new(1),
                // rxe hands out QP numbers from 17 up (0 and 1 are the special QPs).
                next_qpn: AtomicU32::new(0x11),
                next_id: AtomicU64::new(1),
            }),
        }
    }

    /// Checks a local access the way a device checks an SGE: the key must name a live
    /// registration, the range must lie inside it and the registration must grant `needed`.
    pub fn check_local_access(&self, lkey: u32, addr: u64, len: u64, needed: Access) -> Result<()> {
        let name = &self.shared.name;
        let reg = self.shared.registration(lkey).ok_or_else(|| {
            ProviderError::invalid(name, format!("lkey {lkey:#x} is not registered"))
        })?;
        if !reg.contains(addr, len) {
            return Err(ProviderError::invalid(
                name,
                format!(
                    "range {addr:#x}+{len} lies outside registration {lkey:#x} ({:#x}+{})",
                    reg.addr, reg.len
                ),
            ));
        }
        if !reg.access.contains(needed) {
            return Err(ProviderError::invalid(
                name,
                format!(
                    "registration {lkey:#x} grants {:?}, not {needed:?}",
                    reg.access
                ),
            ));
        }
        Ok(())
    }
}

impl Device for LoopbackDevice {
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn provider(&self) -> ProviderKind {
        ProviderKind::Loopback
    }

    fn attributes(&self) -> Result<DeviceAttributes> {
        Ok(DeviceAttributes {
            // A locally administered EUI-64, the shape rxe derives from a MAC address.
            node_guid: 0x0200_00ff_fe00_0001,
            firmware_version: env!("CARGO_PKG_VERSION").to_owned(),
            port_count: 1,
            max_qp: MAX_QP,
            max_qp_wr: MAX_QP_WR,
            max_sge: MAX_SGE,
            max_cq: MAX_CQ,
            max_cqe: MAX_CQE,
            max_mr: MAX_MR,
            max_pd: MAX_PD,
            max_mr_size: u64::MAX,
            max_mw: MAX_MW,
            max_qp_rd_atom: MAX_QP_RD_ATOM,
            atomics: AtomicSupport::Hca,
            mw_type1: true,
            mw_type2a: false,
            mw_type2b: true,
        })
    }

    fn query_port(&self, port: u8) -> Result<PortAttributes> {
        check_port(&self.shared.name, port)?;
        Ok(PortAttributes {
            port,
            state: PortState::Active,
            physical_state: "link_up",
            active_mtu: PORT_MTU,
            max_mtu: PORT_MTU,
            lid: 0,
            link_layer: LinkLayer::Ethernet,
            gid_table_len: 1024,
            max_msg_sz: qp::MAX_MESSAGE,
        })
    }

    fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        check_port(&self.shared.name, port)?;
        Ok(self.shared.gids())
    }

    fn alloc_pd(&self) -> Result<Arc<dyn ProtectionDomain>> {
        if self.shared.counters.snapshot().pds >= u64::from(MAX_PD) {
            return Err(out_of_resources(&self.shared.name, "ibv_alloc_pd"));
        }
        Ok(Arc::new(LoopbackPd(Arc::new(PdInner {
            id: self.shared.next_id(),
            _tracked: self.shared.counters.track(ObjectKind::Pd),
            device: Arc::clone(&self.shared),
        }))))
    }

    fn object_counts(&self) -> ObjectCounts {
        self.shared.counters.snapshot()
    }
}

fn check_port(device: &str, port: u8) -> Result<()> {
    if port != 1 {
        return Err(ProviderError::invalid(
            device,
            format!("port {port} does not exist (the device has port 1)"),
        ));
    }
    Ok(())
}

fn out_of_resources(device: &str, operation: &'static str) -> ProviderError {
    os_error(device, operation, libc::ENOMEM)
}

fn os_error(device: &str, operation: &'static str, errno: i32) -> ProviderError {
    ProviderError::Os {
        device: device.to_owned(),
        operation,
        source: std::io::Error::from_raw_os_error(errno),
    }
}

/// The handle the engine holds; registrations, windows, CQs and QPs hold the inner part, so
/// a PD lives until its last child is gone, as with verbs.
#[derive(Debug)]
struct LoopbackPd(Arc<PdInner>);

#[derive(Debug)]
struct PdInner {
    /// Unique on the device, never reused: what "same PD" checks compare.
    id: u64,
    device: Arc<Shared>,
    _tracked: Tracked,
}

impl ProtectionDomain for LoopbackPd {
    fn register(&self, memory: Arc<SharedMemory>, access: Access) -> Result<Arc<dyn MemoryRegion>> {
        let device = &self.0.device;
        let name = &device.name;
        access
            .check_consistent()
            .map_err(|message| ProviderError::invalid(name, message))?;
        if device.counters.snapshot().mrs >= u64::from(MAX_MR) {
            return Err(out_of_resources(name, "ibv_reg_mr"));
        }
        // Keys as rxe makes them: a table index in the upper 24 bits, a variant byte below.
        let index = device.alloc_index();
        let key = (index << 8) | (index.wrapping_mul(0x9e) & 0xff);
        let registration = Registration {
            addr: memory.addr(),
            len: memory.len() as u64,
            access,
            pd: self.0.id,
            memory: Arc::clone(&memory),
        };
        lock(&device.translations).insert(key, registration);
        Ok(Arc::new(LoopbackMr {
            key,
            access,
            memory,
            _tracked: device.counters.track(ObjectKind::Mr),
            pd: Arc::clone(&self.0),
        }))
    }

    fn alloc_mw(&self, kind: MwType) -> Result<Arc<dyn MemoryWindow>> {
        let device = &self.0.device;
        if device.counters.snapshot().mws >= u64::from(MAX_MW) {
            return Err(out_of_resources(&device.name, "ibv_alloc_mw"));
        }
        let index = device.alloc_index();
        // rxe: `(index << 8) | rxe_get_next_key(-1)`; type 1 starts VALID with length 0,
        // type 2 starts FREE — either way no access until bound.
        let rkey = (index << 8) | (index.wrapping_mul(0x3b) & 0xff);
        lock(&device.windows).insert(
            index,
            WindowEntry {
                kind,
                rkey,
                pd: self.0.id,
                binding: None,
            },
        );
        Ok(Arc::new(LoopbackMw {
            index,
            kind,
            _tracked: device.counters.track(ObjectKind::Mw),
            pd: Arc::clone(&self.0),
        }))
    }

    fn create_cq(&self, depth: u32) -> Result<Arc<dyn CompletionQueue>> {
        cq::create(&self.0, depth)
    }

    fn create_qp(&self, init: QpInit) -> Result<Arc<dyn QueuePair>> {
        qp::create(&self.0, init)
    }

    fn device_name(&self) -> &str {
        &self.0.device.name
    }
}

#[derive(Debug)]
struct LoopbackMr {
    key: u32,
    access: Access,
    memory: Arc<SharedMemory>,
    _tracked: Tracked,
    pd: Arc<PdInner>,
}

impl MemoryRegion for LoopbackMr {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
    fn access(&self) -> Access {
        self.access
    }
    fn memory(&self) -> &Arc<SharedMemory> {
        &self.memory
    }
}

impl Drop for LoopbackMr {
    fn drop(&mut self) {
        // Windows bound over this MR stay in their table but stop resolving: every remote
        // access looks the MR up again. (rxe refuses to deregister an MR with bound
        // windows; a drop cannot fail, so here the windows die with it instead.)
        let removed = lock(&self.pd.device.translations).remove(&self.key);
        drop(removed);
    }
}

/// A memory window: its state lives in the device's window table, so a remote access and
/// an invalidation see the same binding.
#[derive(Debug)]
struct LoopbackMw {
    index: u32,
    kind: MwType,
    _tracked: Tracked,
    pd: Arc<PdInner>,
}

impl MemoryWindow for LoopbackMw {
    fn kind(&self) -> MwType {
        self.kind
    }

    fn rkey(&self) -> u32 {
        lock(&self.pd.device.windows)
            .get(&self.index)
            .map_or(0, |entry| entry.rkey)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for LoopbackMw {
    fn drop(&mut self) {
        // Deallocation invalidates: the rkey stops resolving at once.
        lock(&self.pd.device.windows).remove(&self.index);
    }
}
