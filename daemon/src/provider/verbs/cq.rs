//! Completion queues with a completion channel (`ibv_create_comp_channel` +
//! `ibv_create_cq`).
//!
//! Each CQ has its own channel, so every event read from the channel is for this CQ. The
//! channel's descriptor is non-blocking: the engine arms the CQ, waits for the descriptor in
//! its own event loop, then calls [`CompletionQueue::acknowledge_events`] (which reads and
//! acknowledges every pending event without blocking) and polls.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::os::raw::{c_int, c_uint, c_void};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys::{
    ibv_ack_cq_events, ibv_comp_channel, ibv_cq, ibv_create_comp_channel, ibv_create_cq,
    ibv_destroy_comp_channel, ibv_destroy_cq, ibv_get_cq_event, ibv_poll_cq, ibv_req_notify_cq,
    ibv_wc, ibv_wc_flags, ibv_wc_opcode, ibv_wc_status,
};

use super::{verb_error, DeviceContext};
use crate::provider::counters::Tracked;
use crate::provider::{
    CompletionQueue, ObjectKind, ProviderError, Result, WcOpcode, WcStatus, WorkCompletion,
};

/// How many completions one `ibv_poll_cq` call moves (a stack buffer).
const POLL_BATCH: usize = 16;

/// A CQ and its completion channel. Destroyed CQ first, then the channel.
#[derive(Debug)]
pub(super) struct VerbsCq {
    cq: NonNull<ibv_cq>,
    channel: NonNull<ibv_comp_channel>,
    fd: RawFd,
    _tracked: Tracked,
    /// Closed only after the CQ and channel are destroyed (field drops follow `Drop::drop`).
    context: Arc<DeviceContext>,
}

// SAFETY: the CQ and channel are only passed to libibverbs calls, which are thread safe
// (module docs of `verbs`); both are destroyed once, in `Drop`, when no `Arc` to this CQ is
// left (QPs using it hold one).
unsafe impl Send for VerbsCq {}
// SAFETY: as for `Send`; `&VerbsCq` gives no access to the pointees except through verbs.
unsafe impl Sync for VerbsCq {}

pub(super) fn create(context: &Arc<DeviceContext>, depth: u32) -> Result<Arc<dyn CompletionQueue>> {
    let name = &context.name;
    let cqe = c_int::try_from(depth)
        .ok()
        .filter(|&cqe| cqe > 0)
        .ok_or_else(|| ProviderError::invalid(name, format!("CQ depth {depth}")))?;
    // SAFETY: a live context; the channel is destroyed in `VerbsCq::drop` or just below if
    // creating the CQ fails.
    let channel = unsafe { ibv_create_comp_channel(context.ctx.as_ptr()) };
    let Some(channel) = NonNull::new(channel) else {
        return Err(ProviderError::last_os(name, "ibv_create_comp_channel"));
    };
    let destroy_channel = |channel: NonNull<ibv_comp_channel>| {
        // SAFETY: created above, no CQ uses it (creating the CQ failed), destroyed once.
        let rc = unsafe { ibv_destroy_comp_channel(channel.as_ptr()) };
        if rc != 0 {
            tracing::error!("{}", verb_error(name, "ibv_destroy_comp_channel", rc));
        }
    };
    // SAFETY: the channel is live; its `fd` field is set at creation and never changes.
    let fd = unsafe { (*channel.as_ptr()).fd };
    if let Err(error) = set_nonblocking(fd) {
        destroy_channel(channel);
        return Err(ProviderError::Os {
            device: name.clone(),
            operation: "fcntl(O_NONBLOCK) on the completion channel",
            source: error,
        });
    }
    // SAFETY: a live context and channel; no CQ context pointer; comp_vector 0 always
    // exists. The CQ is destroyed in `VerbsCq::drop`, before the channel.
    let cq = unsafe {
        ibv_create_cq(
            context.ctx.as_ptr(),
            cqe,
            ptr::null_mut(),
            channel.as_ptr(),
            0,
        )
    };
    let Some(cq) = NonNull::new(cq) else {
        let error = ProviderError::last_os(name, "ibv_create_cq");
        destroy_channel(channel);
        return Err(error);
    };
    Ok(Arc::new(VerbsCq {
        cq,
        channel,
        fd,
        _tracked: context.counters.track(ObjectKind::Cq),
        context: Arc::clone(context),
    }))
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: `fd` is the channel's open descriptor; F_GETFL takes no pointer.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above; F_SETFL takes an int.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl VerbsCq {
    /// The raw CQ, for creating QPs on it.
    pub(super) fn raw(&self) -> *mut ibv_cq {
        self.cq.as_ptr()
    }

    pub(super) fn context(&self) -> &Arc<DeviceContext> {
        &self.context
    }

    /// Reads every pending event from the channel (non-blocking) and acknowledges them.
    fn drain_events(&self) -> Result<u32> {
        let mut count: u32 = 0;
        let result = loop {
            let mut cq: *mut ibv_cq = ptr::null_mut();
            let mut cq_context: *mut c_void = ptr::null_mut();
            // SAFETY: a live channel and valid out-pointers; the descriptor is non-blocking,
            // so this returns -1/EAGAIN instead of sleeping when no event is pending.
            let rc = unsafe { ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut cq_context) };
            if rc == 0 {
                debug_assert_eq!(cq, self.cq.as_ptr(), "one CQ per channel");
                count += 1;
                continue;
            }
            let error = io::Error::last_os_error();
            match error.raw_os_error() {
                Some(libc::EAGAIN) => break Ok(()),
                Some(libc::EINTR) => continue,
                _ => {
                    break Err(ProviderError::Os {
                        device: self.context.name.clone(),
                        operation: "ibv_get_cq_event",
                        source: error,
                    })
                }
            }
        };
        if count > 0 {
            // SAFETY: a live CQ; exactly `count` events were read from its channel above
            // and not yet acknowledged.
            unsafe { ibv_ack_cq_events(self.cq.as_ptr(), count as c_uint) };
        }
        result.map(|()| count)
    }
}

