//! Completion queues: a bounded queue of work completions plus a completion channel.
//!
//! The channel is a non-blocking pipe rather than an eventfd: the workspace builds `nix`
//! without its `event` feature, and a pipe gives the consumer the same contract (the
//! descriptor becomes readable when an armed CQ gets a completion; `acknowledge_events`
//! drains it and says how many events there were — one byte per event).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};

use std::sync::{Arc, Mutex, Weak};

use nix::fcntl::OFlag;

use super::qp::QpInner;
use super::{os_error, PdInner, MAX_CQ, MAX_CQE};
use crate::lock::lock;
use crate::provider::counters::Tracked;
use crate::provider::{CompletionQueue, ObjectKind, ProviderError, Result, WorkCompletion};

pub(super) fn create(pd: &Arc<PdInner>, depth: u32) -> Result<Arc<dyn CompletionQueue>> {
    let device = &pd.device;
    if depth == 0 || depth > MAX_CQE {
        // rxe_cq_chk_attr: cqe < 1 or > max_cqe is EINVAL.
        return Err(ProviderError::invalid(
            &device.name,
            format!("CQ depth {depth} is outside 1..={MAX_CQE}"),
        ));
    }
    if device.counters.snapshot().cqs >= u64::from(MAX_CQ) {
        return Err(os_error(&device.name, "ibv_create_cq", libc::ENOMEM));
    }
    let (read, write) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC).map_err(|e| {
        ProviderError::Os {
            device: device.name.clone(),
            operation: "ibv_create_comp_channel",
            source: e.into(),
        }
    })?;
    Ok(Arc::new(LoopbackCq {
        inner: Arc::new(CqInner {
            depth: depth as usize,
            queue: Mutex::default(),
            read: File::from(read),
            write: File::from(write),
        }),
        _tracked: device.counters.track(ObjectKind::Cq),
        pd: Arc::clone(pd),
    }))
}

#[derive(Debug)]
pub(super) struct LoopbackCq {
    pub(super) inner: Arc<CqInner>,
    _tracked: Tracked,
    pub(super) pd: Arc<PdInner>,
}

#[derive(Debug, Default)]
struct Queue {
    entries: VecDeque<WorkCompletion>,
    armed: bool,
    overflows: u64,
    /// QPs feeding this CQ whose send queue stopped at the end of a turn's budget with
    /// work left (see `qp::TURN_BYTES`): polling the CQ runs their next turn, as a software
    /// device's work progresses when its user polls. Held weakly and changed only under
    /// the execution lock, where a QP's handle takes it off the list before it goes.
    unfinished: Vec<Weak<QpInner>>,
}

#[derive(Debug)]
pub(super) struct CqInner {
    depth: usize,
    queue: Mutex<Queue>,
    read: File,
    write: File,
}

impl CqInner {
    /// Adds a completion; false (and the completion is lost) if the CQ is full — the
    /// caller then moves the QP that produced it to the error state, as a CQ overflow is a
    /// fatal error for the QPs feeding the CQ on real devices.
    pub(super) fn push(&self, wc: WorkCompletion) -> bool {
        let mut queue = lock(&self.queue);
        if queue.entries.len() >= self.depth {
            queue.overflows += 1;
            tracing::error!(
                "loopback CQ overflow (depth {}): completion {wc:?} lost",
                self.depth
            );
            return false;
        }
        queue.entries.push_back(wc);
        if queue.armed {
            queue.armed = false;
            // A full pipe is already readable: nothing is lost by ignoring EAGAIN.
            if let Err(e) = (&self.write).write(&[1]) {
                if e.kind() != ErrorKind::WouldBlock {
                    tracing::error!("loopback CQ: cannot signal the completion channel: {e}");
                }
            }
        }
        true
    }

    /// Asks the next poll to run `qp`'s next turn (under the execution lock).
    pub(super) fn continue_later(&self, qp: &Arc<QpInner>) {
        let mut queue = lock(&self.queue);
        if queue
            .unfinished
            .iter()
            .any(|w| w.as_ptr() == Arc::as_ptr(qp))
        {
            return;
        }
        queue.unfinished.push(Arc::downgrade(qp));
        // A poller asleep on the channel must come and run the next turn.
        if queue.armed {
            queue.armed = false;
            if let Err(e) = (&self.write).write(&[1]) {
                if e.kind() != ErrorKind::WouldBlock {
                    tracing::error!("loopback CQ: cannot signal the completion channel: {e}");
                }
            }
        }
    }

    /// The QPs whose next turn a poll is to run, taken off the list (under the execution
    /// lock, as every change of the list is made: see [`CqInner::forget`]). On the stack,
    /// so the list keeps its buffer: a stream of large requests (one unfinished turn per
    /// poll) allocates nothing here.
    pub(super) fn take_unfinished(&self) -> smallvec::SmallVec<[Weak<QpInner>; 8]> {
        lock(&self.queue).unfinished.drain(..).collect()
    }

    /// Takes `qp` off the list of unfinished QPs: its handle is going, and only a QP whose
    /// handle lives may be upgraded from the list (under the execution lock), so the last
    /// strong reference to a QP stays its handle's.
    pub(super) fn forget(&self, qp: &Arc<QpInner>) {
        lock(&self.queue)
            .unfinished
            .retain(|w| w.as_ptr() != Arc::as_ptr(qp));
    }

    /// How many completions were lost to overflow since the CQ was created.
    #[cfg(test)]
    pub(super) fn overflows(&self) -> u64 {
        lock(&self.queue).overflows
    }
}

impl CompletionQueue for LoopbackCq {
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize> {
        let mut queue = lock(&self.inner.queue);
        if !queue.unfinished.is_empty() {
            // The turns take this lock to complete their work.
            drop(queue);
            super::qp::run_turns(&self.pd.device, &self.inner);
            queue = lock(&self.inner.queue);
        }
        let n = max.min(queue.entries.len());
        out.extend(queue.entries.drain(..n));
        Ok(n)
    }

    fn needs_polling(&self) -> bool {
        !lock(&self.inner.queue).unfinished.is_empty()
    }

    fn arm(&self) -> Result<()> {
        // Like ibv_req_notify_cq: an event for the *next* completion; completions already
        // queued do not raise one (poll after arming).
        lock(&self.inner.queue).armed = true;
        Ok(())
    }

    fn event_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.inner.read)
    }

    fn acknowledge_events(&self) -> Result<u32> {
        let mut total = 0u32;
        let mut buf = [0u8; 64];
        loop {
            match (&self.inner.read).read(&mut buf) {
                Ok(0) => break,
                Ok(n) => total = total.saturating_add(n as u32),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(ProviderError::Os {
                        device: self.pd.device.name.clone(),
                        operation: "ibv_get_cq_event",
                        source: e,
                    })
                }
            }
        }
        Ok(total)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
