//! The loopback provider: an in-process RDMA device with verbs semantics, served where the
//! host has no RDMA device and used by the unit tests. Anything that works here and fails on
//! a real device (or the other way round) is a bug here; Soft-RoCE (rxe) is the reference.
//!
//! # Design
//!
//! - **Keys.** One table maps MR keys (lkey = rkey) to registrations; another maps memory
//!   window table indices to the window's current binding; both live under one lock
//!   ([`Shared::keys`]), so a remote access resolves its rkey — a window's, then the MR
//!   under it — in one critical section. Both kinds of key are
//!   `index << 8 | variant byte`, drawn from one 24-bit index space ([`KeyIndices`]), so
//!   they never collide: an index is never handed out while an object with that index
//!   lives, and one handed out again after a full turn of the counter gets another variant
//!   byte, so a stale key does not reach the new object. A chunk of a WRITE or READ
//!   resolves its keys on both sides and moves its bytes inside one critical section of
//!   the tables: the memory is borrowed from them, not reference-counted.
//! - **Data path.** Work requests run synchronously, under the device's *execution lock*
//!   ([`Shared::exec`]): `post_send` runs each request that finds the send queue empty
//!   straight from the caller's list (queuing it only if it does not finish), queues the
//!   others and runs the queue as far as one turn goes. Everything that consumes a queue or
//!   produces a completion (running a send queue, the responder side, flushing) happens
//!   under that one lock, so completions are ordered per QP and two QPs talking to each
//!   other cannot deadlock. A SEND that finds no receive waits at the head of its send
//!   queue (RNR) and is retried when the peer posts a receive, changes state or goes away;
//!   finite `rnr_retry` counts are honoured with a short-lived timer thread.
//! - **Lock order.** `exec` → one QP's `data` at a time → leaf locks (key tables, QP table,
//!   CQ queues). A QP lock is never held while taking `exec` or another QP's lock. Strong
//!   references to QPs are only taken (from the QP table, or a CQ's list of QPs with a turn
//!   left) while holding `exec`, and kept past it only as the peer `exec` remembers; a QP
//!   handle's `Drop` takes `exec` to forget that peer, take the QP off its CQ's list and
//!   unpublish it, so the last reference to a QP is always its handle's and object counts
//!   are exact.
//! - **No threads** besides the RNR timers, no `unsafe`: data moves with
//!   [`SharedMemory::read_at`]/[`SharedMemory::write_at`]; atomics are a read-modify-write
//!   under `exec`, atomic with respect to every other loopback atomic
//!   ([`AtomicSupport::Hca`], like a real HCA).

mod cq;
mod qp;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::HashSet;
use std::net::Ipv6Addr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

// The device's tables are keyed by numbers the device hands out (keys, QP numbers), so a
// fast hash no client can steer into collisions is enough.
use rustc_hash::FxHashMap;

use super::counters::{Counters, Tracked};
use super::{
    Access, AtomicSupport, CompletionQueue, Device, DeviceAttributes, GidEntry, GidType, Lingering,
    LinkLayer, MemoryRegion, MemoryWindow, MwType, ObjectCounts, ObjectKind, PortAttributes,
    PortState, ProtectionDomain, ProviderError, ProviderKind, QpInit, QueuePair, Result, Span,
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
    /// The address the device knows its first byte by (the iova).
    addr: u64,
    len: u64,
    /// Where its first byte lies in `memory`.
    offset: usize,
    access: Access,
    /// The PD it was registered in ([`PdInner::id`]).
    pd: u64,
    /// The registration's own reference: a transfer borrows it inside the key tables'
    /// critical section, so a deregistration waits for the chunk being copied (as
    /// `ibv_dereg_mr` returns once no DMA uses the MR any more).
    memory: Arc<SharedMemory>,
}

impl Registration {
    fn contains(&self, addr: u64, len: u64) -> bool {
        range_inside(addr, len, self.addr, self.len)
    }

