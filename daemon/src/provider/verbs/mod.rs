//! The verbs provider: real RDMA devices through libibverbs (`rdma-sys`).
//!
//! Ownership mirrors the kernel's object tree: a [`VerbsDevice`] is a handle on an
//! `Arc<DeviceContext>` (the opened `ibv_context`; not to be confused with the D-Bus layer's
//! `dbus::Context`); a protection domain holds that `Arc`, and every registration or window
//! holds its PD's inner `Arc`. Whatever order the engine drops handles in, children are
//! destroyed before their parents and the device is closed last.
//!
//! Data path: [`cq`] (completion queues with a completion channel each) and [`qp`] (RC queue
//! pairs, posting, window binding). A QP holds its CQs and PD; a CQ holds the context.
//!
//! Thread safety: libibverbs guarantees that all verbs may be called concurrently from any
//! thread on the same objects ("libibverbs is thread safe", `ibv_open_device(3)` and the
//! rdma-core documentation); the pointers below are only ever passed to verbs, and each is
//! destroyed exactly once, in `Drop`, when no other reference to its owner exists.

use std::ffi::CStr;
use std::io;
use std::net::Ipv6Addr;
use std::os::raw::c_int;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use rdma_sys::{
    ibv_alloc_pd, ibv_close_device, ibv_context, ibv_dealloc_pd, ibv_dereg_mr, ibv_device,
    ibv_device_attr, ibv_device_cap_flags, ibv_free_device_list, ibv_get_device_list,
    ibv_get_device_name, ibv_gid, ibv_mr, ibv_mw, ibv_mw_type, ibv_open_device, ibv_pd,
    ibv_port_attr, ibv_port_state, ibv_query_device, ibv_query_gid, ibv_reg_mr_iova2,
};

pub mod cm;
mod cq;
mod qp;

use super::counters::{Counters, Tracked};
use super::{
    mtu_bytes, Access, AtomicSupport, CompletionQueue, Device, DeviceAttributes, GidEntry, GidType,
    Lingering, LinkLayer, MemoryRegion, MemoryWindow, MwType, ObjectCounts, ObjectKind,
    PortAttributes, PortState, ProtectionDomain, ProviderError, ProviderKind, QpInit, QueuePair,
    Result, Span,
};
use crate::memory::SharedMemory;

/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in `verbs.h`, not bound by `rdma-sys`);
/// `IBV_LINK_LAYER_INFINIBAND` is 1 and unspecified is 0.
const LINK_LAYER_ETHERNET: u8 = 2;

/// Opens every RDMA device the kernel offers.
///
/// Without kernel RDMA support (`ibv_get_device_list` fails with `ENOSYS`) or with no device,
/// the answer is [`ProviderError::NoDevices`] with the reason. A device that fails to open is
/// logged and skipped; if none opens, the first failure is returned.
pub fn open_devices() -> Result<Vec<Arc<dyn Device>>> {
    let list = DeviceList::get()?;
    let mut devices: Vec<Arc<dyn Device>> = Vec::new();
    let mut first_error = None;
    for raw in list.iter() {
        match DeviceContext::open(raw) {
            Ok(context) => devices.push(Arc::new(VerbsDevice {
                context: Arc::new(context),
            })),
            Err(error) => {
                tracing::warn!("skipping RDMA device: {error}");
                first_error.get_or_insert(error);
            }
        }
    }
    match first_error {
        Some(error) if devices.is_empty() => Err(error),
        _ => Ok(devices),
    }
}

/// The names of the RDMA devices the kernel offers now, without opening them.
pub fn device_names() -> Result<Vec<String>> {
    Ok(DeviceList::get()?.iter().map(device_name).collect())
}

/// Opens the device called `name` (`rxe0`, `mlx5_0`).
pub fn open_device(name: &str) -> Result<VerbsDevice> {
    let list = DeviceList::get()?;
    let mut seen = Vec::new();
    for raw in list.iter() {
        let found = device_name(raw);
        if found == name {
            return Ok(VerbsDevice {
                context: Arc::new(DeviceContext::open(raw)?),
            });
        }
        seen.push(found);
    }
    Err(ProviderError::NoDevices(format!(
        "no RDMA device named {name} (found: {})",
        if seen.is_empty() {
            "none".to_owned()
        } else {
            seen.join(", ")
        }
    )))
}

