//! `ibv_reg_mr` of the program's own memory. rdmad registers only memory it owns (a
//! region's memfd), so registering a range re-backs its pages with a region: the pages'
//! contents are copied into a fresh region of rdmad's, and the region's memfd is mapped
//! over the range in one `mremap`, at the same addresses with the same protection. From
//! then on the program's buffer *is* the registered memory: no copy per work request.
//! `ibv_dereg_mr` puts private memory back the same way (contents kept). The method and its
//! limits are in docs/verbs.md.

use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Mutex;

use zbus::zvariant::OwnedObjectPath;

use super::registry::{self, lock, Context, Mr};
use super::remap;
use super::{set_errno, sys};
use crate::backend;
use crate::maps;

const PAGE: usize = 4096;

/// The pool registrations come from: `RDMAD_VERBS_POOL`, else `default`.
pub(super) fn pool() -> String {
    std::env::var("RDMAD_VERBS_POOL").unwrap_or_else(|_| "default".into())
}

/// A range of the program's pages re-backed by one rdmad region; several MRs within the
/// same pages share it.
struct Backing {
    start: usize,
    len: usize,
    /// Protection of the pages, as they were.
    prot: c_int,
    inode: u64,
    region: OwnedObjectPath,
    fd: OwnedFd,
    mrs: usize,
    /// The context whose session holds the region.
    context: usize,
}

static BACKINGS: Mutex<Vec<Backing>> = Mutex::new(Vec::new());

/// What a work request needs of an MR: the region behind it and where the MR lies in it.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    pub region: u64,
    /// Where the MR's first byte lies in the region.
    pub region_offset: u64,
    /// The address work requests name the MR's first byte by (its iova: the buffer's
    /// address unless `ibv_reg_mr_iova` said otherwise).
    pub iova: u64,
    pub length: u64,
    pub context: usize,
}

static KEYS: Mutex<Vec<(u32, Key)>> = Mutex::new(Vec::new());

/// The region and offset of `[addr, addr+length)` in the MR `lkey`, if that MR is the
/// context's and holds the whole range.
pub fn translate(context: usize, lkey: u32, addr: u64, length: u32) -> Option<(u64, u64)> {
    let keys = lock(&KEYS);
    let (_, k) = keys.iter().find(|(l, _)| *l == lkey)?;
    let end = addr.checked_add(u64::from(length))?;
    if k.context != context || addr < k.iova || end > k.iova + k.length {
        return None;
    }
    Some((k.region, k.region_offset + (addr - k.iova)))
}

/// rdmad's letters for the access flags of an MR (`Region.Register`'s `access`).
fn access_letters(access: c_uint) -> String {
    [
        (sys::ibv_access_flags_IBV_ACCESS_LOCAL_WRITE, 'l'),
        (sys::ibv_access_flags_IBV_ACCESS_REMOTE_READ, 'r'),
        (sys::ibv_access_flags_IBV_ACCESS_REMOTE_WRITE, 'w'),
        (sys::ibv_access_flags_IBV_ACCESS_REMOTE_ATOMIC, 'a'),
    ]
    .iter()
    .filter(|(flag, _)| access & flag != 0)
    .map(|(_, letter)| *letter)
    .collect()
}

fn read_maps() -> Result<Vec<maps::Mapping>, String> {
    std::fs::read_to_string("/proc/self/maps")
        .map(|t| maps::parse(&t))
        .map_err(|e| format!("cannot read /proc/self/maps: {e}"))
}

/// Re-backs `[start, start+len)` with the region's memfd, contents kept.
fn reback(start: usize, len: usize, prot: c_int, fd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: a new shared mapping of the region's memfd, `len` bytes (the region is at
    // least that large); only this function uses it until it is moved.
    let temp = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if temp == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `temp` is ours; the caller checked the range is the program's, private.
    unsafe { remap::copy_and_move(temp, start, len, prot) }?;
    // As with ibv_fork_init: a child does not inherit registered pages (it would share
    // them, being a shared mapping, rather than get a copy).
    // SAFETY: advice on the range just mapped.
    unsafe { libc::madvise(start as *mut c_void, len, libc::MADV_DONTFORK) };
    Ok(())
}

/// Puts private memory back under `[start, start+len)`, contents kept.
fn restore(start: usize, len: usize, prot: c_int) -> std::io::Result<()> {
    // SAFETY: a new private anonymous mapping of `len` bytes.
    let temp = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if temp == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `temp` is ours; the caller checked the range is still our backing.
    unsafe { remap::copy_and_move(temp, start, len, prot) }
}

