//! RC queue pairs and the data path: the requester and responder sides of every operation,
//! run under the device's execution lock (see the module documentation of `loopback`).
//!
//! Work runs in *turns*: one run of a send queue moves at most [`TURN_BYTES`] (each request
//! costing at least [`REQUEST_COST`]), then lets go of the execution lock; a request larger
//! than that moves on a chunk per turn, its progress kept at the head of the queue. The
//! next turn comes when the CQ the QP feeds is polled, as a software device progresses when
//! its user polls; a post runs the queue too (a post of receives its peer's as well). So no
//! request, however large, holds the device (and every other QP on it) for longer than one
//! chunk's copy, and a worker's pass, which posts a QP's new requests and polls its CQ once,
//! runs its queue at most four times: when it posts sends, when it posts receives, when it
//! polls, and when the peer's receives are posted.
//!
//! What rxe does, and what is done here:
//! - Responder checks run in rxe's order: QP state → opcode allowed by the responder QP's
//!   access flags (else REM_INV_REQ) → a receive WQE for SEND / WRITE-with-imm (else RNR)
//!   → rkey → execute. A zero-length READ/WRITE checks no rkey (C9-88).
//! - rkeys: an MR rkey needs the MR's remote right and the responder QP's PD; a window's
//!   rkey needs the exact current key, a binding, the responder QP's PD, the right in the
//!   window's access flags, and for a type-2 window the responder QP must be the QP the
//!   window was bound through (`rxe_lookup_mw`: `mw->qp != qp` fails). Type-1 windows work
//!   through any QP of the PD.
//! - Bounds: rxe checks an access against the *MR* only (`mr_check_range`), not against the
//!   window (measured in the VM). Here both are checked, as the IB spec requires; see
//!   [`ENFORCE_WINDOW_BOUNDS`].
//! - Responder-detected errors of class C (remote access, invalid request, length) put the
//!   responder QP in the error state too (rxe's `do_class_ac_error` sets `goto_error`); a
//!   receive WQE consumed by the failed request completes with an error.
//! - The requester gets RetryExceeded when the peer never answers: no such QP, not in
//!   RTR/RTS, or not connected back to this QP — after `timeout`×(`retry_cnt`+1) like a
//!   real transport (timeout 0 waits forever); RNR waits `rnr_retry` times the responder's
//!   `min_rnr_timer`, forever with 7.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::cq::{CqInner, LoopbackCq};
use super::{
    check_port, os_error, range_inside, Binding, KeyTables, LoopbackMr, LoopbackMw, PdInner,
    Registration, Shared, MAX_INLINE_DATA, MAX_QP, MAX_QP_RD_ATOM, MAX_QP_WR, MAX_SGE, PORT_MTU,
};
use crate::lock::lock;
use crate::memory::{CopyError, SharedMemory};
use crate::provider::counters::Tracked;
use crate::provider::{
    Access, CompletionQueue, MemoryRegion, MemoryWindow, MwType, ObjectKind, PostError,
    ProviderError, QpInit, QpState, QueuePair, RecvWr, RemoteEndpoint, Result, RtrAttributes,
    RtsAttributes, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};
use smallvec::SmallVec;

/// Check RDMA accesses through a window against the window's own range as well as its
/// MR's. rxe checks the MR only; the IB spec (and the brief for this device) wants both.
/// The daemon binds windows over whole regions, where the two agree.
const ENFORCE_WINDOW_BOUNDS: bool = true;

/// `IBV_WC_LOC_QP_OP_ERR`: what rxe reports for a failed local invalidate.
const WC_LOC_QP_OP_ERR: u32 = 2;

/// The largest message an RC QP carries (IB: 2^31 bytes; the port's `max_msg_sz`).
pub(super) const MAX_MESSAGE: u64 = 1 << 31;

/// The most bytes one turn of a send queue moves under the execution lock.
pub(super) const TURN_BYTES: u64 = 64 << 10;

/// What a request costs a turn at the least, so a flood of tiny requests is bounded too.
pub(super) const REQUEST_COST: u64 = 512;

const QPN_MASK: u32 = 0x00ff_ffff;
const FIRST_QPN: u32 = 0x11;

pub(super) fn create(pd: &Arc<PdInner>, init: QpInit) -> Result<Arc<dyn QueuePair>> {
    let device = &pd.device;
    let name = &device.name;
    let send_cq = cq_of(pd, &init.send_cq)?;
    let recv_cq = cq_of(pd, &init.recv_cq)?;
    for (what, value, max) in [
        ("max_send_wr", init.max_send_wr, MAX_QP_WR),
        ("max_recv_wr", init.max_recv_wr, MAX_QP_WR),
        ("max_send_sge", init.max_send_sge, MAX_SGE),
        ("max_recv_sge", init.max_recv_sge, MAX_SGE),
        ("max_inline_data", init.max_inline_data, MAX_INLINE_DATA),
    ] {
        if value > max {
            return Err(ProviderError::invalid(
                name,
                format!("{what} {value} exceeds the device limit {max}"),
            ));
        }
    }
    if device.counters.snapshot().qps >= u64::from(MAX_QP) {
        return Err(os_error(name, "ibv_create_qp", libc::ENOMEM));
    }
    let id = device.next_id();
    let mut qps = lock(&device.qps);
    // 24-bit numbers, unique among live QPs (MAX_QP < 2^24, so one is always free).
    let qp_num = loop {
        let n = device
            .next_qpn
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            & QPN_MASK;
        if n >= FIRST_QPN && qps.get(&n).is_none_or(|w| w.strong_count() == 0) {
            break n;
        }
    };
    let inner = Arc::new(QpInner {
        id,
        qp_num,
        pd: Arc::clone(pd),
        send_cq,
        recv_cq,
        _send_cq: init.send_cq,
        _recv_cq: init.recv_cq,
        max_send_wr: init.max_send_wr as usize,
        max_recv_wr: init.max_recv_wr as usize,
        max_send_sge: init.max_send_sge as usize,
        max_recv_sge: init.max_recv_sge as usize,
        max_inline_data: u64::from(init.max_inline_data),
        data: Mutex::new(QpData {
            state: QpState::Reset,
            access: Access::NONE,
            remote: None,
            min_rnr_timer: 0,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            sq: VecDeque::new(),
            head_out: false,
            rq: VecDeque::new(),
        }),
    });
    qps.insert(qp_num, Arc::downgrade(&inner));
    drop(qps);
    Ok(Arc::new(LoopbackQp {
        inner,
        _tracked: device.counters.track(ObjectKind::Qp),
    }))
}

/// The CQ's shared part, if `cq` is a loopback CQ of this device.
fn cq_of(pd: &PdInner, cq: &Arc<dyn CompletionQueue>) -> Result<Arc<CqInner>> {
    match cq.as_any().downcast_ref::<LoopbackCq>() {
        Some(cq) if Arc::ptr_eq(&cq.pd.device, &pd.device) => Ok(Arc::clone(&cq.inner)),
        _ => Err(ProviderError::invalid(
            &pd.device.name,
            "the completion queue belongs to another device",
        )),
    }
}

/// The handle the engine holds. Its drop unpublishes the QP under the execution lock, so
/// the handle holds the last strong reference to [`QpInner`].
#[derive(Debug)]
struct LoopbackQp {
    inner: Arc<QpInner>,
    _tracked: Tracked,
}

#[derive(Debug)]
pub(super) struct QpInner {
    /// Unique on the device and never reused (qp_nums wrap): what a type-2 window records.
    pub(super) id: u64,
    qp_num: u32,
    pd: Arc<PdInner>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    /// Keep the CQ objects (and their counts) alive while the QP uses them.
    _send_cq: Arc<dyn CompletionQueue>,
    _recv_cq: Arc<dyn CompletionQueue>,
    max_send_wr: usize,
    max_recv_wr: usize,
    max_send_sge: usize,
    max_recv_sge: usize,
    /// The most bytes an inline request carries. The device has no DMA to save, so an
    /// inline request is run like any other (its bytes read when it runs; rdmad's worker
    /// keeps them in place until it completes); only the limit is checked, as rxe does.
    max_inline_data: u64,
    data: Mutex<QpData>,
}

