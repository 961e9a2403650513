//! Devices, contexts, protection domains, completion channels and the helpers around them:
//! `ibv_get_device_list` … `ibv_close_device`, the queries, `ibv_alloc_pd`, the string and
//! rate helpers, fork and sysfs.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Once;

use super::registry::{self, lock, Context, Pd};
use super::{set_errno, sys};
use crate::backend::{self, DeviceInfo};
use crate::names;

/// Reports, once per process, why rdmad cannot be reached: a program that cannot list
/// devices usually prints only `strerror(errno)`.
fn unreachable(message: &str) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| eprintln!("rdmad-verbs: {message}"));
}

/// The context behind a pointer, if it is a live one of ours.
///
/// # Safety
/// A live context stays valid until `ibv_close_device`; a program that closes a context
/// while another thread uses it breaks libibverbs's rules too.
unsafe fn context<'a>(ptr: *const sys::ibv_context) -> Option<&'a Context> {
    if ptr.is_null() || !registry::is_context(ptr) {
        return None;
    }
    // SAFETY: registered contexts are `Box<Context>`s whose `raw` is the first field.
    Some(unsafe { &*(ptr as *const Context) })
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_get_device_list(num: *mut c_int) -> *mut *mut sys::ibv_device {
    let devices = match backend::backend().and_then(|b| b.devices()) {
        Ok(devices) => devices,
        Err(e) => {
            unreachable(&e);
            set_errno(libc::ECONNREFUSED);
            return std::ptr::null_mut();
        }
    };
    let n = devices.len();
    // SAFETY: a calloc of n+1 pointers; freed by `ibv_free_device_list` with `free`.
    let list = unsafe { libc::calloc(n + 1, std::mem::size_of::<*mut sys::ibv_device>()) }
        as *mut *mut sys::ibv_device;
    if list.is_null() {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    }
    for (i, info) in devices.into_iter().enumerate() {
        let device = registry::device(info);
        // SAFETY: i < n, within the allocation; the last slot stays null.
        unsafe { *list.add(i) = &device.raw as *const _ as *mut _ };
    }
    if !num.is_null() {
        // SAFETY: the caller passes a pointer to an int or NULL.
        unsafe { *num = n as c_int };
    }
    list
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_free_device_list(list: *mut *mut sys::ibv_device) {
    // SAFETY: `list` came from `ibv_get_device_list`'s calloc (or is NULL).
    unsafe { libc::free(list as *mut c_void) };
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_get_device_name(
    device: *mut sys::ibv_device,
) -> *const c_char {
    match registry::find_device(device) {
        Some(d) => d.raw.name.as_ptr(),
        None => {
            set_errno(libc::EINVAL);
            std::ptr::null()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_get_device_guid(device: *mut sys::ibv_device) -> u64 {
    match registry::find_device(device) {
        Some(d) => lock(&d.info).node_guid.to_be(),
        None => {
            set_errno(libc::EINVAL);
            0
        }
    }
}

/// rdmad's devices have no kernel device index a program could use.
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_get_device_index(_device: *mut sys::ibv_device) -> c_int {
    -1
}

fn pipe() -> Option<(OwnedFd, OwnedFd)> {
    nix_pipe().ok()
}

fn nix_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    use std::os::fd::FromRawFd;
    // SAFETY: pipe2 succeeded: both descriptors are new and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_open_device(
    device: *mut sys::ibv_device,
) -> *mut sys::ibv_context {
    let Some(device) = registry::find_device(device) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    let backend = match backend::backend() {
        Ok(b) => b,
        Err(e) => {
            unreachable(&e);
            set_errno(libc::ECONNREFUSED);
            return std::ptr::null_mut();
        }
    };
    let session = match backend.open_session() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("rdmad-verbs: cannot open {}: {e}", lock(&device.info).name);
            set_errno(libc::EPERM);
            return std::ptr::null_mut();
        }
    };
    let Some((async_read, async_events)) = pipe() else {
        let _ = backend.close_session(&session);
        set_errno(libc::EMFILE);
        return std::ptr::null_mut();
    };
    // The library never waits to post an event (a full pipe already holds 4096).
    // SAFETY: sets a flag on the pipe's write end, ours alone.
    unsafe { libc::fcntl(async_events.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
    let info: DeviceInfo = lock(&device.info).clone();
    let raw = sys::ibv_context {
        device: &device.raw as *const _ as *mut _,
        ops: super::queues::context_ops(),
        cmd_fd: -1,
        async_fd: async_read.as_raw_fd(),
        num_comp_vectors: 1,
        ..Default::default()
    };
    let context = Box::into_raw(Box::new(Context {
        raw,
        device,
        info,
        session,
        async_events,
        async_read,
    }));
    registry::add_context(context);
    // Once the context is live, so that an rdmad gone already tells it too.
    watch_daemon(backend);
    // SAFETY: `context` is the Box just made; `raw` is its first field.
    unsafe { &mut (*context).raw }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_close_device(ctx: *mut sys::ibv_context) -> c_int {
    if ctx.is_null() || !registry::is_context(ctx) {
        return libc::EINVAL;
    }
    // As the kernel does when a context's file is closed: whatever the program left is
    // released with it — queue pairs and CQs, then MRs (their pages become private memory
    // again, contents kept), PDs and channels — and the session closes.
    super::queues::release_context(ctx);
    for mr in registry::context_mrs(ctx) {
        // SAFETY: a live MR of this context.
        unsafe { super::memory::__rdmad_ibv_dereg_mr(mr) };
    }
    registry::release_context(ctx);
    if !registry::remove_context(ctx) {
        return libc::EINVAL;
    }
    // SAFETY: it was a registered context (a `Box<Context>`), now removed, so no other
    // call can reach it.
    let context = unsafe { Box::from_raw(ctx as *mut Context) };
    if let Ok(b) = backend::backend() {
        if let Err(e) = b.close_session(&context.session) {
            eprintln!("rdmad-verbs: {e}");
        }
    }
    0
}

fn fill_device_attr(info: &DeviceInfo, attr: &mut sys::ibv_device_attr) {
    *attr = sys::ibv_device_attr::default();
    let fw = info.firmware_version.as_bytes();
    for (d, s) in attr.fw_ver.iter_mut().zip(fw.iter().take(63)) {
        *d = *s as c_char;
    }
    attr.node_guid = info.node_guid.to_be();
    attr.sys_image_guid = info.node_guid.to_be();
    let c = &info.capabilities;
    let int = |v: u32| v.min(i32::MAX as u32) as c_int;
    attr.max_mr_size = c.max_mr_size;
    attr.page_size_cap = 0xffff_f000;
    attr.max_qp = int(c.max_qp);
    attr.max_qp_wr = int(c.max_qp_wr);
    attr.max_sge = int(c.max_sge);
    attr.max_sge_rd = int(c.max_sge);
    attr.max_cq = int(c.max_cq);
    attr.max_cqe = int(c.max_cqe);
    attr.max_mr = int(c.max_mr);
    attr.max_pd = int(c.max_pd);
    attr.max_qp_rd_atom = int(c.max_qp_rd_atom);
    attr.max_res_rd_atom = int(c.max_qp_rd_atom);
    attr.max_qp_init_rd_atom = int(c.max_qp_rd_atom);
    attr.max_mw = int(c.max_mw);
    attr.atomic_cap = match c.atomics.as_str() {
        "hca" => sys::ibv_atomic_cap_IBV_ATOMIC_HCA,
        "global" => sys::ibv_atomic_cap_IBV_ATOMIC_GLOB,
        _ => sys::ibv_atomic_cap_IBV_ATOMIC_NONE,
    };
    attr.max_pkeys = 1;
    attr.local_ca_ack_delay = 15;
    attr.phys_port_cnt = info.ports.iter().map(|p| p.port).max().unwrap_or(0);
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_query_device(
    ctx: *mut sys::ibv_context,
    attr: *mut sys::ibv_device_attr,
) -> c_int {
    // SAFETY: see `context`.
    let Some(context) = (unsafe { context(ctx) }) else {
        return libc::EINVAL;
    };
    if attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a `struct ibv_device_attr` to fill.
    fill_device_attr(&context.info, unsafe { &mut *attr });
    0
}

fn mtu(bytes: u32) -> sys::ibv_mtu {
    match bytes {
        256 => sys::ibv_mtu_IBV_MTU_256,
        512 => sys::ibv_mtu_IBV_MTU_512,
        1024 => sys::ibv_mtu_IBV_MTU_1024,
        2048 => sys::ibv_mtu_IBV_MTU_2048,
        _ => sys::ibv_mtu_IBV_MTU_4096,
    }
}

fn port_state(state: &str) -> sys::ibv_port_state {
    match state {
        "down" => sys::ibv_port_state_IBV_PORT_DOWN,
        "init" => sys::ibv_port_state_IBV_PORT_INIT,
        "armed" => sys::ibv_port_state_IBV_PORT_ARMED,
        "active" => sys::ibv_port_state_IBV_PORT_ACTIVE,
        "active_defer" => sys::ibv_port_state_IBV_PORT_ACTIVE_DEFER,
        _ => sys::ibv_port_state_IBV_PORT_NOP,
    }
}

fn physical_state(state: &str) -> u8 {
    match state {
        "sleep" => 1,
        "polling" => 2,
        "disabled" => 3,
        "port_configuration_training" => 4,
        "link_up" => 5,
        "link_error_recovery" => 6,
        "phy_test" => 7,
        _ => 0,
    }
}

/// GID table length of a port: one past its highest populated index (at least 1).
fn gid_table_len(info: &DeviceInfo, port: u8) -> c_int {
    info.gids
        .iter()
        .filter(|g| g.port == port)
        .map(|g| g.index as c_int + 1)
        .max()
        .unwrap_or(1)
}

/// `ibv_query_port` (exported for the inline `ibv_query_port` of `verbs.h`, which passes a
/// whole, zeroed `struct ibv_port_attr`).
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_query_port(
    ctx: *mut sys::ibv_context,
    port_num: u8,
    attr: *mut sys::ibv_port_attr,
) -> c_int {
    // SAFETY: see `context`.
    let Some(context) = (unsafe { context(ctx) }) else {
        return libc::EINVAL;
    };
    let Some(port) = context.info.ports.iter().find(|p| p.port == port_num) else {
        return libc::EINVAL;
    };
    if attr.is_null() {
        return libc::EINVAL;
    }
    let ethernet = port.link_layer == "ethernet";
    let value = sys::ibv_port_attr {
        state: port_state(&port.state),
        max_mtu: mtu(port.max_mtu),
        active_mtu: mtu(port.active_mtu),
        gid_tbl_len: gid_table_len(&context.info, port_num),
        port_cap_flags: 0,
        max_msg_sz: 1 << 31,
        pkey_tbl_len: 1,
        lid: port.lid,
        max_vl_num: 1,
        active_width: 1,
        active_speed: 1,
        phys_state: physical_state(&port.physical_state),
        link_layer: if ethernet {
            sys::IBV_LINK_LAYER_ETHERNET as u8
        } else {
            sys::IBV_LINK_LAYER_INFINIBAND as u8
        },
        ..Default::default()
    };
    // SAFETY: the caller passes a `struct ibv_port_attr` to fill (the struct of the
    // headers this library is built against; `_compat_ibv_port_attr` is the same).
    unsafe { attr.write(value) };
    0
}

/// The GID entry of (port, index): `None` if the port does not exist or the index is past
/// its table; `Some(None)` for an empty entry.
fn gid_entry(info: &DeviceInfo, port: u8, index: u32) -> Option<Option<sys::ibv_gid_entry>> {
    if !info.ports.iter().any(|p| p.port == port) || index as c_int >= gid_table_len(info, port) {
        return None;
    }
    let Some(g) = info
        .gids
        .iter()
        .find(|g| g.port == port && g.index == index)
    else {
        return Some(None);
    };
    let address: std::net::Ipv6Addr = g.gid.parse().ok()?;
    let mut gid = sys::ibv_gid::default();
    gid.raw = address.octets();
    Some(Some(sys::ibv_gid_entry {
        gid,
        gid_index: index,
        port_num: port as u32,
        gid_type: match g.gid_type.as_str() {
            "RoCE v2" => sys::ibv_gid_type_IBV_GID_TYPE_ROCE_V2,
            "RoCE v1" => sys::ibv_gid_type_IBV_GID_TYPE_ROCE_V1,
            _ => sys::ibv_gid_type_IBV_GID_TYPE_IB,
        },
        ndev_ifindex: 0,
    }))
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_query_gid(
    ctx: *mut sys::ibv_context,
    port_num: u8,
    index: c_int,
    gid: *mut sys::ibv_gid,
) -> c_int {
    // SAFETY: see `context`.
    let Some(context) = (unsafe { context(ctx) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    if gid.is_null() || index < 0 {
        set_errno(libc::EINVAL);
        return -1;
    }
    match gid_entry(&context.info, port_num, index as u32) {
        None => {
            set_errno(libc::EINVAL);
            -1
        }
        Some(entry) => {
            // SAFETY: the caller passes a `union ibv_gid` to fill.
            unsafe { gid.write(entry.map(|e| e.gid).unwrap_or_default()) };
            0
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_query_gid_type(
    ctx: *mut sys::ibv_context,
    port_num: u8,
    index: c_uint,
    gid_type: *mut c_uint,
) -> c_int {
    // SAFETY: see `context`.
    let Some(context) = (unsafe { context(ctx) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    if gid_type.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    match gid_entry(&context.info, port_num, index) {
        None => {
            set_errno(libc::EINVAL);
            -1
        }
        Some(entry) => {
            let roce_v2 =
                entry.is_some_and(|e| e.gid_type == sys::ibv_gid_type_IBV_GID_TYPE_ROCE_V2);
            // IBV_GID_TYPE_SYSFS_ROCE_V2 = 1, IBV_GID_TYPE_SYSFS_IB_ROCE_V1 = 0.
            // SAFETY: the caller passes an `enum ibv_gid_type_sysfs` to fill.
            unsafe { gid_type.write(u32::from(roce_v2)) };
            0
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_query_gid_ex(
    ctx: *mut sys::ibv_context,
    port_num: u32,
    gid_index: u32,
    entry: *mut sys::ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    // SAFETY: see `context`.
    let Some(context) = (unsafe { context(ctx) }) else {
        return libc::EINVAL;
    };
    if flags != 0 || entry.is_null() || entry_size < std::mem::size_of::<sys::ibv_gid_entry>() {
        return libc::EINVAL;
    }
    let Ok(port) = u8::try_from(port_num) else {
        return libc::EINVAL;
    };
    match gid_entry(&context.info, port, gid_index) {
        None => libc::EINVAL,
        Some(None) => libc::ENODATA,
        Some(Some(e)) => {
            // SAFETY: the caller passes at least `entry_size` ≥ sizeof(entry) bytes.
            unsafe { entry.write(e) };
            0
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_query_gid_table(
    ctx: *mut sys::ibv_context,
    entries: *mut sys::ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    // SAFETY: see `context`.
    let Some(context) = (unsafe { context(ctx) }) else {
        return -(libc::EINVAL as isize);
    };
    if flags != 0 || entry_size < std::mem::size_of::<sys::ibv_gid_entry>() {
        return -(libc::EINVAL as isize);
    }
    let mut found = Vec::new();
    for g in &context.info.gids {
        if let Some(Some(e)) = gid_entry(&context.info, g.port, g.index) {
            found.push(e);
        }
    }
    if found.len() > max_entries || (entries.is_null() && !found.is_empty()) {
        return -(libc::EINVAL as isize);
    }
    for (i, e) in found.iter().enumerate() {
        // SAFETY: i < max_entries, and each entry is `entry_size` bytes apart.
        unsafe {
            (entries as *mut u8)
                .add(i * entry_size)
                .cast::<sys::ibv_gid_entry>()
                .write_unaligned(*e)
        };
    }
    found.len() as isize
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_query_pkey(
    ctx: *mut sys::ibv_context,
    port_num: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    // SAFETY: see `context`.
    let Some(context) = (unsafe { context(ctx) }) else {
        return -1;
    };
    if index != 0 || pkey.is_null() || !context.info.ports.iter().any(|p| p.port == port_num) {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller passes a `__be16` to fill; the default P_Key.
    unsafe { pkey.write(0xffff) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_get_pkey_index(
    ctx: *mut sys::ibv_context,
    port_num: u8,
    pkey: u16,
) -> c_int {
    // SAFETY: see `context`.
    let Some(context) = (unsafe { context(ctx) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    if pkey == 0xffff && context.info.ports.iter().any(|p| p.port == port_num) {
        0
    } else {
        set_errno(libc::ENOENT);
        -1
    }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_alloc_pd(ctx: *mut sys::ibv_context) -> *mut sys::ibv_pd {
    // SAFETY: see `context`.
    if unsafe { context(ctx) }.is_none() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    static HANDLES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let pd = Box::into_raw(Box::new(Pd {
        raw: sys::ibv_pd {
            context: ctx,
            handle: HANDLES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        },
    }));
    registry::add_pd(pd);
    // SAFETY: `pd` is the Box just made; `raw` is its first field.
    unsafe { &mut (*pd).raw }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_dealloc_pd(pd: *mut sys::ibv_pd) -> c_int {
    if pd.is_null() {
        return libc::EINVAL;
    }
    if super::queues::pd_has_queues(pd) {
        return libc::EBUSY;
    }
    if let Err(e) = registry::remove_pd(pd) {
        return e;
    }
    // SAFETY: it was a registered PD (a `Box<Pd>`), now removed.
    drop(unsafe { Box::from_raw(pd as *mut Pd) });
    0
}

/// Posts `IBV_EVENT_DEVICE_FATAL` to every open context once the rdmad instance that
/// serves them leaves the bus (stopped, crashed, restarted): everything it lent is gone,
/// as a device that died takes its contexts' objects with it. One watch at a time, from
/// the first context opened while none runs: contexts a program opens on a restarted
/// rdmad are watched again.
fn watch_daemon(backend: &backend::Backend) {
    use std::sync::atomic::{AtomicBool, Ordering};
    static WATCHING: AtomicBool = AtomicBool::new(false);
    if WATCHING.swap(true, Ordering::AcqRel) {
        return;
    }
    backend.watch_daemon(|gone| {
        WATCHING.store(false, Ordering::Release);
        eprintln!("rdmad-verbs: {gone}");
        registry::for_each_context(|c| {
            post_async_event(c, sys::ibv_event_type_IBV_EVENT_DEVICE_FATAL, 0)
        });
    });
}

/// Posts an async event to a context (`ibv_get_async_event` reads it).
pub fn post_async_event(context: &Context, event_type: sys::ibv_event_type, element: u64) {
    let record = registry::AsyncRecord {
        event_type,
        _pad: 0,
        element,
    };
    // SAFETY: writes the 16 bytes of `record` to the context's own non-blocking pipe; a
    // full pipe (4096 events unread) drops it, which only a program that never reads its
    // events can cause.
    unsafe {
        libc::write(
            context.async_events.as_raw_fd(),
            (&record as *const registry::AsyncRecord).cast(),
            std::mem::size_of::<registry::AsyncRecord>(),
        )
    };
}

/// Blocks until the context has an async event (or, if the program made `async_fd`
/// non-blocking, fails with `EAGAIN` when there is none). The events posted:
/// `IBV_EVENT_DEVICE_FATAL` when rdmad leaves the bus.
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_get_async_event(
    ctx: *mut sys::ibv_context,
    event: *mut sys::ibv_async_event,
) -> c_int {
    // SAFETY: see `context`.
    let Some(context) = (unsafe { context(ctx) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    if event.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    let mut record = registry::AsyncRecord::default();
    let size = std::mem::size_of::<registry::AsyncRecord>();
    // SAFETY: reads one record into `record` from the context's own pipe (blocking unless
    // the program made `async_fd` non-blocking, as libibverbs allows); records are written
    // whole, so a read gets one whole.
    let n = unsafe {
        libc::read(
            context.async_read.as_raw_fd(),
            (&mut record as *mut registry::AsyncRecord).cast(),
            size,
        )
    };
    if n != size as isize {
        if n >= 0 {
            set_errno(libc::EIO);
        }
        return -1;
    }
    let mut out = sys::ibv_async_event {
        event_type: record.event_type,
        ..Default::default()
    };
    out.element.cq = record.element as *mut sys::ibv_cq;
    // SAFETY: the caller passes a `struct ibv_async_event` to fill.
    unsafe { event.write(out) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_ack_async_event(_event: *mut sys::ibv_async_event) {}

static FORK_INIT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_fork_init() -> c_int {
    FORK_INIT.store(true, std::sync::atomic::Ordering::Relaxed);
    0
}

/// `enum ibv_fork_status`: IBV_FORK_DISABLED = 0, IBV_FORK_ENABLED = 1.
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_is_fork_initialized() -> c_uint {
    u32::from(FORK_INIT.load(std::sync::atomic::Ordering::Relaxed))
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// Reads `dir/file` into `buf` (NUL-terminated, a trailing newline dropped); returns its
/// length or −1, as libibverbs does.
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller passes NUL-terminated strings.
    let (dir, file) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
    use std::os::unix::ffi::OsStrExt;
    let path = std::path::Path::new(std::ffi::OsStr::from_bytes(dir.to_bytes()))
        .join(std::ffi::OsStr::from_bytes(file.to_bytes()));
    let Ok(mut text) = std::fs::read(&path) else {
        return -1;
    };
    if text.last() == Some(&b'\n') {
        text.pop();
    }
    let n = text.len().min(size - 1);
    // SAFETY: `buf` has `size` bytes; n + 1 ≤ size.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, n);
        *buf.add(n) = 0;
    }
    n as c_int
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_node_type_str(value: c_int) -> *const c_char {
    names::node_type(value).as_ptr()
}
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_port_state_str(value: c_uint) -> *const c_char {
    names::port_state(value).as_ptr()
}
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_event_type_str(value: c_uint) -> *const c_char {
    names::event_type(value).as_ptr()
}
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_wc_status_str(value: c_uint) -> *const c_char {
    names::wc_status(value).as_ptr()
}
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_rate_to_mult(rate: c_int) -> c_int {
    names::rate_to_mult(rate)
}
#[no_mangle]
pub unsafe extern "C" fn __rdmad_mult_to_ibv_rate(mult: c_int) -> c_int {
    names::mult_to_rate(mult)
}
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_rate_to_mbps(rate: c_int) -> c_int {
    names::rate_to_mbps(rate)
}
#[no_mangle]
pub unsafe extern "C" fn __rdmad_mbps_to_ibv_rate(mbps: c_int) -> c_int {
    names::mbps_to_rate(mbps)
}

symver! {
    __rdmad_ibv_get_device_list => "ibv_get_device_list" @ "IBVERBS_1.1";
    __rdmad_ibv_free_device_list => "ibv_free_device_list" @ "IBVERBS_1.1";
    __rdmad_ibv_get_device_name => "ibv_get_device_name" @ "IBVERBS_1.1";
    __rdmad_ibv_get_device_guid => "ibv_get_device_guid" @ "IBVERBS_1.1";
    __rdmad_ibv_get_device_index => "ibv_get_device_index" @ "IBVERBS_1.9";
    __rdmad_ibv_open_device => "ibv_open_device" @ "IBVERBS_1.1";
    __rdmad_ibv_close_device => "ibv_close_device" @ "IBVERBS_1.1";
    __rdmad_ibv_query_device => "ibv_query_device" @ "IBVERBS_1.1";
    __rdmad_ibv_query_port => "ibv_query_port" @ "IBVERBS_1.1";
    __rdmad_ibv_query_gid => "ibv_query_gid" @ "IBVERBS_1.1";
    __rdmad_ibv_query_gid_type => "ibv_query_gid_type" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_query_gid_ex => "_ibv_query_gid_ex" @ "IBVERBS_1.11";
    __rdmad_ibv_query_gid_table => "_ibv_query_gid_table" @ "IBVERBS_1.11";
    __rdmad_ibv_query_pkey => "ibv_query_pkey" @ "IBVERBS_1.1";
    __rdmad_ibv_get_pkey_index => "ibv_get_pkey_index" @ "IBVERBS_1.5";
    __rdmad_ibv_alloc_pd => "ibv_alloc_pd" @ "IBVERBS_1.1";
    __rdmad_ibv_dealloc_pd => "ibv_dealloc_pd" @ "IBVERBS_1.1";
    __rdmad_ibv_get_async_event => "ibv_get_async_event" @ "IBVERBS_1.1";
    __rdmad_ibv_ack_async_event => "ibv_ack_async_event" @ "IBVERBS_1.1";
    __rdmad_ibv_fork_init => "ibv_fork_init" @ "IBVERBS_1.1";
    __rdmad_ibv_is_fork_initialized => "ibv_is_fork_initialized" @ "IBVERBS_1.13";
    __rdmad_ibv_dontfork_range => "ibv_dontfork_range" @ "IBVERBS_1.1";
    __rdmad_ibv_dofork_range => "ibv_dofork_range" @ "IBVERBS_1.1";
    __rdmad_ibv_get_sysfs_path => "ibv_get_sysfs_path" @ "IBVERBS_1.0";
    __rdmad_ibv_read_sysfs_file => "ibv_read_sysfs_file" @ "IBVERBS_1.0";
    __rdmad_ibv_node_type_str => "ibv_node_type_str" @ "IBVERBS_1.1";
    __rdmad_ibv_port_state_str => "ibv_port_state_str" @ "IBVERBS_1.1";
    __rdmad_ibv_event_type_str => "ibv_event_type_str" @ "IBVERBS_1.1";
    __rdmad_ibv_wc_status_str => "ibv_wc_status_str" @ "IBVERBS_1.1";
    __rdmad_ibv_rate_to_mult => "ibv_rate_to_mult" @ "IBVERBS_1.0";
    __rdmad_mult_to_ibv_rate => "mult_to_ibv_rate" @ "IBVERBS_1.0";
    __rdmad_ibv_rate_to_mbps => "ibv_rate_to_mbps" @ "IBVERBS_1.1";
    __rdmad_mbps_to_ibv_rate => "mbps_to_ibv_rate" @ "IBVERBS_1.1";
}