/// The result of `ibv_get_device_list`, freed on drop.
struct DeviceList {
    list: NonNull<*mut ibv_device>,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList> {
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer; the returned list is owned by the caller
        // and freed exactly once, in `Drop`.
        let list = unsafe { ibv_get_device_list(&mut count) };
        let Some(list) = NonNull::new(list) else {
            let error = io::Error::last_os_error();
            return Err(ProviderError::NoDevices(
                if error.raw_os_error() == Some(libc::ENOSYS) {
                    "the kernel has no RDMA support (ibv_get_device_list: ENOSYS)".to_owned()
                } else {
                    format!("ibv_get_device_list failed: {error}")
                },
            ));
        };
        let list = DeviceList {
            list,
            len: usize::try_from(count).unwrap_or(0),
        };
        if list.len == 0 {
            return Err(ProviderError::NoDevices(
                "no RDMA devices found (the kernel supports RDMA, but no driver has created \
                 a device; for Soft-RoCE: `rdma link add rxe0 type rxe netdev <netdev>`)"
                    .to_owned(),
            ));
        }
        Ok(list)
    }

    fn iter(&self) -> impl Iterator<Item = NonNull<ibv_device>> + '_ {
        (0..self.len).filter_map(|i| {
            // SAFETY: the list holds `len` device pointers (then a NULL terminator) and lives
            // as long as `self`.
            NonNull::new(unsafe { *self.list.as_ptr().add(i) })
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from `ibv_get_device_list` and is freed only here; opened
        // contexts keep their own reference to the device, so freeing the list is allowed
        // while they live (`ibv_get_device_list(3)`).
        unsafe { ibv_free_device_list(self.list.as_ptr()) };
    }
}

fn device_name(device: NonNull<ibv_device>) -> String {
    // SAFETY: `device` comes from a live device list; the name is a NUL-terminated string
    // inside the device struct (or NULL, handled below).
    let name = unsafe { ibv_get_device_name(device.as_ptr()) };
    if name.is_null() {
        return "unknown".to_owned();
    }
    // SAFETY: non-NULL, NUL-terminated, valid while the device list lives (we copy it).
    unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned()
}

fn c_chars_to_string(chars: &[std::os::raw::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// An error from a verb that returns an errno (or -1 with `errno` set).
fn verb_error(device: &str, operation: &'static str, rc: c_int) -> ProviderError {
    let source = if rc > 0 {
        io::Error::from_raw_os_error(rc)
    } else {
        io::Error::last_os_error()
    };
    ProviderError::Os {
        device: device.to_owned(),
        operation,
        source,
    }
}

fn to_u32(value: c_int) -> u32 {
    u32::try_from(value).unwrap_or(0)
}

/// An opened device (`ibv_context`); closes it on drop.
#[derive(Debug)]
struct DeviceContext {
    ctx: NonNull<ibv_context>,
    name: String,
    /// `/sys/class/infiniband/<name>`, where the GID types live.
    sysfs: PathBuf,
    port_count: u8,
    cap_flags: u32,
    counters: Arc<Counters>,
    /// Registrations and windows the device refused to destroy, retried on request. While
    /// one is kept, it holds its PD and so this context: the device stays open (the kernel
    /// frees what is left when the process exits).
    lingering: std::sync::Mutex<Vec<LingeringObject>>,
}

// SAFETY: the context is only used through libibverbs calls, which are thread safe (module
// docs); it is closed once, in `Drop`, when the last `Arc<DeviceContext>` goes.
unsafe impl Send for DeviceContext {}
// SAFETY: as for `Send`; `&DeviceContext` gives no access to the pointee except through
// verbs.
unsafe impl Sync for DeviceContext {}

impl DeviceContext {
    fn open(device: NonNull<ibv_device>) -> Result<DeviceContext> {
        let name = device_name(device);
        // SAFETY: `device` is a live entry of the device list; the path is a fixed-size
        // array inside it, which we copy.
        let ibdev_path = c_chars_to_string(unsafe { &(*device.as_ptr()).ibdev_path });
        // SAFETY: `device` is a live entry of the device list; the context returned is ours
        // and closed in `Drop`.
        let ctx = unsafe { ibv_open_device(device.as_ptr()) };
        let Some(ctx) = NonNull::new(ctx) else {
            return Err(ProviderError::last_os(&name, "ibv_open_device"));
        };
        let mut context = DeviceContext {
            ctx,
            sysfs: if ibdev_path.is_empty() {
                PathBuf::from("/sys/class/infiniband").join(&name)
            } else {
                PathBuf::from(ibdev_path)
            },
            name,
            port_count: 0,
            cap_flags: 0,
            counters: Arc::default(),
            lingering: std::sync::Mutex::default(),
        };
        // Static for the life of the context: cache what every port check needs.
        let attr = context.query_device()?;
        context.port_count = attr.phys_port_cnt;
        context.cap_flags = attr.device_cap_flags;
        Ok(context)
    }

    fn query_device(&self) -> Result<ibv_device_attr> {
        // SAFETY: `ibv_device_attr` is plain C data for which all-zero bytes are valid.
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a valid out-pointer.
        let rc = unsafe { ibv_query_device(self.ctx.as_ptr(), &mut attr) };
        if rc != 0 {
            return Err(verb_error(&self.name, "ibv_query_device", rc));
        }
        Ok(attr)
    }

    fn check_port(&self, port: u8) -> Result<()> {
        if port == 0 || port > self.port_count {
            return Err(ProviderError::invalid(
                &self.name,
                format!(
                    "port {port} does not exist (the device has ports 1..={})",
                    self.port_count
                ),
            ));
        }
        Ok(())
    }

    fn query_port(&self, port: u8) -> Result<ibv_port_attr> {
        self.check_port(port)?;
        // SAFETY: `ibv_port_attr` is plain C data for which all-zero bytes are valid.
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context, a port number checked above and a valid out-pointer of the
        // size `___ibv_query_port` passes to the provider.
        let rc = unsafe { rdma_sys::___ibv_query_port(self.ctx.as_ptr(), port, &mut attr) };
        if rc != 0 {
            return Err(verb_error(&self.name, "ibv_query_port", rc));
        }
        Ok(attr)
    }

    fn has_cap(&self, flag: ibv_device_cap_flags) -> bool {
        self.cap_flags & flag.0 != 0
    }

    /// The GID type the kernel reports in sysfs for one table entry.
    fn gid_type(&self, port: u8, index: u32, link_layer: LinkLayer) -> Option<GidType> {
        let path = self
            .sysfs
            .join(format!("ports/{port}/gid_attrs/types/{index}"));
        match std::fs::read_to_string(&path) {
            Ok(text) => match text.trim() {
                "IB/RoCE v1" if link_layer == LinkLayer::Ethernet => Some(GidType::RoceV1),
                "IB/RoCE v1" => Some(GidType::Ib),
                "RoCE v2" => Some(GidType::RoceV2),
                other => {
                    tracing::warn!("{}: unknown GID type {other:?} in {path:?}", self.name);
                    None
                }
            },
            // IB ports have one GID type; no need for sysfs.
            Err(_) if link_layer == LinkLayer::Infiniband => Some(GidType::Ib),
            Err(error) => {
                tracing::warn!("{}: cannot read GID type from {path:?}: {error}", self.name);
                None
            }
        }
    }
}

impl Drop for DeviceContext {
    fn drop(&mut self) {
        // SAFETY: the context was opened in `open` and is closed only here; every child
        // object holds an `Arc<DeviceContext>`, so none is left.
        let rc = unsafe { ibv_close_device(self.ctx.as_ptr()) };
        if rc != 0 {
            tracing::error!(
                "{}: ibv_close_device failed: {}",
                self.name,
                verb_error(&self.name, "ibv_close_device", rc)
            );
        }
    }
}

/// An opened verbs device.
#[derive(Debug, Clone)]
pub struct VerbsDevice {
    context: Arc<DeviceContext>,
}

fn port_state(state: ibv_port_state::Type) -> PortState {
    match state {
        ibv_port_state::IBV_PORT_DOWN => PortState::Down,
        ibv_port_state::IBV_PORT_INIT => PortState::Init,
        ibv_port_state::IBV_PORT_ARMED => PortState::Armed,
        ibv_port_state::IBV_PORT_ACTIVE => PortState::Active,
        ibv_port_state::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
        _ => PortState::Nop,
    }
}

/// `ibv_port_attr.phys_state` as `ibv_devinfo` and iproute2's `rdma link` name it.
fn physical_state(phys_state: u8) -> &'static str {
    match phys_state {
        1 => "sleep",
        2 => "polling",
        3 => "disabled",
        4 => "port_configuration_training",
        5 => "link_up",
        6 => "link_error_recovery",
        7 => "phy_test",
        _ => "unknown",
    }
}

fn link_layer(raw: u8) -> LinkLayer {
    match raw {
        LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
        // Unspecified (0) means InfiniBand, as `ibv_devinfo` reads it.
        _ => LinkLayer::Infiniband,
    }
}

impl Device for VerbsDevice {
    fn name(&self) -> &str {
        &self.context.name
    }

    fn provider(&self) -> ProviderKind {
        ProviderKind::Verbs
    }

    fn attributes(&self) -> Result<DeviceAttributes> {
        let attr = self.context.query_device()?;
        let cap = |flag: ibv_device_cap_flags| attr.device_cap_flags & flag.0 != 0;
        Ok(DeviceAttributes {
            // Stored in network byte order.
            node_guid: u64::from_be(attr.node_guid),
            firmware_version: c_chars_to_string(&attr.fw_ver),
            port_count: attr.phys_port_cnt,
            max_qp: to_u32(attr.max_qp),
            max_qp_wr: to_u32(attr.max_qp_wr),
            max_sge: to_u32(attr.max_sge),
            max_cq: to_u32(attr.max_cq),
            max_cqe: to_u32(attr.max_cqe),
            max_mr: to_u32(attr.max_mr),
            max_pd: to_u32(attr.max_pd),
            max_mr_size: attr.max_mr_size,
            max_mw: to_u32(attr.max_mw),
            max_qp_rd_atom: to_u32(attr.max_qp_rd_atom),
            atomics: match attr.atomic_cap {
                rdma_sys::ibv_atomic_cap::IBV_ATOMIC_HCA => AtomicSupport::Hca,
                rdma_sys::ibv_atomic_cap::IBV_ATOMIC_GLOB => AtomicSupport::Global,
                _ => AtomicSupport::None,
            },
            mw_type1: cap(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW),
            mw_type2a: cap(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A),
            mw_type2b: cap(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B),
        })
    }

    fn query_port(&self, port: u8) -> Result<PortAttributes> {
        let attr = self.context.query_port(port)?;
        Ok(PortAttributes {
            port,
            state: port_state(attr.state),
            physical_state: physical_state(attr.phys_state),
            active_mtu: mtu_bytes(attr.active_mtu),
            max_mtu: mtu_bytes(attr.max_mtu),
            lid: attr.lid,
            link_layer: link_layer(attr.link_layer),
            gid_table_len: to_u32(attr.gid_tbl_len),
            max_msg_sz: u64::from(attr.max_msg_sz),
        })
    }

    fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let attr = self.context.query_port(port)?;
        let layer = link_layer(attr.link_layer);
        let mut entries = Vec::new();
        for index in 0..attr.gid_tbl_len.max(0) {
            let mut gid = ibv_gid { raw: [0; 16] };
            // SAFETY: a live context, a checked port, an index below the table length and a
            // valid out-pointer.
            let rc = unsafe { ibv_query_gid(self.context.ctx.as_ptr(), port, index, &mut gid) };
            if rc != 0 {
                // Unpopulated entries fail (e.g. ENODATA on RoCE); they are not in the table.
                continue;
            }
            // SAFETY: every bit pattern is a valid `[u8; 16]`.
            let raw = unsafe { gid.raw };
            if raw == [0; 16] {
                continue;
            }
            let index = index as u32;
            if let Some(gid_type) = self.context.gid_type(port, index, layer) {
                entries.push(GidEntry {
                    index,
                    gid: Ipv6Addr::from(raw),
                    gid_type,
                });
            }
        }
        Ok(entries)
    }

    fn alloc_pd(&self) -> Result<Arc<dyn ProtectionDomain>> {
        let context = &self.context;
        // SAFETY: a live context; the PD is deallocated in `PdInner::drop`.
        let pd = unsafe { ibv_alloc_pd(context.ctx.as_ptr()) };
        let Some(pd) = NonNull::new(pd) else {
            return Err(ProviderError::last_os(&context.name, "ibv_alloc_pd"));
        };
        Ok(Arc::new(VerbsPd(Arc::new(PdInner {
            pd,
            _tracked: context.counters.track(ObjectKind::Pd),
            context: Arc::clone(context),
        }))))
    }

    fn object_counts(&self) -> ObjectCounts {
        self.context.counters.snapshot()
    }

    fn lingering(&self) -> Vec<Lingering> {
        crate::lock::lock(&self.context.lingering)
            .iter()
            .map(|o| o.info.clone())
            .collect()
    }

    fn retry_lingering(&self) -> usize {
        let name = &self.context.name;
        let mut list = crate::lock::lock(&self.context.lingering);
        // Windows first: a registration with a window bound over it cannot go.
        list.sort_by_key(|o| matches!(o.handle, LingeringHandle::Mr { .. }));
        list.retain_mut(|o| match o.destroy(name) {
            Ok(()) => {
                tracing::warn!(
                    "{name}: {} {:#x} destroyed after {} refusals",
                    o.info.kind.as_str(),
                    o.info.key,
                    o.info.attempts
                );
                false
            }
            Err(e) => {
                o.info.refused_again(&e);
                true
            }
        });
        list.len()
    }

    fn connection_manager(&self) -> Result<Arc<dyn super::cm::ConnectionManager>> {
        cm::connection_manager()
    }
}

/// A registration or window the device refused to destroy, owned by its context's list
/// alone from then on (the handle that made it is gone).
#[derive(Debug)]
struct LingeringObject {
    handle: LingeringHandle,
    info: Lingering,
    _tracked: Tracked,
    /// The PD (and through it the context) outlives the object.
    _pd: Arc<PdInner>,
}

#[derive(Debug)]
enum LingeringHandle {
    Mr {
        mr: NonNull<ibv_mr>,
        /// Unmapped only once the device has let go of it.
        _memory: Arc<SharedMemory>,
    },
    Mw(NonNull<ibv_mw>),
}

// SAFETY: the pointers are only passed to `ibv_dereg_mr` and the provider's `dealloc_mw`,
// which are thread safe (module docs), under the list's lock, and each is destroyed at
// most once: the entry is removed from the list when its verb succeeds.
unsafe impl Send for LingeringObject {}

impl LingeringObject {
    fn destroy(&self, name: &str) -> Result<()> {
        match &self.handle {
            LingeringHandle::Mr { mr, .. } => dereg_mr(name, *mr),
            LingeringHandle::Mw(mw) => dealloc_mw(name, *mw),
        }
    }
}

/// `ibv_dereg_mr`.
fn dereg_mr(name: &str, mr: NonNull<ibv_mr>) -> Result<()> {
    // SAFETY: a registration made by `ibv_reg_mr` that no verb has deregistered yet (the
    // callers destroy each once: `VerbsMr::drop`, then only its lingering entry).
    let rc = unsafe { ibv_dereg_mr(mr.as_ptr()) };
    if rc != 0 {
        return Err(verb_error(name, "ibv_dereg_mr", rc));
    }
    Ok(())
}

/// The provider's `dealloc_mw` (what `ibv_dealloc_mw` calls, minus its panic on a missing
/// operation).
fn dealloc_mw(name: &str, mw: NonNull<ibv_mw>) -> Result<()> {
    // SAFETY: a live window; its context outlives it (the PD holds the context).
    let dealloc = unsafe { (*(*mw.as_ptr()).context).ops.dealloc_mw };
    let Some(dealloc) = dealloc else {
        return Err(ProviderError::not_supported(name, "ibv_dealloc_mw"));
    };
    // SAFETY: a window made by `ibv_alloc_mw` that no verb has deallocated yet (the callers
    // destroy each once: `VerbsMw::drop`, then only its lingering entry).
    let rc = unsafe { dealloc(mw.as_ptr()) };
    if rc != 0 {
        return Err(verb_error(name, "ibv_dealloc_mw", rc));
    }
    Ok(())
}

impl DeviceContext {
    /// Keeps an object whose destruction failed, and says so.
    fn linger(&self, handle: LingeringHandle, info: Lingering, pd: &Arc<PdInner>) {
        tracing::error!(
            "{}: {} (key {:#x}, {} bytes): it stays alive and is retried",
            self.name,
            info.error,
            info.key,
            info.len
        );
        crate::lock::lock(&self.lingering).push(LingeringObject {
            handle,
            _tracked: self.counters.track(info.kind),
            info,
            _pd: Arc::clone(pd),
        });
    }
}

/// The handle the engine holds; registrations and windows hold the inner part, so the PD is
/// deallocated only after its last child.
#[derive(Debug)]
struct VerbsPd(Arc<PdInner>);

#[derive(Debug)]
struct PdInner {
    pd: NonNull<ibv_pd>,
    _tracked: Tracked,
    /// Dropped after the PD is deallocated (field drops follow `Drop::drop`).
    context: Arc<DeviceContext>,
}

// SAFETY: the PD is only passed to thread-safe verbs (module docs) and deallocated once, in
// `Drop`, after every child holding this `PdInner` is gone.
unsafe impl Send for PdInner {}
// SAFETY: as for `Send`.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc_pd`, deallocated only here; MRs and MWs hold this
        // `PdInner`, so none of them is left.
        let rc = unsafe { ibv_dealloc_pd(self.pd.as_ptr()) };
        if rc != 0 {
            tracing::error!("{}", verb_error(&self.context.name, "ibv_dealloc_pd", rc));
        }
    }
}