    /// Where `addr` (inside the registration) lies in its memory.
    fn memory_offset(&self, addr: u64) -> usize {
        (addr - self.addr) as usize + self.offset
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
    /// What the device checks a work request's keys against (a leaf lock).
    keys: Mutex<KeyTables>,
    /// qp_num → QP; strong references are only taken from it while holding `exec`.
    qps: Mutex<FxHashMap<u32, Weak<qp::QpInner>>>,
    /// The execution lock (see the module documentation), and what it keeps from one hold
    /// to the next.
    exec: Mutex<qp::Held>,
    /// Key-table indices of MRs and windows (a leaf lock).
    indices: Mutex<KeyIndices>,
    /// Registrations the device refused to deregister, retried on request (taken before
    /// the key tables, never while holding one).
    lingering: Mutex<Vec<LingeringMr>>,
    next_qpn: AtomicU32,
    next_id: AtomicU64,
}

/// The device's key tables.
#[derive(Debug, Default)]
struct KeyTables {
    /// lkey (= rkey) → registration.
    translations: FxHashMap<u32, Registration>,
    /// Window table index (`rkey >> 8`) → window.
    windows: FxHashMap<u32, WindowEntry>,
}

/// The highest key-table index: keys carry 24 bits of index above a variant byte.
const LAST_INDEX: u32 = 0x00ff_ffff;

/// The device's key-table indices, handed out in turn like rxe's pool indices (which wrap
/// after 2^24), but never one an MR or window still holds: an index is taken until its
/// object is gone (a registration until it is really deregistered), so a new object never
/// overwrites a live key.
#[derive(Debug)]
struct KeyIndices {
    /// The next index to try, from 1 to `last`.
    next: u32,
    last: u32,
    /// Full turns of the counter (wrapping): part of the variant byte, so an index handed
    /// out again makes a key other than the one its previous object had (for 256 turns).
    turn: u32,
    live: HashSet<u32>,
}

impl KeyIndices {
    fn new(next: u32, last: u32) -> KeyIndices {
        KeyIndices {
            next: next.clamp(1, last),
            last,
            turn: 0,
            live: HashSet::new(),
        }
    }

    /// A free index and the turn it was handed out in, or `None` when every index is
    /// taken.
    fn take(&mut self) -> Option<(u32, u32)> {
        if self.live.len() >= self.last as usize {
            return None;
        }
        loop {
            let (index, turn) = (self.next, self.turn);
            if self.next == self.last {
                self.next = 1;
                self.turn = self.turn.wrapping_add(1);
            } else {
                self.next += 1;
            }
            if self.live.insert(index) {
                return Some((index, turn));
            }
        }
    }

    fn give_back(&mut self, index: u32) {
        self.live.remove(&index);
    }
}

/// A key as rxe makes one: the table index in the upper 24 bits, a variant byte below
/// (`salt` keeps MR and window keys of one index apart; the turn changes it every time the
/// index is handed out again).
fn make_key(index: u32, turn: u32, salt: u32) -> u32 {
    (index << 8)
        | (index
            .wrapping_mul(salt)
            .wrapping_add(turn.wrapping_mul(0x5d))
            & 0xff)
}

impl Shared {
    /// A free key-table index and its turn, or the device's ENOMEM when every index is
    /// taken.
    fn alloc_index(&self, operation: &'static str) -> Result<(u32, u32)> {
        lock(&self.indices)
            .take()
            .ok_or_else(|| out_of_resources(&self.name, operation))
    }

    fn free_index(&self, index: u32) {
        lock(&self.indices).give_back(index);
    }

    /// Deregisters `key`, as rxe does: refused (EINVAL) while a window is bound over the
    /// registration, which then stays in the translation table — and the window's key
    /// keeps working.
    fn deregister(&self, key: u32) -> Result<()> {
        let removed = {
            let mut keys = lock(&self.keys);
            let bound = keys
                .windows
                .values()
                .any(|w| w.binding.as_ref().is_some_and(|b| b.mr_key == key));
            if bound {
                return Err(os_error(&self.name, "ibv_dereg_mr", libc::EINVAL));
            }
            keys.translations.remove(&key)
        };
        // The memory is let go of outside the lock.
        drop(removed);
        self.free_index(key >> 8);
        Ok(())
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn registration(&self, key: u32) -> Option<Registration> {
        lock(&self.keys).translations.get(&key).cloned()
    }

    fn gids(&self) -> Vec<GidEntry> {
        GIDS.iter()
            .enumerate()
            .map(|(index, &gid)| GidEntry {
                index: index as u32,
                gid,
                gid_type: GidType::RoceV2,
            })
            .collect()
    }

    /// Whether `gid` is one of the device's (its port's GID table).
    fn has_gid(&self, gid: Ipv6Addr) -> bool {
        GIDS.contains(&gid)
    }
}

/// The port's GID table: a link-local address and 127.0.0.1, both RoCE v2.
const GIDS: [Ipv6Addr; 2] = [
    Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0xff, 0xfe00, 1),
    std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped(),
];

/// The loopback device.
#[derive(Debug, Clone)]
pub struct LoopbackDevice {
    shared: Arc<Shared>,
}

impl LoopbackDevice {
    pub fn new(name: &str) -> LoopbackDevice {
        LoopbackDevice::with_indices(name, KeyIndices::new(1, LAST_INDEX))
    }

