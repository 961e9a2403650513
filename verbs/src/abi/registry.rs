//! What the library made and has not freed, so that a pointer a program passes is used
//! only if it is one of ours: devices (made once per process and never freed, as
//! libibverbs keeps them), contexts and protection domains.

use std::collections::HashSet;
use std::sync::{Mutex, MutexGuard};

use super::sys;
use crate::backend::DeviceInfo;

/// A device as a program sees it. `raw` comes first, so a `*mut ibv_device` is a
/// `*mut Device`.
#[repr(C)]
pub struct Device {
    pub raw: sys::ibv_device,
    /// Zeroed room standing for the rest of rdma-core's `struct verbs_device` (its provider
    /// ops pointer first): provider libraries linked into a program (libmlx5, libefa) read
    /// it to tell whether a device is theirs, and a null ops pointer says it is not.
    verbs_device_tail: [usize; 16],
    pub info: Mutex<DeviceInfo>,
}

/// An open device: the context a program holds, and the rdmad session behind it.
#[repr(C)]
pub struct Context {
    pub raw: sys::ibv_context,
    pub device: &'static Device,
    pub info: DeviceInfo,
    pub session: zbus::zvariant::OwnedObjectPath,
    /// The write end (non-blocking) of the pipe whose read end is `raw.async_fd`: async
    /// events are written here, one [`AsyncRecord`] each.
    pub async_events: std::os::fd::OwnedFd,
    pub async_read: std::os::fd::OwnedFd,
}

/// A protection domain. Its `handle` (unique in the process) is the number of its domain
/// in the context's rdmad session: its MRs are registered there and its QPs made there,
/// so an MR's rkey works through this PD's QPs only.
#[repr(C)]
pub struct Pd {
    pub raw: sys::ibv_pd,
}

/// A registration: `raw` as the program sees it, and the re-backed pages it lies in
/// (`memory.rs`).
#[repr(C)]
pub struct Mr {
    pub raw: sys::ibv_mr,
    pub backing_start: usize,
    /// The address the MR's first byte has for work requests (`ibv_reg_mr_iova`).
    pub iova: u64,
    pub access: u32,
    /// Its registration in rdmad (`Region.Register` of the backing's region, in the
    /// PD's domain), which its rkey belongs to.
    pub registration: u64,
}

/// A completion channel: `raw.fd` is `epoll`, a set holding the completion pipes of the
/// QPs of the channel's CQs and `kick` (see `events.rs`).
/// An async event as it travels through a context's pipe: written whole (16 bytes, less
/// than `PIPE_BUF`, so atomically), read whole by `ibv_get_async_event`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AsyncRecord {
    pub event_type: u32,
    pub _pad: u32,
    /// The object it concerns (a CQ or QP pointer), or 0.
    pub element: u64,
}

#[repr(C)]
pub struct CompChannel {
    pub raw: sys::ibv_comp_channel,
    pub epoll: std::os::fd::OwnedFd,
    pub kick: std::os::fd::OwnedFd,
}

// SAFETY: a device's raw structure holds no pointers the library follows (only names and
// the never-called legacy ops, all null); its info is behind a mutex. Devices are never
// freed, so sharing references across threads is sound.
unsafe impl Sync for Device {}
// SAFETY: as for `Sync`: nothing in a device is tied to the thread that made it.
unsafe impl Send for Device {}

/// Live objects by address.
#[derive(Default)]
struct Live {
    devices: Vec<&'static Device>,
    contexts: HashSet<usize>,
    pds: HashSet<usize>,
    channels: HashSet<usize>,
    mrs: HashSet<usize>,
}

static LIVE: Mutex<Option<Live>> = Mutex::new(None);

fn live() -> MutexGuard<'static, Option<Live>> {
    LIVE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn with<T>(f: impl FnOnce(&mut Live) -> T) -> T {
    let mut guard = live();
    f(guard.get_or_insert_with(Live::default))
}

fn copy_name(dst: &mut [std::ffi::c_char], src: &str) {
    dst.fill(0);
    let room = dst.len() - 1;
    for (d, s) in dst.iter_mut().zip(src.bytes().take(room)) {
        *d = s as std::ffi::c_char;
    }
}

/// The device for `info.name`, made on first sight and updated with `info` after.
pub fn device(info: DeviceInfo) -> &'static Device {
    with(|live| {
        if let Some(d) = live
            .devices
            .iter()
            .find(|d| lock(&d.info).name == info.name)
        {
            *lock(&d.info) = info;
            return *d;
        }
        let mut raw = sys::ibv_device {
            node_type: sys::ibv_node_type_IBV_NODE_CA,
            transport_type: sys::ibv_transport_type_IBV_TRANSPORT_IB,
            ..Default::default()
        };
        copy_name(&mut raw.name, &info.name);
        copy_name(&mut raw.dev_name, &format!("rdmad-{}", info.name));
        if info.provider == "verbs" {
            // Where the kernel device's attributes are (ibv_devinfo reads board_id there).
            copy_name(
                &mut raw.ibdev_path,
                &format!("/sys/class/infiniband/{}", info.name),
            );
        }
        let device: &'static Device = Box::leak(Box::new(Device {
            raw,
            verbs_device_tail: [0; 16],
            info: Mutex::new(info),
        }));
        live.devices.push(device);
        device
    })
}

