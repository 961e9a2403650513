//! Completion channels and completion events: `ibv_create_comp_channel`,
//! `ibv_req_notify_cq`, `ibv_get_cq_event`, `ibv_ack_cq_events`.
//!
//! A channel's descriptor (`channel->fd`) is an epoll set holding the completion pipe of
//! every QP that completes into one of the channel's CQs, and an eventfd of the channel's
//! own: readable, to a program that polls or epolls it, whenever one of those QPs' rings
//! may hold a completion. Arming a CQ asks rdmad to write the pipes of its QPs' rings when
//! it delivers completions (the ring's need-wakeup flag); `ibv_get_cq_event` waits on the
//! set, then hands out an armed CQ of the channel that has a completion waiting, disarmed
//! — so a CQ gives one event per arming, as on a kernel device. Completions already there
//! when a CQ is armed raise an event at once (the library writes its own eventfd), so a
//! program that arms and then sleeps never misses one.

use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use super::queues::{self, data_path};
use super::registry::{self, CompChannel};
use super::{set_errno, sys};

/// The epoll datum of a channel's own eventfd (a QP's pipe is known by its descriptor).
const KICK: u64 = u64::MAX;

/// Makes a channel: its epoll set and its eventfd, the eventfd in the set.
fn channel_fds() -> std::io::Result<(OwnedFd, OwnedFd)> {
    // SAFETY: plain system calls; each returned descriptor is owned at once.
    unsafe {
        let epoll = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        if epoll < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let epoll = OwnedFd::from_raw_fd(epoll);
        let kick = libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK);
        if kick < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let kick = OwnedFd::from_raw_fd(kick);
        watch_fd(&epoll, kick.as_raw_fd(), KICK)?;
        Ok((epoll, kick))
    }
}

fn watch_fd(epoll: &OwnedFd, fd: c_int, data: u64) -> std::io::Result<()> {
    let mut event = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: data,
    };
    // SAFETY: both descriptors are live; `event` is a valid epoll_event.
    let rc = unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        // A QP whose two CQs share the channel is added once.
        if e.raw_os_error() != Some(libc::EEXIST) {
            return Err(e);
        }
    }
    Ok(())
}

/// The channel behind a pointer, if it is a live one of ours.
fn channel<'a>(ptr: *const sys::ibv_comp_channel) -> Option<&'a CompChannel> {
    if ptr.is_null() || !registry::is_channel(ptr) {
        return None;
    }
    // SAFETY: registered channels are `Box<CompChannel>`s whose `raw` is the first field,
    // live until `ibv_destroy_comp_channel` (which refuses while a CQ uses them); a program
    // that destroys a channel while another of its threads waits on it breaks libibverbs's
    // rules too, as for contexts.
    Some(unsafe { &*(ptr as *const CompChannel) })
}

/// Adds a QP's completion pipe to `channel`'s set (a QP created with a CQ on it).
pub fn watch(channel: *const sys::ibv_comp_channel, pipe: BorrowedFd<'_>) -> std::io::Result<()> {
    match self::channel(channel) {
        Some(c) => watch_fd(&c.epoll, pipe.as_raw_fd(), pipe.as_raw_fd() as u64),
        None => Ok(()),
    }
}