#[derive(Debug)]
struct QpData {
    state: QpState,
    /// Remote rights this QP grants as a responder (`qp_access_flags`).
    access: Access,
    remote: Option<RemoteEndpoint>,
    min_rnr_timer: u8,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    sq: VecDeque<Pending>,
    /// The head of `sq` is out of it, running: it still holds its place in the queue.
    head_out: bool,
    rq: VecDeque<RecvWr>,
}

#[derive(Debug)]
struct Pending {
    wr: SendWr,
    /// Set while the request waits for its peer: why, and when to give up.
    waiting: Option<(Wait, Instant)>,
    /// How far a request that needs more than one turn has got.
    progress: Progress,
}

/// A request's progress across turns.
#[derive(Debug, Clone, Default)]
struct Progress {
    /// Whether the first chunk ran (and with it the checks of the whole request).
    started: bool,
    /// Bytes moved so far.
    done: u64,
    /// The responder's receive the request consumed (SEND, WRITE with immediate).
    recv: Option<RecvWr>,
}

/// Why a request cannot make progress yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// The responder has no receive posted (it answered RNR NAK).
    Rnr,
    /// The responder does not answer at all (transport retries).
    Transport,
}

enum Step {
    /// Executed; the byte count for the completion.
    Done(u32),
    /// One chunk moved; the rest waits for the next turn.
    Partial,
    /// Cannot progress yet; `per_try` is how long one retry waits.
    Blocked(Wait, Duration),
    /// Failed with this status; the QP goes to the error state.
    Failed(WcStatus),
}

fn opcode(op: &SendOp) -> WcOpcode {
    match op {
        SendOp::Send { .. } => WcOpcode::Send,
        SendOp::Write { .. } => WcOpcode::RdmaWrite,
        SendOp::Read { .. } => WcOpcode::RdmaRead,
        SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        SendOp::CompareSwap { .. } => WcOpcode::CompareSwap,
        SendOp::BindMw { .. } => WcOpcode::BindMw,
        SendOp::LocalInvalidate { .. } => WcOpcode::LocalInvalidate,
    }
}

/// The completion of `wr`, done on `qp` with `byte_len` bytes, if it asked for one.
fn completion(qp: &QpInner, wr: &SendWr, byte_len: u32) -> Option<WorkCompletion> {
    wr.signaled.then(|| WorkCompletion {
        wr_id: wr.wr_id,
        status: WcStatus::Success,
        opcode: opcode(&wr.op),
        byte_len,
        imm: None,
        qp_num: qp.qp_num,
    })
}

/// `min_rnr_timer` encodings (IB table 45), in microseconds.
const RNR_TIMER_US: [u64; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840,
    5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
    245_760, 327_680, 491_520,
];

/// One turn for each QP `cq` lists as unfinished.
pub(super) fn run_turns(device: &Arc<Shared>, cq: &CqInner) {
    drive(device, |ex| {
        // Taken under the execution lock, where a QP's handle takes it off the list before
        // it goes: every QP on it still has its handle.
        for qp in cq.take_unfinished() {
            if let Some(qp) = qp.upgrade() {
                ex.run(&qp);
            }
        }
    });
}

/// What the execution lock keeps from one hold to the next.
#[derive(Debug, Default)]
pub(super) struct Held {
    /// The peer the last request found ready, connected back to its QP (that QP's number
    /// first), and the rights it grants: the QP's next requests, in this turn or a later
    /// one, go to it without looking again. Nothing but an error or a destruction can
    /// change what a ready peer is and grants (`to_init` and `to_rtr` refuse a QP past
    /// RTR, the GIDs are fixed, and errors and destruction take the execution lock), and
    /// both forget it ([`Exec::error`], `LoopbackQp`'s `Drop`), so the answer holds until
    /// then. A strong reference kept under the execution lock, dropped by the `Drop` of
    /// either QP's handle before it unpublishes the QP: the last reference to a QP is still
    /// its handle's.
    peer: Option<(u32, Arc<QpInner>, Access)>,
}

/// Runs `f` under the device's execution lock, then every QP it asked to be kicked.
fn drive(device: &Arc<Shared>, f: impl FnOnce(&mut Exec<'_>)) {
    let mut ex = Exec {
        device,
        held: lock(&device.exec),
        kicks: SmallVec::new(),
        errors: 0,
    };
    f(&mut ex);
    // Each kick either finds nothing to do or completes/flushes work, so this ends; the
    // bound is a guard against a bug turning into a livelock.
    let mut rounds = 0;
    while let Some(qp_num) = ex.kicks.pop() {
        rounds += 1;
        if rounds > 4096 {
            tracing::error!("loopback {}: too many chained kicks", device.name);
            break;
        }
        if let Some(qp) = ex.lookup(qp_num) {
            ex.run(&qp);
        }
    }
}

/// Wakes `qp_num` at `at` (to time out a wait).
fn schedule(device: &Arc<Shared>, qp_num: u32, at: Instant) {
    let weak: Weak<Shared> = Arc::downgrade(device);
    let spawned = std::thread::Builder::new()
        .name("loopback-retry".to_owned())
        .spawn(move || {
            std::thread::sleep(
                at.saturating_duration_since(Instant::now()) + Duration::from_millis(1),
            );
            if let Some(device) = weak.upgrade() {
                drive(&device, |ex| ex.kicks.push(qp_num));
            }
        });
    if let Err(e) = spawned {
        tracing::error!(
            "loopback {}: cannot start a retry timer for QP {qp_num}: {e}",
            device.name
        );
    }
}

/// The state of one run under the execution lock.
struct Exec<'a> {
    device: &'a Arc<Shared>,
    /// The execution lock, held for the whole run.
    held: std::sync::MutexGuard<'a, Held>,
    /// QPs to run after the current one (never run re-entrantly); a turn kicks a few at
    /// most, so they stay off the heap.
    kicks: SmallVec<[u32; 8]>,
    /// How many times QPs went to the error state under this hold of the execution lock
    /// ([`Exec::error`]): a peer handed out before one is not kept ([`Exec::with_peer`]).
    errors: u64,
}