/// `ibv_wc_status` as rdmad names it.
pub(super) fn wc_status(status: ibv_wc_status::Type) -> WcStatus {
    match status {
        ibv_wc_status::IBV_WC_SUCCESS => WcStatus::Success,
        ibv_wc_status::IBV_WC_LOC_LEN_ERR => WcStatus::LocalLengthError,
        ibv_wc_status::IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtectionError,
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlushError,
        ibv_wc_status::IBV_WC_MW_BIND_ERR => WcStatus::MemoryWindowBindError,
        ibv_wc_status::IBV_WC_REM_INV_REQ_ERR => WcStatus::RemoteInvalidRequestError,
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccessError,
        ibv_wc_status::IBV_WC_REM_OP_ERR => WcStatus::RemoteOperationError,
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        other => WcStatus::Other(other),
    }
}

/// `ibv_wc_opcode` as rdmad names it; `None` for opcodes an RC QP never reports.
pub(super) fn wc_opcode(opcode: ibv_wc_opcode::Type) -> Option<WcOpcode> {
    Some(match opcode {
        ibv_wc_opcode::IBV_WC_SEND => WcOpcode::Send,
        ibv_wc_opcode::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
        ibv_wc_opcode::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
        ibv_wc_opcode::IBV_WC_COMP_SWAP => WcOpcode::CompareSwap,
        ibv_wc_opcode::IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
        ibv_wc_opcode::IBV_WC_BIND_MW => WcOpcode::BindMw,
        ibv_wc_opcode::IBV_WC_LOCAL_INV => WcOpcode::LocalInvalidate,
        ibv_wc_opcode::IBV_WC_RECV => WcOpcode::Recv,
        ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
        _ => return None,
    })
}

/// Converts one polled `ibv_wc`.
fn work_completion(wc: &ibv_wc) -> WorkCompletion {
    let status = wc_status(wc.status);
    let opcode = wc_opcode(wc.opcode).unwrap_or_else(|| {
        // Only successful completions are guaranteed a valid opcode (`ibv_poll_cq(3)`);
        // receive opcodes have bit 7 set.
        if status == WcStatus::Success {
            tracing::warn!("unexpected completion opcode {}", wc.opcode);
        }
        if wc.opcode & ibv_wc_opcode::IBV_WC_RECV != 0 {
            WcOpcode::Recv
        } else {
            WcOpcode::Send
        }
    });
    let imm = (wc.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0).then(|| {
        // SAFETY: IBV_WC_WITH_IMM says the union holds the immediate data (every bit
        // pattern of a u32 is valid anyway).
        u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })
    });
    WorkCompletion {
        wr_id: wc.wr_id,
        status,
        opcode,
        byte_len: wc.byte_len,
        imm,
        qp_num: wc.qp_num,
    }
}