/// Makes `channel` readable: one of its CQs has completions the ring's pipe will not
/// announce (they were there before it was armed, or were moved to it from another CQ).
pub fn kick(channel: *const sys::ibv_comp_channel) {
    if let Some(c) = self::channel(channel) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes to the channel's own non-blocking eventfd (a full counter
        // already makes it readable, so EAGAIN loses nothing).
        unsafe { libc::write(c.kick.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_create_comp_channel(
    ctx: *mut sys::ibv_context,
) -> *mut sys::ibv_comp_channel {
    if ctx.is_null() || !registry::is_context(ctx) {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let (epoll, kick) = match channel_fds() {
        Ok(fds) => fds,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EMFILE));
            return std::ptr::null_mut();
        }
    };
    let channel = Box::into_raw(Box::new(CompChannel {
        raw: sys::ibv_comp_channel {
            context: ctx,
            fd: epoll.as_raw_fd(),
            refcnt: 0,
        },
        epoll,
        kick,
    }));
    registry::add_channel(channel);
    // SAFETY: `channel` is the Box just made; `raw` is its first field.
    unsafe { &mut (*channel).raw }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_destroy_comp_channel(
    channel: *mut sys::ibv_comp_channel,
) -> c_int {
    if self::channel(channel).is_none() {
        return libc::EINVAL;
    }
    if queues::channel_in_use(channel) {
        return libc::EBUSY;
    }
    if !registry::remove_channel(channel) {
        return libc::EINVAL;
    }
    // SAFETY: it was a registered channel (a `Box<CompChannel>`), now removed.
    drop(unsafe { Box::from_raw(channel as *mut CompChannel) });
    0
}

/// Arms a CQ: its next completion (or one already waiting) raises an event on its
/// channel. `solicited_only` is treated as any completion, which libibverbs allows.
pub unsafe extern "C" fn req_notify_cq(cq: *mut sys::ibv_cq, _solicited_only: c_int) -> c_int {
    let mut dp = data_path();
    let Some(ready) = dp.arm(cq) else {
        return libc::EINVAL;
    };
    // SAFETY: `cq` is a live CQ of ours (`arm` found it).
    let channel = unsafe { (*cq).channel };
    if ready {
        kick(channel);
    }
    0
}

/// Whether the descriptor is in non-blocking mode (a program may set `O_NONBLOCK` on
/// `channel->fd`, as libibverbs documents, and poll it).
fn nonblocking(fd: &OwnedFd) -> bool {
    // SAFETY: F_GETFL on a live descriptor.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    flags >= 0 && flags & libc::O_NONBLOCK != 0
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_get_cq_event(
    channel: *mut sys::ibv_comp_channel,
    cq: *mut *mut sys::ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    let Some(c) = self::channel(channel) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    if cq.is_null() || cq_context.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    let wait = if nonblocking(&c.epoll) { 0 } else { -1 };
    loop {
        if let Some((ready, context)) = data_path().take_event(channel) {
            // SAFETY: the caller passes somewhere to put the CQ and its context.
            unsafe {
                cq.write(ready);
                cq_context.write(context);
            }
            return 0;
        }
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
        // SAFETY: waits on the channel's live epoll set into `events` (16 entries).
        let n = unsafe {
            libc::epoll_wait(
                c.epoll.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as c_int,
                wait,
            )
        };
        if n < 0 {
            // EINTR included: the program's signal, as libibverbs's read would report it.
            return -1;
        }
        if n == 0 {
            set_errno(libc::EAGAIN);
            return -1;
        }
        for e in &events[..n as usize] {
            let data = e.u64;
            if data == KICK {
                let mut buf = [0u8; 8];
                // SAFETY: reads the channel's own non-blocking eventfd.
                unsafe { libc::read(c.kick.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
            } else if !data_path().drain(channel, data as c_int) {
                // Its QP is gone (or rdmad no longer serves it): stop watching it.
                // SAFETY: removes a descriptor from the channel's live epoll set.
                unsafe {
                    libc::epoll_ctl(
                        c.epoll.as_raw_fd(),
                        libc::EPOLL_CTL_DEL,
                        data as c_int,
                        std::ptr::null_mut(),
                    )
                };
            }
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_ack_cq_events(cq: *mut sys::ibv_cq, nevents: c_uint) {
    data_path().ack(cq, nevents);
}

symver! {
    __rdmad_ibv_create_comp_channel => "ibv_create_comp_channel" @ "IBVERBS_1.0";
    __rdmad_ibv_destroy_comp_channel => "ibv_destroy_comp_channel" @ "IBVERBS_1.0";
    __rdmad_ibv_get_cq_event => "ibv_get_cq_event" @ "IBVERBS_1.1";
    __rdmad_ibv_ack_cq_events => "ibv_ack_cq_events" @ "IBVERBS_1.1";
}