    /// A device whose key-table indices start at `next` and end at `last` (tests: near the
    /// wrap, or a space small enough to fill).
    #[cfg(test)]
    fn with_key_indices(name: &str, next: u32, last: u32) -> LoopbackDevice {
        LoopbackDevice::with_indices(name, KeyIndices::new(next, last.min(LAST_INDEX)))
    }

    fn with_indices(name: &str, indices: KeyIndices) -> LoopbackDevice {
        LoopbackDevice {
            shared: Arc::new(Shared {
                name: name.to_owned(),
                counters: Arc::default(),
                keys: Mutex::default(),
                qps: Mutex::default(),
                exec: Mutex::default(),
                indices: Mutex::new(indices),
                lingering: Mutex::default(),
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

    fn lingering(&self) -> Vec<Lingering> {
        lock(&self.shared.lingering)
            .iter()
            .map(|m| m.info.clone())
            .collect()
    }

    fn retry_lingering(&self) -> usize {
        let device = &self.shared;
        let mut list = lock(&device.lingering);
        list.retain_mut(|m| match device.deregister(m.key) {
            Ok(()) => {
                tracing::warn!(
                    "{}: registration {:#x} deregistered after {} refusals",
                    device.name,
                    m.key,
                    m.info.attempts
                );
                false
            }
            Err(e) => {
                m.info.refused_again(&e);
                true
            }
        });
        list.len()
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
    fn register_span(
        &self,
        memory: Arc<SharedMemory>,
        span: Span,
        access: Access,
    ) -> Result<Arc<dyn MemoryRegion>> {
        crate::test_hooks::slow_device("ibv_reg_mr");
        let device = &self.0.device;
        let name = &device.name;
        access
            .check_consistent()
            .map_err(|message| ProviderError::invalid(name, message))?;
        span.check(memory.len())
            .map_err(|message| ProviderError::invalid(name, message))?;
        if device.counters.snapshot().mrs >= u64::from(MAX_MR) {
            return Err(out_of_resources(name, "ibv_reg_mr"));
        }
        let (index, turn) = device.alloc_index("ibv_reg_mr")?;
        let key = make_key(index, turn, 0x9e);
        let registration = Registration {
            addr: span.iova,
            len: span.len as u64,
            offset: span.offset,
            access,
            pd: self.0.id,
            memory: Arc::clone(&memory),
        };
        lock(&device.keys).translations.insert(key, registration);
        Ok(Arc::new(LoopbackMr {
            key,
            access,
            span,
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
        let (index, turn) = device.alloc_index("ibv_alloc_mw")?;
        // rxe: `(index << 8) | rxe_get_next_key(-1)`; type 1 starts VALID with length 0,
        // type 2 starts FREE — either way no access until bound.
        let rkey = make_key(index, turn, 0x3b);
        lock(&device.keys).windows.insert(
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
        crate::test_hooks::slow_device("ibv_create_qp");
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
    span: Span,
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
    fn span(&self) -> Span {
        self.span
    }
}

impl Drop for LoopbackMr {
    fn drop(&mut self) {
        let device = &self.pd.device;
        if let Err(e) = device.deregister(self.key) {
            tracing::error!(
                "{e} (registration {:#x}, {} bytes): a window is still bound over it; \
                 it stays registered and is retried",
                self.key,
                self.memory.len()
            );
            lock(&device.lingering).push(LingeringMr {
                key: self.key,
                info: Lingering::new(ObjectKind::Mr, self.key, self.memory.len() as u64, &e),
                _tracked: device.counters.track(ObjectKind::Mr),
                _pd: Arc::clone(&self.pd),
            });
        }
    }
}

/// A registration the device refused to deregister: still in the translation table (its
/// memory stays mapped through the registration's `Arc`), counted as a live MR, its PD
/// alive, until [`Device::retry_lingering`] succeeds.
#[derive(Debug)]
struct LingeringMr {
    key: u32,
    info: Lingering,
    _tracked: Tracked,
    _pd: Arc<PdInner>,
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
        lock(&self.pd.device.keys)
            .windows
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
        lock(&self.pd.device.keys).windows.remove(&self.index);
        self.pd.device.free_index(self.index);
    }
}