impl CompletionQueue for VerbsCq {
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize> {
        let mut total = 0;
        while total < max {
            let want = (max - total).min(POLL_BATCH);
            let mut wcs = [const { MaybeUninit::<ibv_wc>::uninit() }; POLL_BATCH];
            // SAFETY: a live CQ and room for `want` ≤ POLL_BATCH entries; the provider
            // writes the first `n` it returns.
            let n = unsafe { ibv_poll_cq(self.cq.as_ptr(), want as c_int, wcs[0].as_mut_ptr()) };
            if n < 0 {
                // ibv_poll_cq returns a negative value without a documented errno.
                return Err(ProviderError::Os {
                    device: self.context.name.clone(),
                    operation: "ibv_poll_cq",
                    source: io::Error::other(format!("ibv_poll_cq returned {n}")),
                });
            }
            let n = n as usize;
            for wc in &wcs[..n] {
                // SAFETY: the first `n` entries were written by `ibv_poll_cq`.
                out.push(work_completion(unsafe { wc.assume_init_ref() }));
            }
            total += n;
            if n < want {
                break;
            }
        }
        Ok(total)
    }

    fn arm(&self) -> Result<()> {
        // SAFETY: a live CQ; 0 = notify on any completion, not only solicited ones.
        let rc = unsafe { ibv_req_notify_cq(self.cq.as_ptr(), 0) };
        if rc != 0 {
            return Err(verb_error(&self.context.name, "ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    fn event_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: `fd` is the completion channel's descriptor, open until the channel is
        // destroyed in `Drop`, which the borrow (tied to `self`) cannot outlive.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd) }
    }

    fn acknowledge_events(&self) -> Result<u32> {
        self.drain_events()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for VerbsCq {
    fn drop(&mut self) {
        let name = &self.context.name;
        // `ibv_destroy_cq` waits until every event read from the channel is acknowledged;
        // `acknowledge_events` always acknowledges what it reads, but drain once more so a
        // pending event cannot make the destroy wait.
        if let Err(error) = self.drain_events() {
            tracing::warn!("{error}");
        }
        // SAFETY: created in `create`, destroyed only here; QPs using it hold an `Arc` to
        // this CQ, so none is left.
        let rc = unsafe { ibv_destroy_cq(self.cq.as_ptr()) };
        if rc != 0 {
            // The channel is still attached to the CQ: leak both rather than free a channel
            // a live CQ points to.
            tracing::error!(
                "{}; leaking its completion channel",
                verb_error(name, "ibv_destroy_cq", rc)
            );
            return;
        }
        // SAFETY: created in `create`; its only CQ was destroyed just above.
        let rc = unsafe { ibv_destroy_comp_channel(self.channel.as_ptr()) };
        if rc != 0 {
            tracing::error!("{}", verb_error(name, "ibv_destroy_comp_channel", rc));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_and_opcode_decoding() {
        assert_eq!(wc_status(0), WcStatus::Success);
        assert_eq!(wc_status(4), WcStatus::LocalProtectionError);
        assert_eq!(wc_status(5), WcStatus::WrFlushError);
        assert_eq!(wc_status(6), WcStatus::MemoryWindowBindError);
        assert_eq!(wc_status(10), WcStatus::RemoteAccessError);
        assert_eq!(wc_status(13), WcStatus::RnrRetryExceeded);
        assert_eq!(wc_status(2), WcStatus::Other(2));
        assert_eq!(wc_opcode(5), Some(WcOpcode::BindMw));
        assert_eq!(wc_opcode(6), Some(WcOpcode::LocalInvalidate));
        assert_eq!(wc_opcode(129), Some(WcOpcode::RecvRdmaWithImm));
        assert_eq!(wc_opcode(7), None);
    }
}