fn fail(errno: i32, message: &str) -> *mut sys::ibv_mr {
    eprintln!("rdmad-verbs: ibv_reg_mr: {message}");
    set_errno(errno);
    std::ptr::null_mut()
}

/// The access flags rdmad registers with: the rest (on-demand paging, zero-based, …) is
/// refused as a device without them would.
const SUPPORTED_ACCESS: c_uint = sys::ibv_access_flags_IBV_ACCESS_LOCAL_WRITE
    | sys::ibv_access_flags_IBV_ACCESS_REMOTE_WRITE
    | sys::ibv_access_flags_IBV_ACCESS_REMOTE_READ
    | sys::ibv_access_flags_IBV_ACCESS_REMOTE_ATOMIC
    | sys::ibv_access_flags_IBV_ACCESS_MW_BIND
    | sys::ibv_access_flags_IBV_ACCESS_RELAXED_ORDERING;

fn reg_mr(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut sys::ibv_mr {
    let Some(pd_raw) = registry::pd(pd) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    if addr.is_null() || length == 0 {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    if access & !SUPPORTED_ACCESS != 0 {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    }
    let context_ptr = pd_raw.context as usize;
    let begin = addr as usize;
    let Some(end) = begin.checked_add(length) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    let start = begin & !(PAGE - 1);
    let stop = end.div_ceil(PAGE) * PAGE;
    let mut backings = lock(&BACKINGS);
    let shared = backings
        .iter()
        .position(|b| b.context == context_ptr && b.start <= start && stop <= b.start + b.len);
    if shared.is_none() {
        if let Some(b) = backings
            .iter()
            .find(|b| b.start < stop && start < b.start + b.len)
        {
            if b.context != context_ptr {
                return fail(
                    libc::EINVAL,
                    &format!(
                        "{begin:#x}..{end:#x} lies in pages registered through another device \
                         context ({:#x}..{:#x}): a buffer is registered through one context",
                        b.start,
                        b.start + b.len
                    ),
                );
            }
            return fail(
                libc::EINVAL,
                &format!(
                    "{begin:#x}..{end:#x} overlaps the pages of another registration \
                     ({:#x}..{:#x}) without lying inside them: register the larger range first",
                    b.start,
                    b.start + b.len
                ),
            );
        }
    }
    let index = match shared {
        Some(i) => i,
        None => {
            let maps = match read_maps() {
                Ok(m) => m,
                Err(e) => return fail(libc::EFAULT, &e),
            };
            let (write, exec) = match maps::private_range(&maps, start, stop) {
                Ok(p) => p,
                Err(e) => return fail(libc::EFAULT, &e),
            };
            let prot = libc::PROT_READ
                | if write { libc::PROT_WRITE } else { 0 }
                | if exec { libc::PROT_EXEC } else { 0 };
            // SAFETY: a live PD's context is a live context (close refuses while PDs live).
            let context = unsafe { &*(context_ptr as *const Context) };
            let backend = match backend::backend() {
                Ok(b) => b,
                Err(e) => return fail(libc::ECONNREFUSED, &e),
            };
            let len = stop - start;
            let (region, fd, _size) =
                match backend.allocate_region(&context.session, &pool(), len as u64) {
                    Ok(r) => r,
                    Err((memory, e)) => {
                        return fail(if memory { libc::ENOMEM } else { libc::EINVAL }, &e)
                    }
                };
            let inode = {
                // SAFETY: fstat of the region's memfd into a zeroed stat.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: as above; `st` is a valid out-pointer.
                if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0 {
                    st.st_ino
                } else {
                    0
                }
            };
            if let Err(e) = reback(start, len, prot, &fd) {
                let _ = backend.free_region(&region);
                return fail(
                    libc::EFAULT,
                    &format!("cannot re-back {start:#x}..{stop:#x}: {e}"),
                );
            }
            backings.push(Backing {
                start,
                len,
                prot,
                inode,
                region,
                fd,
                mrs: 0,
                context: context_ptr,
            });
            backings.len() - 1
        }
    };
    // The MR itself: a registration of its bytes of the region in the PD's domain, under
    // its iova and with its rights. Its rkey works through this PD's queue pairs only.
    let backing_start = backings[index].start;
    let region_offset = (begin - backing_start) as u64;
    let registered = match backend::backend() {
        Ok(b) => b
            .register(
                &backings[index].region,
                pd_raw.handle,
                (region_offset, length as u64, iova),
                &access_letters(access),
            )
            .map_err(|(quota, e)| (if quota { libc::ENOMEM } else { libc::EINVAL }, e)),
        Err(e) => Err((libc::ECONNREFUSED, e)),
    };
    let (registration, rkey) = match registered {
        Ok(r) => r,
        Err((errno, e)) => {
            if backings[index].mrs == 0 {
                // The backing was made for this MR: give it back.
                let b = backings.remove(index);
                drop(backings);
                release_backing(b);
            }
            return fail(errno, &e);
        }
    };
    backings[index].mrs += 1;
    let region = rdmad_client::names::object_id(backings[index].region.as_str()).unwrap_or(0);
    static NEXT_KEY: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let key = NEXT_KEY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    lock(&KEYS).push((
        key,
        Key {
            region,
            region_offset,
            iova,
            length: length as u64,
            context: context_ptr,
        },
    ));
    let mr = Box::into_raw(Box::new(Mr {
        raw: sys::ibv_mr {
            context: pd_raw.context,
            pd,
            addr,
            length: length as u64,
            handle: key,
            lkey: key,
            rkey,
        },
        backing_start,
        iova,
        access,
        registration,
    }));
    registry::add_mr(mr);
    // SAFETY: `mr` is the Box just made; `raw` is its first field.
    unsafe { &mut (*mr).raw }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_reg_mr(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut sys::ibv_mr {
    reg_mr(pd, addr, length, addr as u64, access as c_uint)
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_reg_mr_iova(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut sys::ibv_mr {
    reg_mr(pd, addr, length, iova, access as c_uint)
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_reg_mr_iova2(
    pd: *mut sys::ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut sys::ibv_mr {
    reg_mr(pd, addr, length, iova, access)
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_dereg_mr(mr: *mut sys::ibv_mr) -> c_int {
    if mr.is_null() || !registry::remove_mr(mr) {
        return libc::EINVAL;
    }
    // SAFETY: it was a registered MR (a `Box<Mr>`), now removed.
    let mr = unsafe { Box::from_raw(mr as *mut Mr) };
    lock(&KEYS).retain(|(k, _)| *k != mr.raw.lkey);
    let mut backings = lock(&BACKINGS);
    let Some(i) = backings.iter().position(|b| b.start == mr.backing_start) else {
        return 0;
    };
    // The rkey dies before the call returns (unless a request of the program's own that
    // uses the MR is still posted: then when that completes; docs/verbs.md).
    if let Ok(backend) = backend::backend() {
        if let Err(e) = backend.deregister(&backings[i].region, mr.registration) {
            eprintln!("rdmad-verbs: ibv_dereg_mr: {e}");
        }
    }
    backings[i].mrs -= 1;
    if backings[i].mrs > 0 {
        return 0;
    }
    let b = backings.remove(i);
    drop(backings);
    release_backing(b);
    0
}

/// Puts private memory back under a backing no MR uses any more (contents kept) and
/// frees its region.
fn release_backing(b: Backing) {
    // Private memory goes back only where the program still has our mapping: a range it
    // unmapped (or mapped something else over) is left alone.
    if read_maps().is_ok_and(|m| maps::still_backed(&m, b.start, b.start + b.len, b.inode)) {
        if let Err(e) = restore(b.start, b.len, b.prot) {
            eprintln!(
                "rdmad-verbs: ibv_dereg_mr: cannot put private memory back under {:#x}..{:#x} \
                 ({e}); it stays rdmad's shared memory, unregistered",
                b.start,
                b.start + b.len
            );
        }
    }
    if let Ok(backend) = backend::backend() {
        if let Err(e) = backend.free_region(&b.region) {
            eprintln!("rdmad-verbs: ibv_dereg_mr: {e}");
        }
    }
    drop(b.fd);
}

symver! {
    __rdmad_ibv_reg_mr => "ibv_reg_mr" @ "IBVERBS_1.1";
    __rdmad_ibv_reg_mr_iova => "ibv_reg_mr_iova" @ "IBVERBS_1.7";
    __rdmad_ibv_reg_mr_iova2 => "ibv_reg_mr_iova2" @ "IBVERBS_1.8";
    __rdmad_ibv_dereg_mr => "ibv_dereg_mr" @ "IBVERBS_1.1";
}