impl ProtectionDomain for VerbsPd {
    fn register_span(
        &self,
        memory: Arc<SharedMemory>,
        span: Span,
        access: Access,
    ) -> Result<Arc<dyn MemoryRegion>> {
        let inner = &self.0;
        let name = &inner.context.name;
        access
            .check_consistent()
            .map_err(|message| ProviderError::invalid(name, message))?;
        span.check(memory.len())
            .map_err(|message| ProviderError::invalid(name, message))?;
        // SAFETY: `span.check` keeps `[offset, offset + len)` inside the mapping, so the
        // pointer stays inside (or one past) it.
        let start = unsafe { memory.as_ptr().add(span.offset) };
        // SAFETY: a live PD; `[start, start + len)` lies inside a live mapping that the MR
        // keeps (an `Arc`) until after `ibv_dereg_mr`, so the device never sees unmapped
        // memory; the iova is only a name the device gives those bytes.
        let mr = unsafe {
            ibv_reg_mr_iova2(
                inner.pd.as_ptr(),
                start.cast(),
                span.len,
                span.iova,
                access.bits(),
            )
        };
        let Some(mr) = NonNull::new(mr) else {
            return Err(ProviderError::last_os(name, "ibv_reg_mr"));
        };
        // SAFETY: a fresh, valid MR; its keys do not change while it lives.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        Ok(Arc::new(VerbsMr {
            mr,
            lkey,
            rkey,
            access,
            span,
            _tracked: inner.context.counters.track(ObjectKind::Mr),
            memory,
            pd: Arc::clone(inner),
        }))
    }

    fn alloc_mw(&self, kind: MwType) -> Result<Arc<dyn MemoryWindow>> {
        let inner = &self.0;
        let context = &inner.context;
        let (supported, raw_type) = match kind {
            MwType::Type1 => (
                context.has_cap(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW),
                ibv_mw_type::IBV_MW_TYPE_1,
            ),
            MwType::Type2 => (
                context.has_cap(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A)
                    || context.has_cap(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B),
                ibv_mw_type::IBV_MW_TYPE_2,
            ),
        };
        let operation = match kind {
            MwType::Type1 => "type-1 memory windows",
            MwType::Type2 => "type-2 memory windows",
        };
        if !supported {
            return Err(ProviderError::not_supported(&context.name, operation));
        }
        // SAFETY: a live PD; `ibv_alloc_mw` checks the provider implements the verb (None
        // with EOPNOTSUPP otherwise); the window is deallocated in `VerbsMw::drop`.
        let mw = unsafe { rdma_sys::ibv_alloc_mw(inner.pd.as_ptr(), raw_type) };
        let Some(mw) = mw.and_then(NonNull::new) else {
            let error = io::Error::last_os_error();
            if matches!(error.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOSYS)) {
                return Err(ProviderError::not_supported(&context.name, operation));
            }
            return Err(ProviderError::Os {
                device: context.name.clone(),
                operation: "ibv_alloc_mw",
                source: error,
            });
        };
        // SAFETY: a fresh, valid window.
        let rkey = unsafe { (*mw.as_ptr()).rkey };
        Ok(Arc::new(VerbsMw {
            mw,
            kind,
            rkey: AtomicU32::new(rkey),
            _tracked: context.counters.track(ObjectKind::Mw),
            pd: Arc::clone(inner),
        }))
    }

    fn create_cq(&self, depth: u32) -> Result<Arc<dyn CompletionQueue>> {
        cq::create(&self.0.context, depth)
    }

    fn create_qp(&self, init: QpInit) -> Result<Arc<dyn QueuePair>> {
        qp::create(&self.0, init)
    }

    fn device_name(&self) -> &str {
        &self.0.context.name
    }
}