impl Exec<'_> {
    fn lookup(&self, qp_num: u32) -> Option<Arc<QpInner>> {
        lock(&self.device.qps).get(&qp_num).and_then(Weak::upgrade)
    }

    /// Runs one turn of `qp`'s send queue: as far as it goes within [`TURN_BYTES`] (or
    /// flushes it if the QP is in error). Work left at the end of the turn waits for the
    /// next poll of the QP's send CQ.
    ///
    /// The head leaves the queue while it runs (moved, not copied; `head_out` keeps its
    /// place for `post_send`), and goes back to the front unless it is done. A done
    /// request's completion is pushed in the same critical section that gives its place
    /// up, so no poller sees it complete while it still fills the queue.
    fn run(&mut self, qp: &Arc<QpInner>) {
        let mut budget = TURN_BYTES;
        let mut done: Option<WorkCompletion> = None;
        loop {
            let mut head = {
                let mut data = lock(&qp.data);
                // Whatever ran before is done (or back at the front) by now.
                data.head_out = false;
                // The CQ's lock is a leaf lock, taken under a QP's.
                if let Some(wc) = done.take() {
                    if !qp.send_cq.push(wc) {
                        drop(data);
                        self.error(qp);
                        return;
                    }
                }
                if data.state == QpState::Error {
                    drop(data);
                    self.flush(qp);
                    return;
                }
                if data.state != QpState::Rts {
                    return;
                }
                if budget == 0 && !data.sq.is_empty() {
                    drop(data);
                    qp.send_cq.continue_later(qp);
                    return;
                }
                let Some(head) = data.sq.pop_front() else {
                    return;
                };
                data.head_out = true;
                head
            };
            let step = self.execute(qp, &head.wr, &mut head.progress, &mut budget);
            budget = budget.saturating_sub(REQUEST_COST.min(budget));
            match step {
                Step::Done(byte_len) => done = completion(qp, &head.wr, byte_len),
                step => {
                    self.settle(qp, head, step);
                    return;
                }
            }
        }
    }

    /// What becomes of a head that ran and is not done: it goes back to the front holding
    /// what it took (a receive) for its next turn, fails, or waits for its peer.
    fn settle(&mut self, qp: &Arc<QpInner>, head: Pending, step: Step) {
        match step {
            Step::Partial => {
                if self.put_back(qp, head) {
                    qp.send_cq.continue_later(qp);
                }
            }
            Step::Failed(status) => self.fail_head(qp, head, status),
            Step::Blocked(wait, per_try) => self.blocked(qp, head, wait, per_try),
            Step::Done(_) => {
                // Callers complete a done head themselves; it only gives its place up.
                debug_assert!(false, "settle called with a done request");
                lock(&qp.data).head_out = false;
            }
        }
    }

    /// The head cannot progress until its peer answers (`wait`): it goes back to the front
    /// and waits `per_try` for each retry the QP allows, then fails.
    fn blocked(&mut self, qp: &Arc<QpInner>, mut head: Pending, wait: Wait, per_try: Duration) {
        let (retries, infinite) = {
            let data = lock(&qp.data);
            match wait {
                Wait::Rnr => (u32::from(data.rnr_retry), data.rnr_retry >= 7),
                Wait::Transport => (u32::from(data.retry_cnt) + 1, data.timeout == 0),
            }
        };
        if infinite {
            self.put_back(qp, head);
            return;
        }
        let now = Instant::now();
        match head.waiting {
            Some((w, deadline)) if w == wait => {
                if now >= deadline {
                    let status = match wait {
                        Wait::Rnr => WcStatus::RnrRetryExceeded,
                        Wait::Transport => WcStatus::RetryExceeded,
                    };
                    self.fail_head(qp, head, status);
                } else {
                    self.put_back(qp, head);
                }
            }
            _ if retries == 0 => self.fail_head(qp, head, WcStatus::RnrRetryExceeded),
            _ => {
                let deadline = now + per_try * retries;
                head.waiting = Some((wait, deadline));
                if self.put_back(qp, head) {
                    schedule(self.device, qp.qp_num, deadline);
                }
            }
        }
    }

    /// Returns a head that ran but is not done to the front of `qp`'s send queue; if the
    /// QP went to the error state meanwhile (its own request failing its peer, when the
    /// two are one QP), flushes it now, the head first. Whether the QP is still usable.
    fn put_back(&mut self, qp: &Arc<QpInner>, head: Pending) -> bool {
        let in_error = {
            let mut data = lock(&qp.data);
            data.sq.push_front(head);
            data.head_out = false;
            data.state == QpState::Error
        };
        if in_error {
            self.flush(qp);
        }
        !in_error
    }

    /// Completes the head request (out of the queue) with an error and moves the QP to the
    /// error state.
    fn fail_head(&mut self, qp: &Arc<QpInner>, head: Pending, status: WcStatus) {
        lock(&qp.data).head_out = false;
        self.give_back(qp, &head.progress);
        // Error completions are reported whether or not the request was signaled.
        qp.send_cq.push(WorkCompletion {
            wr_id: head.wr.wr_id,
            status,
            opcode: opcode(&head.wr.op),
            byte_len: 0,
            imm: None,
            qp_num: qp.qp_num,
        });
        self.error(qp);
    }

    /// A receive a half-done request of `qp` took from its responder goes back to the front
    /// of the responder's queue (the message never arrived), and the responder runs again
    /// (flushing it, if it is in error): a receive is never lost with the request.
    fn give_back(&mut self, qp: &QpInner, progress: &Progress) {
        let Some(recv) = progress.recv.clone() else {
            return;
        };
        let peer = lock(&qp.data).remote.as_ref().map(|r| r.qp_num);
        if let Some(peer) = peer.and_then(|n| self.lookup(n)) {
            lock(&peer.data).rq.push_front(recv);
            self.kicks.push(peer.qp_num);
        }
    }

    /// Moves `qp` to the error state and flushes it; its peer may be waiting on it.
    fn error(&mut self, qp: &Arc<QpInner>) {
        self.held.peer = None;
        self.errors += 1;
        let peer = {
            let mut data = lock(&qp.data);
            let was = std::mem::replace(&mut data.state, QpState::Error);
            (was != QpState::Error)
                .then(|| data.remote.as_ref().map(|r| r.qp_num))
                .flatten()
        };
        self.flush(qp);
        if let Some(peer) = peer {
            self.kicks.push(peer);
        }
    }

    /// Completes every outstanding request of `qp` with `WrFlushError`, in order.
    ///
    /// While the QP's turn holds its head out of the queue, flushing waits for that turn
    /// to settle the head (an error completion comes first, in order).
    fn flush(&mut self, qp: &Arc<QpInner>) {
        let (sq, rq) = {
            let mut data = lock(&qp.data);
            if data.head_out {
                return;
            }
            (std::mem::take(&mut data.sq), std::mem::take(&mut data.rq))
        };
        for pending in &sq {
            self.give_back(qp, &pending.progress);
            qp.send_cq.push(WorkCompletion {
                wr_id: pending.wr.wr_id,
                status: WcStatus::WrFlushError,
                opcode: opcode(&pending.wr.op),
                byte_len: 0,
                imm: None,
                qp_num: qp.qp_num,
            });
        }
        for recv in &rq {
            qp.recv_cq.push(WorkCompletion {
                wr_id: recv.wr_id,
                status: WcStatus::WrFlushError,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm: None,
                qp_num: qp.qp_num,
            });
        }
    }

    /// A responder-detected (class C) error: the receive the request consumed, if any,
    /// completes with `status`, and the responder QP goes to the error state.
    fn responder_error(
        &mut self,
        peer: &Arc<QpInner>,
        recv: Option<(&RecvWr, WcOpcode)>,
        status: WcStatus,
    ) {
        if let Some((recv, opcode)) = recv {
            peer.recv_cq.push(WorkCompletion {
                wr_id: recv.wr_id,
                status,
                opcode,
                byte_len: 0,
                imm: None,
                qp_num: peer.qp_num,
            });
        }
        self.error(peer);
    }

    /// The connected peer and the remote rights its QP grants (read with its state), or how
    /// long one transport retry waits if it does not answer. The turn's answer for `qp`, if
    /// it has one, is handed over rather than shared: [`Exec::with_peer`] keeps it again.
    fn peer(&mut self, qp: &QpInner) -> std::result::Result<(Arc<QpInner>, Access), Step> {
        if self
            .held
            .peer
            .as_ref()
            .is_some_and(|(requester, ..)| *requester == qp.qp_num)
        {
            if let Some((_, peer, access)) = self.held.peer.take() {
                return Ok((peer, access));
            }
        }
        let (remote, timeout) = {
            let data = lock(&qp.data);
            (data.remote.clone(), data.timeout)
        };
        // 4.096 µs · 2^timeout per try.
        let per_try = Duration::from_nanos(4096u64 << timeout.min(31));
        let unreachable = Step::Blocked(Wait::Transport, per_try);
        let Some(remote) = remote else {
            return Err(unreachable);
        };
        if !self.device.has_gid(remote.gid) {
            return Err(unreachable);
        }
        let Some(peer) = self.lookup(remote.qp_num) else {
            return Err(unreachable);
        };
        let access = {
            let data = lock(&peer.data);
            let ready = matches!(data.state, QpState::Rtr | QpState::Rts);
            // The responder acknowledges to its own destination QP: if that is not us, we
            // never hear back.
            let connected_back = data.remote.as_ref().is_some_and(|r| r.qp_num == qp.qp_num);
            if !ready || !connected_back {
                return Err(unreachable);
            }
            data.access
        };
        Ok((peer, access))
    }

    /// Runs `op` with `qp`'s peer and the rights it grants ([`Exec::peer`]), then keeps the
    /// answer for the QP's next request, unless `op` moved a QP to the error state (see
    /// [`Held::peer`]). Handing the one reference over, instead of cloning it for
    /// each request, spares a request two atomic updates of its count.
    fn with_peer(
        &mut self,
        qp: &QpInner,
        op: impl FnOnce(&mut Self, &Arc<QpInner>, Access) -> Step,
    ) -> Step {
        let (peer, access) = match self.peer(qp) {
            Ok(found) => found,
            Err(step) => return step,
        };
        let errors = self.errors;
        let step = op(self, &peer, access);
        if self.errors == errors {
            self.held.peer = Some((qp.qp_num, peer, access));
        }
        step
    }

    /// Takes the responder's next receive, or says how long the RNR timer is.
    fn take_recv(&self, peer: &QpInner) -> std::result::Result<RecvWr, Step> {
        let mut data = lock(&peer.data);
        match data.rq.pop_front() {
            Some(recv) => Ok(recv),
            None => {
                let us = RNR_TIMER_US[usize::from(data.min_rnr_timer & 31)];
                Err(Step::Blocked(Wait::Rnr, Duration::from_micros(us)))
            }
        }
    }

    /// Runs `wr` (the head of `qp`'s send queue, or a request `post_send` runs in the head's
    /// place) as far as `budget` bytes go, from `progress` on, and takes what it moved from
    /// `budget`.
    fn execute(
        &mut self,
        qp: &Arc<QpInner>,
        wr: &SendWr,
        progress: &mut Progress,
        budget: &mut u64,
    ) -> Step {
        // A message longer than the port allows fails before its peer is looked for.
        let too_long = wr.message_len() > MAX_MESSAGE;
        match &wr.op {
            SendOp::BindMw {
                mw,
                mr,
                addr,
                len,
                access,
            } => self.bind(qp, mw.as_ref(), mr.as_ref(), *addr, *len, *access),
            SendOp::LocalInvalidate { rkey } => self.invalidate(qp, *rkey),
            SendOp::Send { .. } | SendOp::Write { .. } | SendOp::Read { .. } if too_long => {
                Step::Failed(WcStatus::LocalLengthError)
            }
            SendOp::Send { imm } => self.with_peer(qp, |ex, peer, _| {
                ex.send(qp, peer, wr, *imm, progress, budget)
            }),
            SendOp::Write {
                remote_addr,
                rkey,
                imm,
            } => {
                let remote = Remote::new(*remote_addr, *rkey);
                self.with_peer(qp, |ex, peer, allowed| {
                    ex.write(qp, (peer, allowed), wr, remote, *imm, progress, budget)
                })
            }
            SendOp::Read { remote_addr, rkey } => {
                let remote = Remote::new(*remote_addr, *rkey);
                self.with_peer(qp, |ex, peer, allowed| {
                    ex.read(qp, (peer, allowed), wr, remote, progress, budget)
                })
            }
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            } => {
                let (remote, add) = (Remote::new(*remote_addr, *rkey), *add);
                self.with_peer(qp, |ex, peer, allowed| {
                    ex.atomic(qp, (peer, allowed), wr, remote, |old| old.wrapping_add(add))
                })
            }
            SendOp::CompareSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => {
                let (remote, compare, swap) = (Remote::new(*remote_addr, *rkey), *compare, *swap);
                self.with_peer(qp, |ex, peer, allowed| {
                    ex.atomic(qp, (peer, allowed), wr, remote, |old| {
                        if old == compare {
                            swap
                        } else {
                            old
                        }
                    })
                })
            }
        }
    }

    /// A SEND: the first chunk checks the gather list, takes the responder's receive and
    /// checks it holds the whole message; every chunk then moves up to `budget` bytes. The
    /// receive's check and the chunk's move share one critical section of the key tables.
    fn send(
        &mut self,
        qp: &Arc<QpInner>,
        peer: &Arc<QpInner>,
        wr: &SendWr,
        imm: Option<u32>,
        progress: &mut Progress,
        budget: &mut u64,
    ) -> Step {
        let device = self.device;
        let total = wr.message_len();
        let n = (total - progress.done).min(*budget);
        let first = !progress.started;
        if first {
            if let Err(status) = check_gather(&lock(&device.keys), qp.pd.id, wr, total) {
                return Step::Failed(status);
            }
            match self.take_recv(peer) {
                Ok(recv) => progress.recv = Some(recv),
                Err(step) => return step,
            }
            progress.started = true;
        }
        // Held here while the chunk moves, and back in `progress` whenever the request
        // goes on holding it.
        let Some(recv) = progress.recv.take() else {
            return Step::Failed(WcStatus::LocalProtectionError);
        };
        let keys = lock(&device.keys);
        let fits = if first {
            locate(&keys, peer.pd.id, &recv.sges, 0, total, Access::LOCAL_WRITE).map(|_| ())
        } else {
            Ok(())
        };
        let moved = match fits {
            Err(unlocated) => {
                drop(keys);
                // The receiver sees a local error; the sender an invalid request for a
                // receive too short, a remote operation error for one it may not write.
                let (recv_status, status) = match unlocated {
                    Unlocated::Length => (
                        WcStatus::LocalLengthError,
                        WcStatus::RemoteInvalidRequestError,
                    ),
                    Unlocated::Protection => (
                        WcStatus::LocalProtectionError,
                        WcStatus::RemoteOperationError,
                    ),
                };
                self.responder_error(peer, Some((&recv, WcOpcode::Recv)), recv_status);
                return Step::Failed(status);
            }
            Ok(()) if n == 0 => Ok(()),
            Ok(()) => {
                let done = progress.done;
                match locate(&keys, qp.pd.id, &wr.sges, done, n, Access::NONE) {
                    Err(unlocated) => Err(Stopped::Gather(unlocated.gather_status())),
                    Ok(source) => {
                        match locate(&keys, peer.pd.id, &recv.sges, done, n, Access::LOCAL_WRITE) {
                            Ok(target) => transfer(&source, &target).map_err(Side::stopped),
                            Err(_) => Err(Stopped::Target),
                        }
                    }
                }
            }
        };
        drop(keys);
        match moved {
            Ok(()) => {}
            Err(Stopped::Gather(status)) => {
                // The message never arrives: its receive stays the responder's.
                progress.recv = Some(recv);
                self.give_back(qp, progress);
                progress.recv = None;
                return Step::Failed(status);
            }
            // A SEND needs no right of the responder QP: only its receive stops it there.
            Err(Stopped::Target | Stopped::Refused) => {
                self.responder_error(
                    peer,
                    Some((&recv, WcOpcode::Recv)),
                    WcStatus::LocalProtectionError,
                );
                return Step::Failed(WcStatus::RemoteOperationError);
            }
        }
        progress.done += n;
        *budget -= n;
        if progress.done < total {
            progress.recv = Some(recv);
            return Step::Partial;
        }
        let byte_len = total as u32;
        if !peer.recv_cq.push(WorkCompletion {
            wr_id: recv.wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len,
            imm,
            qp_num: peer.qp_num,
        }) {
            self.error(peer);
        }
        Step::Done(byte_len)
    }

    /// An RDMA WRITE: the rkey is checked for every chunk, as a device checks every packet,
    /// so a window invalidated mid-transfer stops it. A write that is one chunk and takes
    /// no receive (no immediate) is checked and moved in one critical section of the key
    /// tables; otherwise the first chunk checks the whole gather list, the responder's
    /// rights and takes the receive before anything moves.
    #[allow(clippy::too_many_arguments)]
    fn write(
        &mut self,
        qp: &Arc<QpInner>,
        (peer, allowed): (&Arc<QpInner>, Access),
        wr: &SendWr,
        remote: Remote,
        imm: Option<u32>,
        progress: &mut Progress,
        budget: &mut u64,
    ) -> Step {
        let device = self.device;
        let total = wr.message_len();
        let n = (total - progress.done).min(*budget);
        let at_once = !progress.started && imm.is_none() && n == total && n > 0;
        // Checked with the move when the write is moved at once, after its gather list.
        let denied = at_once && !allowed.contains(Access::REMOTE_WRITE);
        if !progress.started && !at_once {
            if let Err(status) = check_gather(&lock(&device.keys), qp.pd.id, wr, total) {
                return Step::Failed(status);
            }
            if !allowed.contains(Access::REMOTE_WRITE) {
                self.responder_error(peer, None, WcStatus::RemoteInvalidRequestError);
                return Step::Failed(WcStatus::RemoteInvalidRequestError);
            }
            if imm.is_some() {
                match self.take_recv(peer) {
                    Ok(recv) => progress.recv = Some(recv),
                    Err(step) => return step,
                }
            }
            progress.started = true;
        }
        if n > 0 {
            let keys = lock(&device.keys);
            let done = progress.done;
            // The gather list first (the requester's own error), then the responder.
            let moved = match locate(&keys, qp.pd.id, &wr.sges, done, n, Access::NONE) {
                Err(unlocated) => Err(Stopped::Gather(unlocated.gather_status())),
                Ok(_) if denied => Err(Stopped::Refused),
                Ok(source) => {
                    let at = remote.addr.wrapping_add(done);
                    match resolve_remote(&keys, peer, remote.rkey, at, n, Access::REMOTE_WRITE) {
                        Some(target) => {
                            transfer(&source, std::slice::from_ref(&target)).map_err(Side::stopped)
                        }
                        None => Err(Stopped::Target),
                    }
                }
            };
            drop(keys);
            progress.started = true;
            match moved {
                Ok(()) => {}
                Err(Stopped::Refused) => {
                    self.responder_error(peer, None, WcStatus::RemoteInvalidRequestError);
                    return Step::Failed(WcStatus::RemoteInvalidRequestError);
                }
                Err(Stopped::Gather(status)) => {
                    self.give_back(qp, progress);
                    progress.recv = None;
                    return Step::Failed(status);
                }
                Err(Stopped::Target) => {
                    let taken = progress.recv.take();
                    let consumed = taken.as_ref().map(|r| (r, WcOpcode::RecvRdmaWithImm));
                    self.responder_error(peer, consumed, WcStatus::RemoteAccessError);
                    return Step::Failed(WcStatus::RemoteAccessError);
                }
            }
            progress.done += n;
            *budget -= n;
        }
        if progress.done < total {
            return Step::Partial;
        }
        let byte_len = total as u32;
        if let Some(recv) = progress.recv.take() {
            if !peer.recv_cq.push(WorkCompletion {
                wr_id: recv.wr_id,
                status: WcStatus::Success,
                opcode: WcOpcode::RecvRdmaWithImm,
                byte_len,
                imm,
                qp_num: peer.qp_num,
            }) {
                self.error(peer);
            }
        }
        Step::Done(byte_len)
    }

    /// An RDMA READ, a chunk per turn; the response lands in our SGEs, which need local
    /// write. A chunk's keys, both sides, and its move share one critical section of the
    /// key tables.
    fn read(
        &mut self,
        qp: &Arc<QpInner>,
        (peer, allowed): (&Arc<QpInner>, Access),
        wr: &SendWr,
        remote: Remote,
        progress: &mut Progress,
        budget: &mut u64,
    ) -> Step {
        let total = wr.message_len();
        if !progress.started && !allowed.contains(Access::REMOTE_READ) {
            self.responder_error(peer, None, WcStatus::RemoteInvalidRequestError);
            return Step::Failed(WcStatus::RemoteInvalidRequestError);
        }
        let n = (total - progress.done).min(*budget);
        if n > 0 {
            let device = self.device;
            let keys = lock(&device.keys);
            let at = remote.addr.wrapping_add(progress.done);
            let Some(source) = resolve_remote(&keys, peer, remote.rkey, at, n, Access::REMOTE_READ)
            else {
                drop(keys);
                self.responder_error(peer, None, WcStatus::RemoteAccessError);
                return Step::Failed(WcStatus::RemoteAccessError);
            };
            // The whole scatter list is checked with the first chunk (the chunk itself,
            // when it is the whole message).
            if !progress.started
                && n < total
                && locate(&keys, qp.pd.id, &wr.sges, 0, total, Access::LOCAL_WRITE).is_err()
            {
                return Step::Failed(WcStatus::LocalProtectionError);
            }
            let target = locate(
                &keys,
                qp.pd.id,
                &wr.sges,
                progress.done,
                n,
                Access::LOCAL_WRITE,
            );
            let moved = match &target {
                Ok(target) => transfer(std::slice::from_ref(&source), target),
                Err(_) => Err(Side::Target),
            };
            drop(target);
            drop(keys);
            match moved {
                Ok(()) => {}
                Err(Side::Source) => {
                    self.responder_error(peer, None, WcStatus::RemoteAccessError);
                    return Step::Failed(WcStatus::RemoteAccessError);
                }
                Err(Side::Target) => return Step::Failed(WcStatus::LocalProtectionError),
            }
            progress.done += n;
            *budget -= n;
        }
        progress.started = true;
        if progress.done < total {
            return Step::Partial;
        }
        Step::Done(total as u32)
    }

    fn atomic(
        &mut self,
        qp: &Arc<QpInner>,
        (peer, allowed): (&Arc<QpInner>, Access),
        wr: &SendWr,
        remote: Remote,
        op: impl FnOnce(u64) -> u64,
    ) -> Step {
        if !allowed.contains(Access::REMOTE_ATOMIC) {
            self.responder_error(peer, None, WcStatus::RemoteInvalidRequestError);
            return Step::Failed(WcStatus::RemoteInvalidRequestError);
        }
        let device = self.device;
        let keys = lock(&device.keys);
        let Some(Piece {
            memory, at: offset, ..
        }) = resolve_remote(
            &keys,
            peer,
            remote.rkey,
            remote.addr,
            8,
            Access::REMOTE_ATOMIC,
        )
        else {
            drop(keys);
            self.responder_error(peer, None, WcStatus::RemoteAccessError);
            return Step::Failed(WcStatus::RemoteAccessError);
        };
        if remote.addr % 8 != 0 {
            // rxe: RESPST_ERR_MISALIGNED_ATOMIC, NAK invalid request.
            drop(keys);
            self.responder_error(peer, None, WcStatus::RemoteInvalidRequestError);
            return Step::Failed(WcStatus::RemoteInvalidRequestError);
        }
        // Atomic with respect to every other loopback atomic: all execution holds the
        // device's execution lock. Like an HCA's atomics, not atomic against CPU stores.
        let mut old = [0u8; 8];
        if memory.read_at(offset, &mut old).is_err() {
            return Step::Failed(WcStatus::RemoteAccessError);
        }
        let old = u64::from_ne_bytes(old);
        let new = op(old);
        if new != old && memory.write_at(offset, &new.to_ne_bytes()).is_err() {
            return Step::Failed(WcStatus::RemoteAccessError);
        }
        // The original value lands in our SGEs (local write needed), as rxe's completer
        // does after the responder has executed.
        match locate(&keys, qp.pd.id, &wr.sges, 0, 8, Access::LOCAL_WRITE) {
            Ok(target) => scatter_bytes(&target, &old.to_ne_bytes()),
            Err(_) => return Step::Failed(WcStatus::LocalProtectionError),
        }
        Step::Done(8)
    }

    fn bind(
        &mut self,
        qp: &QpInner,
        mw: &dyn MemoryWindow,
        mr: &dyn MemoryRegion,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Step {
        let failed = Step::Failed(WcStatus::MemoryWindowBindError);
        let (Some(mw), Some(mr)) = (
            mw.as_any().downcast_ref::<LoopbackMw>(),
            mr.as_any().downcast_ref::<LoopbackMr>(),
        ) else {
            return failed;
        };
        // Same device and PD (C10-72; rxe checks the QP/MW PD for type 2 only).
        if !Arc::ptr_eq(&mw.pd.device, self.device)
            || !Arc::ptr_eq(&mr.pd.device, self.device)
            || mw.pd.id != qp.pd.id
            || mr.pd.id != qp.pd.id
        {
            return failed;
        }
        let Some(reg) = self.device.registration(mr.key) else {
            return failed;
        };
        // C10-73: the MR must allow binding; C10-74: remote write/atomic windows need a
        // locally writable MR; C10-75: the window lies inside the MR.
        if !reg.access.contains(Access::MW_BIND) {
            return failed;
        }
        let writes =
            access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC);
        if writes && !reg.access.contains(Access::LOCAL_WRITE) {
            return failed;
        }
        if len > 0 && !reg.contains(addr, len) {
            return failed;
        }
        let mut keys = lock(&self.device.keys);
        let Some(entry) = keys.windows.get_mut(&mw.index) else {
            return failed;
        };
        match entry.kind {
            // o10-37.2.30: only a free (unbound or invalidated) type-2 window binds, and
            // o10-37.2.40: not with length 0.
            MwType::Type2 if entry.binding.is_some() || len == 0 => return failed,
            // A type-1 window rebinds freely; length 0 unbinds it.
            _ => {}
        }
        // A new key on every bind, like ibv_inc_rkey: same index, next variant byte.
        entry.rkey = (entry.rkey & !0xff) | (entry.rkey.wrapping_add(1) & 0xff);
        entry.binding = (len > 0).then(|| Binding {
            mr_key: mr.key,
            addr,
            len,
            access,
            // Type-2 windows are tied to the QP they were bound through.
            qp: (entry.kind == MwType::Type2).then_some(qp.id),
        });
        Step::Done(0)
    }

    fn invalidate(&mut self, qp: &QpInner, rkey: u32) -> Step {
        let mut keys = lock(&self.device.keys);
        match keys.windows.get_mut(&(rkey >> 8)) {
            // o10-37.2.26: type-1 windows cannot be invalidated. rxe checks neither the PD
            // nor that this is the QP the window was bound through; the PD is checked here
            // so a QP can never revoke another PD's window. The rkey stays; the next bind
            // changes it.
            Some(entry)
                if entry.rkey == rkey && entry.kind == MwType::Type2 && entry.pd == qp.pd.id =>
            {
                entry.binding = None;
                Step::Done(0)
            }
            // An MR rkey (rxe: only fast-register MRs can be invalidated) or a stale key.
            _ => Step::Failed(WcStatus::Other(WC_LOC_QP_OP_ERR)),
        }
    }
}