/// The device behind a pointer a program passed, if it is one of ours.
pub fn find_device(ptr: *const sys::ibv_device) -> Option<&'static Device> {
    with(|live| {
        live.devices
            .iter()
            .find(|d| std::ptr::eq(&d.raw, ptr))
            .copied()
    })
}

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Records a live object of one kind.
pub fn add_context(ptr: *mut Context) {
    with(|live| live.contexts.insert(ptr as usize));
}
/// Calls `f` on every live context, with the registry locked: a context closed
/// meanwhile waits (`ibv_close_device` forgets a context before it frees it).
pub fn for_each_context(mut f: impl FnMut(&Context)) {
    with(|live| {
        for &ptr in &live.contexts {
            // SAFETY: addresses in `contexts` are live `Box<Context>`s, and none is freed
            // while the registry is locked.
            f(unsafe { &*(ptr as *const Context) });
        }
    })
}
pub fn is_context(ptr: *const sys::ibv_context) -> bool {
    with(|live| live.contexts.contains(&(ptr as usize)))
}
/// Forgets a context; false if it was not live (a double close, a stranger's pointer).
pub fn remove_context(ptr: *const sys::ibv_context) -> bool {
    with(|live| live.contexts.remove(&(ptr as usize)))
}
/// The live objects of one kind that belong to the context.
fn owned(set: &HashSet<usize>, ctx: *const sys::ibv_context) -> Vec<usize> {
    set.iter()
        .copied()
        .filter(|&p| {
            // SAFETY: every address in `pds`, `channels` and `mrs` is a live `Pd`,
            // `CompChannel` or `Mr` (removed before it is freed); each begins with its
            // context pointer.
            let owner = unsafe { *(p as *const *const sys::ibv_context) };
            std::ptr::eq(owner, ctx)
        })
        .collect()
}

/// The context's live MRs.
pub fn context_mrs(ctx: *const sys::ibv_context) -> Vec<*mut sys::ibv_mr> {
    with(|live| {
        owned(&live.mrs, ctx)
            .into_iter()
            .map(|p| p as *mut sys::ibv_mr)
            .collect()
    })
}

/// Forgets and frees the context's PDs and completion channels (`ibv_close_device`, after
/// its MRs and queues are gone).
pub fn release_context(ctx: *const sys::ibv_context) {
    let (pds, channels) = with(|live| {
        let pds = owned(&live.pds, ctx);
        let channels = owned(&live.channels, ctx);
        for p in &pds {
            live.pds.remove(p);
        }
        for c in &channels {
            live.channels.remove(c);
        }
        (pds, channels)
    });
    for p in pds {
        // SAFETY: a registered PD (a `Box<Pd>`), now removed.
        drop(unsafe { Box::from_raw(p as *mut Pd) });
    }
    for c in channels {
        // SAFETY: a registered channel (a `Box<CompChannel>`), now removed.
        drop(unsafe { Box::from_raw(c as *mut CompChannel) });
    }
}

pub fn add_pd(ptr: *mut Pd) {
    with(|live| live.pds.insert(ptr as usize));
}
/// The PD behind a pointer, if it is a live one of ours.
pub fn pd<'a>(ptr: *const sys::ibv_pd) -> Option<&'a sys::ibv_pd> {
    if ptr.is_null() || !with(|live| live.pds.contains(&(ptr as usize))) {
        return None;
    }
    // SAFETY: registered PDs are `Box<Pd>`s whose `raw` is the first field, live until
    // `ibv_dealloc_pd` (which refuses while MRs use them).
    Some(unsafe { &*ptr })
}
/// Forgets a PD; `Err(EBUSY)` while MRs use it, `Err(EINVAL)` if it is not ours.
pub fn remove_pd(ptr: *const sys::ibv_pd) -> Result<(), i32> {
    with(|live| {
        if !live.pds.contains(&(ptr as usize)) {
            return Err(libc::EINVAL);
        }
        let in_use = live.mrs.iter().any(|&m| {
            // SAFETY: addresses in `mrs` are live `Mr`s.
            let mr = unsafe { &*(m as *const sys::ibv_mr) };
            std::ptr::eq(mr.pd, ptr)
        });
        if in_use {
            return Err(libc::EBUSY);
        }
        live.pds.remove(&(ptr as usize));
        Ok(())
    })
}
pub fn add_mr(ptr: *mut Mr) {
    with(|live| live.mrs.insert(ptr as usize));
}
pub fn remove_mr(ptr: *const sys::ibv_mr) -> bool {
    with(|live| live.mrs.remove(&(ptr as usize)))
}
pub fn add_channel(ptr: *mut CompChannel) {
    with(|live| live.channels.insert(ptr as usize));
}
pub fn is_channel(ptr: *const sys::ibv_comp_channel) -> bool {
    with(|live| live.channels.contains(&(ptr as usize)))
}
pub fn remove_channel(ptr: *const sys::ibv_comp_channel) -> bool {
    with(|live| live.channels.remove(&(ptr as usize)))
}