#[derive(Debug)]
struct VerbsMr {
    mr: NonNull<ibv_mr>,
    lkey: u32,
    rkey: u32,
    access: Access,
    span: Span,
    _tracked: Tracked,
    /// Unmapped only after deregistration (field drops follow `Drop::drop`).
    memory: Arc<SharedMemory>,
    pd: Arc<PdInner>,
}

// SAFETY: the MR is only passed to thread-safe verbs (module docs) and deregistered once,
// in `Drop`; its keys are copied out at registration.
unsafe impl Send for VerbsMr {}
// SAFETY: as for `Send`.
unsafe impl Sync for VerbsMr {}

impl MemoryRegion for VerbsMr {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn lkey(&self) -> u32 {
        self.lkey
    }
    fn rkey(&self) -> u32 {
        self.rkey
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

impl Drop for VerbsMr {
    fn drop(&mut self) {
        let context = &self.pd.context;
        if let Err(e) = dereg_mr(&context.name, self.mr) {
            // The kernel keeps the registration (and what is bound over it): so does rdmad.
            context.linger(
                LingeringHandle::Mr {
                    mr: self.mr,
                    _memory: Arc::clone(&self.memory),
                },
                Lingering::new(ObjectKind::Mr, self.lkey, self.memory.len() as u64, &e),
                &self.pd,
            );
        }
    }
}

#[derive(Debug)]
struct VerbsMw {
    mw: NonNull<ibv_mw>,
    kind: MwType,
    /// The rkey of the current binding; `qp::post_send` updates it (and the `ibv_mw`'s)
    /// when it posts a bind.
    rkey: AtomicU32,
    _tracked: Tracked,
    pd: Arc<PdInner>,
}

// SAFETY: the window is only passed to thread-safe verbs (module docs) and deallocated
// once, in `Drop`; its rkey is read through an atomic copy, never through the pointer.
unsafe impl Send for VerbsMw {}
// SAFETY: as for `Send`.
unsafe impl Sync for VerbsMw {}

impl MemoryWindow for VerbsMw {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn kind(&self) -> MwType {
        self.kind
    }
    fn rkey(&self) -> u32 {
        self.rkey.load(Ordering::Acquire)
    }
}

impl Drop for VerbsMw {
    fn drop(&mut self) {
        let context = &self.pd.context;
        if let Err(e) = dealloc_mw(&context.name, self.mw) {
            context.linger(
                LingeringHandle::Mw(self.mw),
                Lingering::new(ObjectKind::Mw, self.rkey(), 0, &e),
                &self.pd,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::conformance;
    use std::collections::HashMap;
    use std::path::Path;

    const RXE: &str = "rxe0";

    #[test]
    fn open_devices_without_kernel_support_reports_no_devices() {
        if Path::new("/sys/class/infiniband").exists() {
            let devices = open_devices().expect("the kernel has RDMA: devices must open");
            assert!(!devices.is_empty());
            assert!(devices.iter().all(|d| d.provider() == ProviderKind::Verbs));
        } else {
            match open_devices() {
                Err(ProviderError::NoDevices(reason)) => {
                    assert!(reason.contains("kernel"), "{reason}")
                }
                other => panic!("expected NoDevices without kernel RDMA, got {other:?}"),
            }
        }
    }

    #[test]
    fn decoders_match_ibv_devinfo_names() {
        assert_eq!(physical_state(5), "link_up");
        assert_eq!(physical_state(2), "polling");
        assert_eq!(physical_state(0), "unknown");
        assert_eq!(physical_state(9), "unknown");
        assert_eq!(link_layer(0), LinkLayer::Infiniband);
        assert_eq!(link_layer(2), LinkLayer::Ethernet);
        assert_eq!(port_state(4), PortState::Active);
        assert_eq!(
            c_chars_to_string(&[b'1' as _, b'.' as _, 0, b'x' as _]),
            "1."
        );
    }

    #[test]
    fn rxe_conformance() {
        let dev = open_device(RXE).expect("open rxe0");
        conformance::run_all(&dev);
        assert_eq!(dev.object_counts(), ObjectCounts::default());
    }

    #[test]
    fn rxe_open_devices_lists_rxe0() {
        let devices = open_devices().expect("open_devices");
        assert!(devices.iter().any(|d| d.name() == RXE), "{devices:?}");
    }

    #[test]
    fn rxe_open_unknown_device_is_no_devices() {
        match open_device("nonexistent9") {
            Err(ProviderError::NoDevices(reason)) => assert!(reason.contains(RXE), "{reason}"),
            other => panic!("expected NoDevices, got {other:?}"),
        }
    }

    /// `key: value` lines of `ibv_devinfo -v`, first occurrence of each key.
    fn devinfo_fields(text: &str) -> HashMap<String, String> {
        let mut fields = HashMap::new();
        for line in text.lines() {
            if let Some((key, value)) = line.trim().split_once(':') {
                fields
                    .entry(key.trim().to_owned())
                    .or_insert_with(|| value.trim().to_owned());
            }
        }
        fields
    }

    fn ibv_devinfo() -> String {
        let output = std::process::Command::new("ibv_devinfo")
            .args(["-d", RXE, "-v"])
            .output()
            .expect("run ibv_devinfo");
        assert!(output.status.success(), "{output:?}");
        String::from_utf8(output.stdout).unwrap()
    }

    /// The `GID[  1]: ::ffff:10.0.2.15, RoCE v2` lines of `ibv_devinfo -v` (tab-separated).
    fn devinfo_gids(text: &str) -> Vec<(u32, Ipv6Addr, String)> {
        let mut gids = Vec::new();
        for line in text.lines().map(str::trim) {
            let Some(rest) = line.strip_prefix("GID[") else {
                continue;
            };
            let (index, rest) = rest.split_once("]:").unwrap();
            let (gid, kind) = rest.trim().split_once(", ").unwrap();
            gids.push((
                index.trim().parse::<u32>().unwrap(),
                gid.parse::<Ipv6Addr>().unwrap(),
                kind.to_owned(),
            ));
        }
        gids
    }

    #[test]
    fn rxe_attributes_match_ibv_devinfo() {
        let text = ibv_devinfo();
        let f = devinfo_fields(&text);
        let first_word = |key: &str| -> String {
            f.get(key)
                .unwrap_or_else(|| panic!("{key} missing from ibv_devinfo:\n{text}"))
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned()
        };

        let dev = open_device(RXE).unwrap();
        let attrs = dev.attributes().unwrap();
        assert_eq!(attrs.node_guid_string(), first_word("node_guid"));
        assert_eq!(attrs.firmware_version, first_word("fw_ver"));
        assert_eq!(attrs.port_count.to_string(), first_word("phys_port_cnt"));
        assert_eq!(attrs.max_mr.to_string(), first_word("max_mr"));
        assert_eq!(attrs.max_mw.to_string(), first_word("max_mw"));
        assert_eq!(attrs.max_cqe.to_string(), first_word("max_cqe"));
        assert_eq!(
            format!("ATOMIC_{}", attrs.atomics.as_str().to_uppercase()),
            first_word("atomic_cap").replace("GLOB", "GLOBAL")
        );
        let caps = f.get("device_cap_flags").cloned().unwrap_or_default();
        let caps = u32::from_str_radix(caps.trim_start_matches("0x"), 16).unwrap();
        assert_eq!(attrs.mw_type1, caps & (1 << 17) != 0);
        assert_eq!(attrs.mw_type2b, caps & (1 << 24) != 0);

        let port = dev.query_port(1).unwrap();
        assert_eq!(
            format!("PORT_{}", port.state.as_str().to_uppercase()),
            first_word("state")
        );
        assert_eq!(port.active_mtu.to_string(), first_word("active_mtu"));
        assert_eq!(port.max_mtu.to_string(), first_word("max_mtu"));
        assert_eq!(port.physical_state, first_word("phys_state").to_lowercase());
        assert_eq!(
            port.link_layer.as_str(),
            first_word("link_layer").to_lowercase()
        );
        assert_eq!(port.lid.to_string(), first_word("port_lid"));
        assert_eq!(port.gid_table_len.to_string(), first_word("gid_tbl_len"));
    }

    #[test]
    fn rxe_gid_table_matches_ibv_devinfo() {
        // The guest's IPv6 autoconfiguration can add a GID at any moment (a site-local
        // address appears a few seconds after boot with qemu user networking): compare only
        // when our table is the same before and after ibv_devinfo ran.
        let dev = open_device(RXE).unwrap();
        let ours = || -> Vec<(u32, Ipv6Addr, String)> {
            dev.gid_table(1)
                .unwrap()
                .into_iter()
                .map(|g| (g.index, g.gid, g.gid_type.as_str().to_owned()))
                .collect()
        };
        for _ in 0..20 {
            let before = ours();
            let expected = devinfo_gids(&ibv_devinfo());
            let after = ours();
            if before == after {
                assert!(!expected.is_empty(), "no GIDs in ibv_devinfo");
                assert_eq!(after, expected);
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        panic!("the GID table of {RXE} never settled");
    }

    #[test]
    fn rxe_memory_windows_and_counts() {
        let dev = open_device(RXE).unwrap();
        let attrs = dev.attributes().unwrap();
        let pd = dev.alloc_pd().unwrap();
        let mw1 = pd.alloc_mw(MwType::Type1);
        assert_eq!(mw1.is_ok(), attrs.mw_type1, "{mw1:?}");
        let mw2 = pd.alloc_mw(MwType::Type2).expect("rxe has type-2 windows");
        assert_eq!(mw2.kind(), MwType::Type2);
        assert_eq!(dev.object_counts().mws, 1 + u64::from(attrs.mw_type1));
        // Windows keep the PD alive.
        drop(pd);
        assert_eq!(dev.object_counts().pds, 1);
        drop(mw1);
        drop(mw2);
        assert_eq!(dev.object_counts(), ObjectCounts::default());
    }

    #[test]
    fn rxe_full_access_registration_survives_out_of_order_drops() {
        // A 4 MiB registration with all local+remote rights, then dropped out of order.
        let dev = open_device(RXE).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let mem = Arc::new(SharedMemory::create(c"rxe", 4 << 20).unwrap());
        let access = Access::LOCAL_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_WRITE
            | Access::REMOTE_ATOMIC
            | Access::MW_BIND;
        let mr = pd.register(Arc::clone(&mem), access).unwrap();
        assert_eq!(mr.addr(), mem.addr());
        assert_eq!(mr.len(), 4 << 20);
        assert_ne!(mr.lkey(), 0);
        let device = dev.clone();
        drop(dev);
        drop(pd);
        drop(mr);
        assert_eq!(device.object_counts(), ObjectCounts::default());
    }
}