/// Where an rkey access lands: the memory and the offset into it, or `None` for a remote
/// access error.
fn resolve_remote<'k>(
    keys: &'k KeyTables,
    responder: &QpInner,
    rkey: u32,
    addr: u64,
    len: u64,
    needed: Access,
) -> Option<Piece<'k>> {
    let pd = responder.pd.id;
    if let Some(reg) = keys.translations.get(&rkey) {
        let ok = reg.pd == pd && reg.access.contains(needed) && reg.contains(addr, len);
        return ok.then(|| reg.piece(addr, len));
    }
    let entry = keys.windows.get(&(rkey >> 8))?;
    let binding = entry.binding.as_ref()?;
    let usable = entry.rkey == rkey
        && entry.pd == pd
        && binding.qp.is_none_or(|bound| bound == responder.id)
        && binding.access.contains(needed)
        && (!ENFORCE_WINDOW_BOUNDS || range_inside(addr, len, binding.addr, binding.len));
    if !usable {
        return None;
    }
    let reg = keys.translations.get(&binding.mr_key)?;
    reg.contains(addr, len).then(|| reg.piece(addr, len))
}

/// Where an RDMA operation points in the responder's memory.
#[derive(Debug, Clone, Copy)]
struct Remote {
    addr: u64,
    rkey: u32,
}

impl Remote {
    fn new(addr: u64, rkey: u32) -> Remote {
        Remote { addr, rkey }
    }
}

/// Checks, with a request's first chunk, that every SGE of its gather list (`total`
/// bytes) lies inside a registration of `pd` (reading local memory needs no access right).
fn check_gather(
    keys: &KeyTables,
    pd: u64,
    wr: &SendWr,
    total: u64,
) -> std::result::Result<(), WcStatus> {
    match locate(keys, pd, &wr.sges, 0, total, Access::NONE) {
        Ok(_) => Ok(()),
        Err(_) => Err(WcStatus::LocalProtectionError),
    }
}

/// The pieces of `[offset, offset + len)` of the message a list of SGEs describes: each
/// SGE's part as (lkey, address, length).
fn pieces(sges: &[Sge], offset: u64, len: u64) -> impl Iterator<Item = (u32, u64, u64)> + '_ {
    let mut skip = offset;
    let mut want = len;
    sges.iter().filter_map(move |sge| {
        let sge_len = u64::from(sge.length);
        if want == 0 || sge_len == 0 {
            return None;
        }
        if skip >= sge_len {
            skip -= sge_len;
            return None;
        }
        let n = (sge_len - skip).min(want);
        let piece = (sge.lkey, sge.addr.wrapping_add(skip), n);
        skip = 0;
        want -= n;
        Some(piece)
    })
}

/// `len` bytes of `memory` at `at`: a contiguous piece of a message, borrowed from the
/// key tables, so that it is used inside their critical section: no deregistration can
/// take the memory away meanwhile, and finding a piece costs no reference count.
pub(super) struct Piece<'k> {
    memory: &'k SharedMemory,
    at: usize,
    len: usize,
}

/// The pieces of a message: as many as its SGEs, kept inline for up to four.
type Pieces<'k> = SmallVec<[Piece<'k>; 4]>;

impl Registration {
    /// `[addr, addr + len)`, inside this registration, as a piece of its memory.
    fn piece(&self, addr: u64, len: u64) -> Piece<'_> {
        Piece {
            at: self.memory_offset(addr),
            memory: &self.memory,
            len: len as usize,
        }
    }
}

/// Why part of a message could not be located in local memory.
#[derive(Debug, Clone, Copy)]
enum Unlocated {
    /// The SGEs hold fewer bytes than the message.
    Length,
    /// A piece lies outside every registration of the PD, or one without the right.
    Protection,
}

impl Unlocated {
    /// The status of a gather list that cannot supply the message (the requester's own
    /// error).
    fn gather_status(self) -> WcStatus {
        match self {
            Unlocated::Length => WcStatus::LocalLengthError,
            Unlocated::Protection => WcStatus::LocalProtectionError,
        }
    }
}

/// Where `[offset, offset + len)` of the message `sges` describes lies: each SGE's part,
/// inside a registration of `pd` that grants `needed`.
fn locate<'k>(
    keys: &'k KeyTables,
    pd: u64,
    sges: &[Sge],
    offset: u64,
    len: u64,
    needed: Access,
) -> std::result::Result<Pieces<'k>, Unlocated> {
    let mut found = Pieces::new();
    let mut total = 0;
    for (lkey, addr, n) in pieces(sges, offset, len) {
        let reg = keys
            .translations
            .get(&lkey)
            .filter(|reg| reg.pd == pd && reg.access.contains(needed) && reg.contains(addr, n))
            .ok_or(Unlocated::Protection)?;
        found.push(reg.piece(addr, n));
        total += n;
    }
    if total != len {
        return Err(Unlocated::Length);
    }
    Ok(found)
}

/// The side of a transfer that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Source,
    Target,
}

impl Side {
    /// Why a SEND's or WRITE's chunk stopped when `self` failed its transfer.
    fn stopped(self) -> Stopped {
        match self {
            Side::Source => Stopped::Gather(WcStatus::LocalProtectionError),
            Side::Target => Stopped::Target,
        }
    }
}

/// Why a SEND's or WRITE's chunk did not move.
#[derive(Debug, Clone, Copy)]
enum Stopped {
    /// The requester's own gather list failed: it completes with this status and the
    /// responder sees nothing.
    Gather(WcStatus),
    /// The responder QP does not grant the operation (`qp_access_flags`).
    Refused,
    /// The responder's side failed (the rkey and what it reaches, or the receive's
    /// scatter list): what each side completes with is the operation's.
    Target,
}

/// Copies a message from its source pieces to its target pieces, piece by piece, in one
/// pass: memory to memory, no buffer between (the pieces hold the same number of bytes).
fn transfer(source: &[Piece<'_>], target: &[Piece<'_>]) -> std::result::Result<(), Side> {
    let (mut i, mut j, mut from, mut to) = (0, 0, 0, 0);
    while let (Some(s), Some(t)) = (source.get(i), target.get(j)) {
        let n = (s.len - from).min(t.len - to);
        s.memory
            .copy_to(s.at + from, t.memory, t.at + to, n)
            .map_err(|e| match e {
                CopyError::Source(_) => Side::Source,
                CopyError::Target(_) => Side::Target,
            })?;
        from += n;
        to += n;
        if from == s.len {
            (i, from) = (i + 1, 0);
        }
        if to == t.len {
            (j, to) = (j + 1, 0);
        }
    }
    Ok(())
}

/// Writes `data` (as long as the pieces together) into `target`.
fn scatter_bytes(target: &[Piece<'_>], data: &[u8]) {
    let mut pos = 0;
    for piece in target {
        // Located inside a registration; cannot fail but for a punched hugepage.
        if let Err(e) = piece.memory.write_at(piece.at, &data[pos..pos + piece.len]) {
            tracing::error!("loopback: scatter failed: {e}");
        }
        pos += piece.len;
    }
}

impl LoopbackQp {
    /// Why request `wr_id` with `sges` SGEs cannot join `queue`, which holds `queued`
    /// requests, as request `posted` of the `total` in one post; `None` when it can.
    fn refuse(
        &self,
        queue: &WorkQueue,
        wr_id: u64,
        sges: usize,
        queued: usize,
        (posted, total): (usize, usize),
    ) -> Option<ProviderError> {
        let max_sge = (queue.max_sge)(&self.inner);
        if sges > max_sge {
            return Some(self.invalid(format!(
                "{} {wr_id:#x} has {sges} SGEs, more than {} {max_sge} ({posted} of {total} posted)",
                queue.request, queue.sge_limit
            )));
        }
        if queued >= (queue.max_wr)(&self.inner) {
            tracing::debug!(
                "loopback QP {:#x}: {} queue full, {posted} of {total} posted",
                self.inner.qp_num,
                queue.queue
            );
            return Some(os_error(self.name(), queue.verb, libc::ENOMEM));
        }
        None
    }

    fn name(&self) -> &str {
        &self.inner.pd.device.name
    }

    fn invalid(&self, message: String) -> ProviderError {
        ProviderError::invalid(
            self.name(),
            format!("QP {:#x}: {message}", self.inner.qp_num),
        )
    }

    /// An inline request must be a SEND or WRITE within the QP's `max_inline_data` (rxe's
    /// `validate_send_wr`: EINVAL otherwise).
    fn check_inline(&self, wr: &SendWr) -> std::result::Result<(), &'static str> {
        if !wr.inline {
            return Ok(());
        }
        if !matches!(wr.op, SendOp::Send { .. } | SendOp::Write { .. }) {
            return Err("only SENDs and WRITEs carry inline data");
        }
        if wr.message_len() > self.inner.max_inline_data {
            return Err("more inline data than the QP's max_inline_data");
        }
        Ok(())
    }

    /// What the verbs provider refuses when posting a bind (so both refuse alike): a
    /// window or region of another provider or device, or a type-1 window (type-1 windows
    /// are bound with `ibv_bind_mw`, which the trait does not offer).
    fn check_bind(&self, wr: &SendWr) -> std::result::Result<(), &'static str> {
        let SendOp::BindMw { mw, mr, .. } = &wr.op else {
            return Ok(());
        };
        let device = &self.inner.pd.device;
        let mw = mw
            .as_any()
            .downcast_ref::<LoopbackMw>()
            .ok_or("the window is not a loopback window")?;
        let mr = mr
            .as_any()
            .downcast_ref::<LoopbackMr>()
            .ok_or("the region is not a loopback region")?;
        if mw.kind != MwType::Type2 {
            return Err("only type-2 windows are bound with a work request");
        }
        if !Arc::ptr_eq(&mw.pd.device, device) || !Arc::ptr_eq(&mr.pd.device, device) {
            return Err("the window or region belongs to another device");
        }
        Ok(())
    }

    /// Queues what is left of a call's requests (`of` in all, `posted` of them taken so far,
    /// on top of the `held` the queue held when the call came), in order; the error of the
    /// first the queue does not take.
    fn queue_rest(
        &self,
        data: &mut QpData,
        rest: &mut std::slice::Iter<'_, SendWr>,
        held: usize,
        posted: &mut usize,
        of: usize,
    ) -> Option<ProviderError> {
        for wr in rest {
            if let Err(error) = self.admit(wr, held + *posted, *posted, of) {
                return Some(error);
            }
            *posted += 1;
            data.sq.push_back(Pending {
                wr: wr.clone(),
                waiting: None,
                progress: Progress::default(),
            });
        }
        None
    }

    /// Whether the send queue takes `wr` (the `posted`-th of `of` in its call) with `queued`
    /// requests ahead of it: a bind and inline data the device supports, and room.
    fn admit(
        &self,
        wr: &SendWr,
        queued: usize,
        posted: usize,
        of: usize,
    ) -> std::result::Result<(), ProviderError> {
        if let Err(message) = self.check_bind(wr).and_then(|()| self.check_inline(wr)) {
            return Err(self.invalid(format!(
                "work request {:#x}: {message} ({posted} of {of} posted)",
                wr.wr_id
            )));
        }
        match self.refuse(&SEND_QUEUE, wr.wr_id, wr.sges.len(), queued, (posted, of)) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    fn kick_self_and(&self, peer: Option<u32>) {
        let inner = Arc::clone(&self.inner);
        drive(&self.inner.pd.device, |ex| {
            ex.run(&inner);
            ex.kicks.extend(peer);
        });
    }
}

impl QueuePair for LoopbackQp {
    fn qp_num(&self) -> u32 {
        self.inner.qp_num
    }

    fn state(&self) -> Result<QpState> {
        Ok(lock(&self.inner.data).state)
    }

    fn to_init(&self, port: u8, access: Access) -> Result<()> {
        check_port(self.name(), port)?;
        let mut data = lock(&self.inner.data);
        match data.state {
            QpState::Reset | QpState::Init => {
                data.state = QpState::Init;
                data.access = access;
                Ok(())
            }
            state => Err(self.invalid(format!("cannot move from {state:?} to INIT"))),
        }
    }

    fn to_rtr(&self, remote: &RemoteEndpoint, attrs: &RtrAttributes) -> Result<()> {
        check_port(self.name(), attrs.port)?;
        if !self
            .inner
            .pd
            .device
            .gids()
            .iter()
            .any(|g| g.index == attrs.sgid_index)
        {
            return Err(self.invalid(format!("GID index {} does not exist", attrs.sgid_index)));
        }
        if ![256, 512, 1024, 2048, 4096].contains(&attrs.path_mtu) || attrs.path_mtu > PORT_MTU {
            return Err(self.invalid(format!("path MTU {} is not valid", attrs.path_mtu)));
        }
        if remote.qp_num > QPN_MASK || remote.psn > QPN_MASK {
            return Err(self.invalid(format!(
                "remote QP number {:#x} / PSN {:#x} exceed 24 bits",
                remote.qp_num, remote.psn
            )));
        }
        if u32::from(attrs.max_dest_rd_atomic) > MAX_QP_RD_ATOM || attrs.min_rnr_timer > 31 {
            return Err(self.invalid(format!("invalid RTR attributes {attrs:?}")));
        }
        {
            let mut data = lock(&self.inner.data);
            if data.state != QpState::Init {
                return Err(self.invalid(format!("cannot move from {:?} to RTR", data.state)));
            }
            data.state = QpState::Rtr;
            data.remote = Some(remote.clone());
            data.min_rnr_timer = attrs.min_rnr_timer;
        }
        // The peer may be retrying towards us already.
        drive(&self.inner.pd.device, |ex| ex.kicks.push(remote.qp_num));
        Ok(())
    }

    fn to_rts(&self, attrs: &RtsAttributes) -> Result<()> {
        if attrs.psn > QPN_MASK
            || attrs.timeout > 31
            || attrs.retry_cnt > 7
            || attrs.rnr_retry > 7
            || u32::from(attrs.max_rd_atomic) > MAX_QP_RD_ATOM
        {
            return Err(self.invalid(format!("invalid RTS attributes {attrs:?}")));
        }
        let mut data = lock(&self.inner.data);
        match data.state {
            QpState::Rtr | QpState::Rts => {
                data.state = QpState::Rts;
                data.timeout = attrs.timeout;
                data.retry_cnt = attrs.retry_cnt;
                data.rnr_retry = attrs.rnr_retry;
                Ok(())
            }
            state => Err(self.invalid(format!("cannot move from {state:?} to RTS"))),
        }
    }

    fn to_error(&self) -> Result<()> {
        // As the kernel: any state but RESET may move to ERR.
        if lock(&self.inner.data).state == QpState::Reset {
            return Err(self.invalid("cannot move from Reset to ERR".to_owned()));
        }
        let inner = Arc::clone(&self.inner);
        drive(&self.inner.pd.device, |ex| ex.error(&inner));
        Ok(())
    }

    /// Takes `wrs` in order and runs them in this turn. Every request of the call counts
    /// against the send queue's depth as if the call had queued them all before running any
    /// (as a device does, which sees the list only when it is rung). A request that finds the
    /// queue empty (nothing ahead of it, the head not out), the QP ready and the turn's budget
    /// not spent runs straight from `wrs`, in the head's place; if it is left part-done or
    /// waiting for its peer it is copied to the front of the queue, if it fails it completes
    /// with its error, and either way the requests after it join the queue first, so an error
    /// flushes them as it would have. The other requests are queued, and the queue runs as
    /// after every post.
    fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        let inner = &self.inner;
        let mut posted = 0;
        let mut refused = None;
        let mut not_ready = None;
        drive(&inner.pd.device, |ex| {
            let mut data = lock(&inner.data);
            if !matches!(data.state, QpState::Rts | QpState::Error) {
                // rxe: EINVAL before the send queue is ready. An ERROR QP accepts work and
                // flushes it.
                not_ready = Some(data.state);
                return;
            }
            // What the queue held when the call came: each request admitted counts on top.
            let held = data.sq.len() + usize::from(data.head_out);
            let mut budget = TURN_BYTES;
            let mut ran = false;
            let mut spent = false;
            let mut rest = wrs.iter();
            loop {
                let free = data.state == QpState::Rts && data.sq.is_empty() && !data.head_out;
                if !free || budget == 0 {
                    spent = free;
                    refused = self.queue_rest(&mut data, &mut rest, held, &mut posted, wrs.len());
                    break;
                }
                let Some(wr) = rest.next() else { break };
                if let Err(error) = self.admit(wr, held + posted, posted, wrs.len()) {
                    refused = Some(error);
                    break;
                }
                posted += 1;
                ran = true;
                data.head_out = true;
                drop(data);
                let mut progress = Progress::default();
                let step = ex.execute(inner, wr, &mut progress, &mut budget);
                budget = budget.saturating_sub(REQUEST_COST.min(budget));
                data = lock(&inner.data);
                if let Step::Done(byte_len) = step {
                    // Its completion in the critical section that gives its place up, as
                    // `Exec::run` does.
                    data.head_out = false;
                    let Some(wc) = completion(inner, wr, byte_len) else {
                        continue;
                    };
                    if inner.send_cq.push(wc) {
                        continue;
                    }
                    refused = self.queue_rest(&mut data, &mut rest, held, &mut posted, wrs.len());
                    drop(data);
                    ex.error(inner);
                } else {
                    refused = self.queue_rest(&mut data, &mut rest, held, &mut posted, wrs.len());
                    drop(data);
                    let head = Pending {
                        wr: wr.clone(),
                        waiting: None,
                        progress,
                    };
                    ex.settle(inner, head, step);
                }
                data = lock(&inner.data);
                break;
            }
            let (queued, in_error) = (!data.sq.is_empty(), data.state == QpState::Error);
            drop(data);
            if !queued || posted == 0 {
                // Nothing new to run (a call the queue took nothing of does not run it).
                return;
            }
            if !ran || in_error {
                // As after every post: the queue runs (an ERROR QP's is flushed).
                ex.run(inner);
            } else if spent {
                // The turn is spent: the next poll of the send CQ runs the rest.
                inner.send_cq.continue_later(inner);
            }
            // Otherwise a request that ran here and did not finish is back at the head
            // with the rest behind it, and `settle` has arranged what comes next.
        });
        if let Some(state) = not_ready {
            return Err(PostError::none(
                self.invalid(format!("post_send in state {state:?}: sends need RTS")),
            ));
        }
        refused.map_or(Ok(()), |error| Err(PostError { posted, error }))
    }

    fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        let mut posted = 0;
        let mut refused = None;
        let peer;
        {
            let mut data = lock(&self.inner.data);
            if data.state == QpState::Reset {
                return Err(PostError::none(
                    self.invalid("post_recv in state Reset".to_owned()),
                ));
            }
            peer = data.remote.as_ref().map(|r| r.qp_num);
            for wr in wrs {
                let (queued, asked) = (data.rq.len(), (posted, wrs.len()));
                if let Some(error) =
                    self.refuse(&RECV_QUEUE, wr.wr_id, wr.sges.len(), queued, asked)
                {
                    refused = Some(error);
                    break;
                }
                data.rq.push_back(wr.clone());
                posted += 1;
            }
        }
        if posted > 0 {
            // Flushes us if we are in error; lets a peer waiting on RNR deliver.
            self.kick_self_and(peer);
        }
        refused.map_or(Ok(()), |error| Err(PostError { posted, error }))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for LoopbackQp {
    fn drop(&mut self) {
        let device = Arc::clone(&self.inner.pd.device);
        let id = self.inner.id;
        let still_bound = lock(&device.keys)
            .windows
            .values()
            .filter(|w| w.binding.as_ref().is_some_and(|b| b.qp == Some(id)))
            .count();
        if still_bound > 0 {
            // rxe blocks ~50 s (and WARNs) destroying a QP with a valid type-2 window; here
            // the windows simply stop working. Flag it: the same code would hang on rxe.
            tracing::warn!(
                "loopback {}: QP {:#x} destroyed with {still_bound} type-2 window(s) still bound \
                 through it (rxe would block ~50 s): invalidate windows before their QP",
                device.name,
                self.inner.qp_num
            );
        }
        let inner = &self.inner;
        drive(&device, |ex| {
            // The kept peer may be this QP or its peer (see `Held::peer`), and its send
            // CQ may list it for another turn.
            ex.held.peer = None;
            inner.send_cq.forget(inner);
            {
                let mut qps = lock(&device.qps);
                if qps
                    .get(&inner.qp_num)
                    .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(inner)))
                {
                    qps.remove(&inner.qp_num);
                }
            }
            // Destroying a QP completes nothing; its work requests are discarded.
            let (sq, rq, peer) = {
                let mut data = lock(&inner.data);
                data.state = QpState::Error;
                (
                    std::mem::take(&mut data.sq),
                    std::mem::take(&mut data.rq),
                    data.remote.as_ref().map(|r| r.qp_num),
                )
            };
            for pending in &sq {
                ex.give_back(inner, &pending.progress);
            }
            drop((sq, rq));
            // A peer waiting on us now times out.
            ex.kicks.extend(peer);
        });
    }
}
/// One of a QP's two work queues, as `post_send` and `post_recv` check a request for it.
struct WorkQueue {
    /// What a request on it is called in errors.
    request: &'static str,
    /// The queue's name in logs.
    queue: &'static str,
    /// The QP attribute that limits a request's SGEs.
    sge_limit: &'static str,
    /// The verb a full queue fails, as a device would fail it.
    verb: &'static str,
    max_sge: fn(&QpInner) -> usize,
    max_wr: fn(&QpInner) -> usize,
}

const SEND_QUEUE: WorkQueue = WorkQueue {
    request: "work request",
    queue: "send",
    sge_limit: "max_send_sge",
    verb: "ibv_post_send",
    max_sge: |q| q.max_send_sge,
    max_wr: |q| q.max_send_wr,
};

const RECV_QUEUE: WorkQueue = WorkQueue {
    request: "receive",
    queue: "receive",
    sge_limit: "max_recv_sge",
    verb: "ibv_post_recv",
    max_sge: |q| q.max_recv_sge,
    max_wr: |q| q.max_recv_wr,
};
