//! Completion queues and RC queue pairs. A QP is an rdmad queue pair: its work requests go
//! to the rings rdmad mapped for it, their SGEs translated from the program's MRs (lkey,
//! address) to rdmad's regions (region, offset) — the bytes themselves are never copied.
//! A CQ is the library's: `ibv_poll_cq` takes completions from the rings of the QPs that
//! complete into it, and keeps for another CQ what belongs there (a QP whose send and
//! receive CQs differ).
//!
//! The verbs states map onto rdmad's calls: INIT is recorded (receives posted then are
//! kept in order), RTR is `Connect` receive-only with the peer's address, QPN and PSN and
//! the program's own GID index, RTS is `Ready` with the program's own send PSN — what it
//! told its peer.

use std::collections::VecDeque;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::Mutex;

use rdmad_client::queue_pair::QueuePairRing;
use rdmad_client::ring::{Completion, Opcode, RegionSge, RegionSges, Status, Submission, MAX_SGE};
use rdmad_client::types::Endpoint;
use zbus::zvariant::OwnedObjectPath;

use super::registry::{self, lock, Context};
use super::{events, memory, set_errno, sys};
use crate::backend;

/// The data path's state, behind one lock: every CQ and QP of the process. A program's
/// verbs calls on different queues do not overlap in rdmad's ring accesses anyway (each
/// is a few loads and stores).
// Boxed: the program holds pointers to the raw structures, which must not move.
#[allow(clippy::vec_box)]
#[derive(Default)]
pub(super) struct DataPath {
    cqs: Vec<Box<Cq>>,
    qps: Vec<Box<Qp>>,
}

static DATA_PATH: Mutex<DataPath> = Mutex::new(DataPath {
    cqs: Vec::new(),
    qps: Vec::new(),
});

#[repr(C)]
struct Cq {
    raw: sys::ibv_cq,
    /// Completions taken from a ring for this CQ while another CQ was polled.
    pending: VecDeque<sys::ibv_wc>,
    /// Armed by `ibv_req_notify_cq`: its next completion raises an event on its channel.
    armed: bool,
    /// Events handed out, and acknowledged (`ibv_ack_cq_events`).
    events: u64,
    acked: u64,
}

/// Verbs state of a QP as the program moved it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Reset,
    Init,
    Rtr,
    Rts,
    Error,
}

#[repr(C)]
struct Qp {
    raw: sys::ibv_qp,
    path: OwnedObjectPath,
    ring: QueuePairRing,
    state: State,
    sq_sig_all: bool,
    cap: sys::ibv_qp_cap,
    /// The peer, once connected at RTR, and the local GID index the program chose.
    remote: Option<(Endpoint, Option<u32>)>,
    access: u32,
    port: u8,
    path_mtu: u32,
    /// Receives posted in INIT, before the queue pair is connected.
    early_recvs: Vec<Submission>,
    /// The sends not known complete.
    sends: SendQueue,
    /// Where inline data is copied, if the QP takes any.
    inline: Option<InlineStaging>,
}

/// The send queue as the library sees it. Each send goes on rdmad's ring with its
/// sequence number as its `wr_id` (the program's own is kept here), so a completion names
/// exactly its send. The device completes a send queue in order: a send it completed —
/// successfully or not — completes every send before it. rdmad's own refusals of a request
/// (before the device saw it) may arrive out of that order and complete only themselves.
/// As on a device, at most `depth` sends may be outstanding: a program that never asks for
/// a completion fills the queue (`ENOMEM`).
#[derive(Debug, Default)]
struct SendQueue {
    /// The program's `wr_id`s of the sends from `first_open` on.
    ids: VecDeque<u64>,
    /// The oldest send not known complete.
    first_open: u64,
    depth: u64,
}

impl SendQueue {
    fn next(&self) -> u64 {
        self.first_open + self.ids.len() as u64
    }

    fn full(&self) -> bool {
        self.ids.len() as u64 >= self.depth
    }

    /// Takes a send: its sequence number, the `wr_id` rdmad's ring carries.
    fn push(&mut self, wr_id: u64) -> u64 {
        self.ids.push_back(wr_id);
        self.next() - 1
    }

    /// A send the library could not submit after all (the ring was full).
    fn unpush(&mut self) {
        self.ids.pop_back();
    }

    /// The completion of send `seq` with `status`: the program's `wr_id` for it (0 for a
    /// sequence number no send has, which only a scribbled ring can produce).
    fn complete(&mut self, seq: u64, status: Status) -> u64 {
        let Some(index) = seq
            .checked_sub(self.first_open)
            .filter(|i| *i < self.ids.len() as u64)
        else {
            return 0;
        };
        let wr_id = self.ids[index as usize];
        let in_order = !matches!(
            status,
            Status::InvalidEntry
                | Status::RegionAccessDenied
                | Status::QueueFull
                | Status::LocalLengthError
                | Status::DeviceError
        );
        if in_order {
            self.ids.drain(..=index as usize);
            self.first_open = seq + 1;
        }
        wr_id
    }
}

impl Qp {
    /// A completion taken from the ring, as the program sees it, and the CQ it belongs
    /// to (the send or the receive CQ); a send's completion also advances the send queue.
    fn take_completion(&mut self, mut c: Completion) -> (*mut sys::ibv_cq, sys::ibv_wc) {
        if c.opcode == Opcode::Recv {
            return (self.raw.recv_cq, work_completion(&c, self.raw.qp_num));
        }
        c.wr_id = self.sends.complete(c.wr_id, c.status);
        (self.raw.send_cq, work_completion(&c, self.raw.qp_num))
    }
}

/// Inline data (`IBV_SEND_INLINE`): the bytes are copied at post time into a slot of a
/// region of the QP's own, registered in its domain, and the request names that slot.
/// Slot `n % slots` holds send `n`'s bytes; send `n + slots` may be posted only once send
/// `n` is known complete, as the send queue's depth demands anyway.
struct InlineStaging {
    region: OwnedObjectPath,
    map: rdmad_client::mapping::RegionMapping,
    slot: usize,
    slots: u64,
}

/// The most inline data a QP takes per request.
const MAX_INLINE: u32 = 1024;

// SAFETY: the raw structures' pointers (context, PD, CQs) point at this library's objects,
// which outlive the QP (their destroy verbs refuse while it lives); every access to a CQ
// or QP goes through `DATA_PATH`'s lock.
unsafe impl Send for Cq {}
// SAFETY: as for `Cq`.
unsafe impl Send for Qp {}

pub(super) fn data_path() -> std::sync::MutexGuard<'static, DataPath> {
    lock(&DATA_PATH)
}

/// The context behind a pointer, if it is a live one of ours.
fn context<'a>(ptr: *const sys::ibv_context) -> Option<&'a Context> {
    if ptr.is_null() || !registry::is_context(ptr) {
        return None;
    }
    // SAFETY: registered contexts are `Box<Context>`s whose `raw` is the first field,
    // live until `ibv_close_device`, which refuses while CQs or QPs live.
    Some(unsafe { &*(ptr as *const Context) })
}

impl DataPath {
    fn cq(&mut self, ptr: *const sys::ibv_cq) -> Option<&mut Cq> {
        self.cqs
            .iter_mut()
            .find(|c| std::ptr::eq(&c.raw, ptr))
            .map(|c| &mut **c)
    }
    fn qp_index(&self, ptr: *const sys::ibv_qp) -> Option<usize> {
        self.qps.iter().position(|q| std::ptr::eq(&q.raw, ptr))
    }

    /// The QPs that complete into `cq`.
    fn qps_of(&mut self, cq: *const sys::ibv_cq) -> impl Iterator<Item = &mut Box<Qp>> {
        self.qps
            .iter_mut()
            .filter(move |q| std::ptr::eq(q.raw.send_cq, cq) || std::ptr::eq(q.raw.recv_cq, cq))
    }

    /// Arms `cq` (`ibv_req_notify_cq`): asks rdmad to write the completion pipes of its
    /// QPs' rings. Returns whether completions are already waiting (then the caller raises
    /// the event itself), or `None` if `cq` is not one of ours.
    pub(super) fn arm(&mut self, cq: *const sys::ibv_cq) -> Option<bool> {
        let c = self.cq(cq)?;
        if c.raw.channel.is_null() {
            // Nothing to notify: libibverbs accepts it all the same.
            return Some(false);
        }
        c.armed = true;
        let mut ready = !c.pending.is_empty();
        for q in self.qps_of(cq) {
            let asked = q.ring.request_wakeups(true);
            ready |= asked.is_err() || q.ring.has_completion().unwrap_or(true);
        }
        Some(ready)
    }

    /// An armed CQ of `channel` with a completion waiting, disarmed, and its context
    /// (`ibv_get_cq_event`); rings no armed CQ waits on any more stop asking rdmad for
    /// wake-ups.
    pub(super) fn take_event(
        &mut self,
        channel: *const sys::ibv_comp_channel,
    ) -> Option<(*mut sys::ibv_cq, *mut c_void)> {
        self.sort_split_rings();
        let qps = &self.qps;
        // A QP with one CQ for both queues: its ring's completions are that CQ's. One
        // with two: they were sorted into the CQs' pending completions just now.
        let ready = |c: &Cq| {
            let cq: *const sys::ibv_cq = &c.raw;
            !c.pending.is_empty()
                || qps.iter().any(|q| {
                    std::ptr::eq(q.raw.send_cq, cq)
                        && std::ptr::eq(q.raw.recv_cq, cq)
                        && q.ring.has_completion().unwrap_or(true)
                })
        };
        let c = self
            .cqs
            .iter_mut()
            .find(|c| c.armed && std::ptr::eq(c.raw.channel, channel) && ready(c))?;
        c.armed = false;
        c.events += 1;
        let found: *mut sys::ibv_cq = &mut c.raw;
        let context = c.raw.cq_context;
        // Another of the channel's armed CQs ready too (one pipe wake-up stood for both):
        // the channel stays readable for the next waiter.
        if self
            .cqs
            .iter()
            .any(|c| c.armed && std::ptr::eq(c.raw.channel, channel) && ready(c))
        {
            events::kick(channel);
        }
        let armed: Vec<*const sys::ibv_cq> = self
            .cqs
            .iter()
            .filter(|c| c.armed)
            .map(|c| &c.raw as *const sys::ibv_cq)
            .collect();
        for q in self.qps_of(found) {
            let still = armed
                .iter()
                .any(|&a| std::ptr::eq(q.raw.send_cq, a) || std::ptr::eq(q.raw.recv_cq, a));
            if !still {
                let _ = q.ring.request_wakeups(false);
            }
        }
        Some((found, context))
    }

    /// Moves the completions waiting in the rings of QPs whose send and receive CQs differ
    /// into those CQs' pending completions, so that which CQ has one is known without
    /// polling it (a receive completion must not raise the send CQ's event); an armed CQ
    /// that got one has its channel made readable.
    fn sort_split_rings(&mut self) {
        let mut sorted: Vec<(*mut sys::ibv_cq, sys::ibv_wc)> = Vec::new();
        for q in self.qps.iter_mut() {
            if std::ptr::eq(q.raw.send_cq, q.raw.recv_cq) {
                continue;
            }
            while let Ok(Some(c)) = q.ring.poll() {
                sorted.push(q.take_completion(c));
            }
        }
        for (target, wc) in sorted {
            if let Some(cq) = self.cq(target) {
                cq.pending.push_back(wc);
                if cq.armed {
                    events::kick(cq.raw.channel);
                }
            }
        }
    }

    /// Reads empty the completion pipe `fd` of one of the QPs, for `channel`; false if no
    /// QP has it any more, or rdmad closed its end. The wake-up may have been another
    /// channel's too (a QP whose send and receive CQs are on two channels): each other
    /// channel with an armed CQ of the QP is made readable.
    pub(super) fn drain(&mut self, channel: *const sys::ibv_comp_channel, fd: c_int) -> bool {
        use std::os::fd::AsRawFd;
        let Some(q) = self
            .qps
            .iter()
            .find(|q| q.ring.completion_fd().as_raw_fd() == fd)
        else {
            return false;
        };
        let open = q.ring.drain_wakeups().unwrap_or(false);
        let (send, recv) = (q.raw.send_cq, q.raw.recv_cq);
        for c in &self.cqs {
            let ours = std::ptr::eq(&c.raw, send) || std::ptr::eq(&c.raw, recv);
            if ours && c.armed && !std::ptr::eq(c.raw.channel, channel) {
                events::kick(c.raw.channel);
            }
        }
        open
    }

    /// `ibv_ack_cq_events`.
    pub(super) fn ack(&mut self, cq: *const sys::ibv_cq, n: c_uint) {
        if let Some(c) = self.cq(cq) {
            c.acked = (c.acked + u64::from(n)).min(c.events);
        }
    }
}

/// Whether a CQ still uses `channel` (`ibv_destroy_comp_channel` refuses then).
pub fn channel_in_use(channel: *const sys::ibv_comp_channel) -> bool {
    data_path()
        .cqs
        .iter()
        .any(|c| std::ptr::eq(c.raw.channel, channel))
}

/// Forgets the context's QPs and CQs (`ibv_close_device`): closing its session releases
/// the queue pairs in rdmad.
pub fn release_context(ctx: *const sys::ibv_context) {
    let mut dp = data_path();
    dp.qps.retain(|q| !std::ptr::eq(q.raw.context, ctx));
    dp.cqs.retain(|c| !std::ptr::eq(c.raw.context, ctx));
}

/// Whether a PD still has QPs.
pub fn pd_has_queues(pd: *const sys::ibv_pd) -> bool {
    data_path().qps.iter().any(|q| std::ptr::eq(q.raw.pd, pd))
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_create_cq(
    ctx: *mut sys::ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut sys::ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut sys::ibv_cq {
    if context(ctx).is_none() || cqe <= 0 {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    if !channel.is_null() && !registry::is_channel(channel) {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    static HANDLES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let mut cq = Box::new(Cq {
        raw: sys::ibv_cq {
            context: ctx,
            channel,
            cq_context,
            handle: HANDLES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            cqe,
            ..Default::default()
        },
        pending: VecDeque::new(),
        armed: false,
        events: 0,
        acked: 0,
    });
    let ptr: *mut sys::ibv_cq = &mut cq.raw;
    data_path().cqs.push(cq);
    ptr
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_destroy_cq(cq: *mut sys::ibv_cq) -> c_int {
    let mut dp = data_path();
    let Some(i) = dp.cqs.iter().position(|c| std::ptr::eq(&c.raw, cq)) else {
        return libc::EINVAL;
    };
    if dp
        .qps
        .iter()
        .any(|q| std::ptr::eq(q.raw.send_cq, cq) || std::ptr::eq(q.raw.recv_cq, cq))
    {
        return libc::EBUSY;
    }
    dp.cqs.remove(i);
    0
}

fn mtu_bytes(mtu: sys::ibv_mtu) -> u32 {
    match mtu {
        sys::ibv_mtu_IBV_MTU_256 => 256,
        sys::ibv_mtu_IBV_MTU_512 => 512,
        sys::ibv_mtu_IBV_MTU_1024 => 1024,
        sys::ibv_mtu_IBV_MTU_2048 => 2048,
        _ => 4096,
    }
}

fn mtu_enum(bytes: u32) -> sys::ibv_mtu {
    match bytes {
        256 => sys::ibv_mtu_IBV_MTU_256,
        512 => sys::ibv_mtu_IBV_MTU_512,
        1024 => sys::ibv_mtu_IBV_MTU_1024,
        2048 => sys::ibv_mtu_IBV_MTU_2048,
        _ => sys::ibv_mtu_IBV_MTU_4096,
    }
}

fn qp_state(state: State) -> sys::ibv_qp_state {
    match state {
        State::Reset => sys::ibv_qp_state_IBV_QPS_RESET,
        State::Init => sys::ibv_qp_state_IBV_QPS_INIT,
        State::Rtr => sys::ibv_qp_state_IBV_QPS_RTR,
        State::Rts => sys::ibv_qp_state_IBV_QPS_RTS,
        State::Error => sys::ibv_qp_state_IBV_QPS_ERR,
    }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_create_qp(
    pd: *mut sys::ibv_pd,
    attr: *mut sys::ibv_qp_init_attr,
) -> *mut sys::ibv_qp {
    let Some(pd_raw) = registry::pd(pd) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: the caller passes a `struct ibv_qp_init_attr`; the library updates its `cap`.
    let attr = unsafe { &mut *attr };
    if attr.qp_type != sys::ibv_qp_type_IBV_QPT_RC || !attr.srq.is_null() {
        eprintln!("rdmad-verbs: ibv_create_qp: only RC queue pairs without an SRQ are supported");
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    }
    let cap = attr.cap;
    if cap.max_inline_data > MAX_INLINE {
        eprintln!(
            "rdmad-verbs: ibv_create_qp: {} bytes of inline data asked, at most {MAX_INLINE} \
             are offered",
            cap.max_inline_data
        );
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    if cap.max_send_sge as usize > MAX_SGE || cap.max_recv_sge as usize > MAX_SGE {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let Some(context) = context(pd_raw.context) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    {
        let mut dp = data_path();
        if dp.cq(attr.send_cq).is_none() || dp.cq(attr.recv_cq).is_none() {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        }
    }
    let backend = match backend::backend() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("rdmad-verbs: {e}");
            set_errno(libc::ECONNREFUSED);
            return std::ptr::null_mut();
        }
    };
    let max_sge = cap.max_send_sge.max(cap.max_recv_sge).max(1);
    // The PD's handle is its domain in the session: the QP uses the registrations of its
    // own PD's MRs, and its peer reaches their rkeys.
    let (path, ring, endpoint, info) = match backend.create_queue_pair(
        &context.session,
        &context.info.name,
        pd_raw.handle,
        (cap.max_send_wr.max(1), cap.max_recv_wr.max(1), max_sge),
    ) {
        Ok(q) => q,
        Err((quota, e)) => {
            eprintln!("rdmad-verbs: ibv_create_qp: {e}");
            set_errno(if quota { libc::ENOMEM } else { libc::EINVAL });
            return std::ptr::null_mut();
        }
    };
    let max_send_wr = cap.max_send_wr.max(1).min(info.sq_entries);
    let inline = if cap.max_inline_data > 0 {
        match inline_staging(
            backend,
            context,
            pd_raw.handle,
            cap.max_inline_data,
            max_send_wr,
        ) {
            Ok(staging) => Some(staging),
            Err((errno, e)) => {
                eprintln!("rdmad-verbs: ibv_create_qp: inline data: {e}");
                if let Err(e) = backend.destroy_queue_pair(&path) {
                    eprintln!("rdmad-verbs: {e}");
                }
                set_errno(errno);
                return std::ptr::null_mut();
            }
        }
    } else {
        None
    };
    let granted = sys::ibv_qp_cap {
        max_send_wr,
        max_recv_wr: cap.max_recv_wr.max(1),
        max_send_sge: max_sge,
        max_recv_sge: max_sge,
        max_inline_data: inline.as_ref().map_or(0, |i| i.slot as u32),
    };
    attr.cap = granted;
    static HANDLES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let mut qp = Box::new(Qp {
        raw: sys::ibv_qp {
            context: pd_raw.context,
            qp_context: attr.qp_context,
            pd,
            send_cq: attr.send_cq,
            recv_cq: attr.recv_cq,
            srq: std::ptr::null_mut(),
            handle: HANDLES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            qp_num: endpoint.qp_num,
            state: sys::ibv_qp_state_IBV_QPS_RESET,
            qp_type: sys::ibv_qp_type_IBV_QPT_RC,
            ..Default::default()
        },
        path,
        ring,
        state: State::Reset,
        sq_sig_all: attr.sq_sig_all != 0,
        cap: granted,
        remote: None,
        access: 0,
        port: 1,
        path_mtu: endpoint.mtu,
        early_recvs: Vec::new(),
        sends: SendQueue {
            depth: u64::from(max_send_wr),
            ..SendQueue::default()
        },
        inline,
    });
    // The channels of its CQs hear of its completions.
    for cq in [attr.send_cq, attr.recv_cq] {
        // SAFETY: both are live CQs of ours (checked above; a CQ outlives its QPs).
        let channel = unsafe { (*cq).channel };
        if let Err(e) = events::watch(channel, qp.ring.completion_fd()) {
            eprintln!("rdmad-verbs: ibv_create_qp: cannot watch the completion channel: {e}");
        }
    }
    let ptr: *mut sys::ibv_qp = &mut qp.raw;
    let mut dp = data_path();
    // A CQ armed before its QP existed wakes for this QP's completions too.
    let armed = [attr.send_cq, attr.recv_cq]
        .iter()
        .any(|&c| dp.cq(c).is_some_and(|c| c.armed));
    if armed {
        if let Err(e) = qp.ring.request_wakeups(true) {
            eprintln!("rdmad-verbs: ibv_create_qp: {e}");
        }
    }
    dp.qps.push(qp);
    ptr
}

/// A region of the QP's own for inline data: `slots` slots of `max_inline` bytes (rounded
/// up to a cache line), registered in domain `domain` and mapped here.
fn inline_staging(
    backend: &backend::Backend,
    context: &Context,
    domain: u32,
    max_inline: u32,
    slots: u32,
) -> Result<InlineStaging, (c_int, String)> {
    let slot = (max_inline as usize).div_ceil(64) * 64;
    let size = slot * slots as usize;
    let memory = |(quota, e): (bool, String)| (if quota { libc::ENOMEM } else { libc::EINVAL }, e);
    let (region, fd, granted) = backend
        .allocate_region(&context.session, &memory::pool(), size as u64)
        .map_err(memory)?;
    let staged = backend
        .register(&region, domain, (0, granted, 0), "l")
        .map_err(memory)
        .and_then(|_| {
            rdmad_client::mapping::RegionMapping::map(fd, size, true)
                .map_err(|e| (libc::ENOMEM, format!("cannot map its region: {e}")))
        });
    match staged {
        Ok(map) => Ok(InlineStaging {
            region,
            map,
            slot,
            slots: u64::from(slots),
        }),
        Err(e) => {
            // Its registration goes with it.
            if let Err(e) = backend.free_region(&region) {
                eprintln!("rdmad-verbs: {e}");
            }
            Err(e)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_destroy_qp(qp: *mut sys::ibv_qp) -> c_int {
    let q = {
        let mut dp = data_path();
        let Some(i) = dp.qp_index(qp) else {
            return libc::EINVAL;
        };
        dp.qps.remove(i)
    };
    if let Ok(b) = backend::backend() {
        if let Err(e) = b.destroy_queue_pair(&q.path) {
            eprintln!("rdmad-verbs: ibv_destroy_qp: {e}");
        }
        if let Some(staging) = &q.inline {
            if let Err(e) = b.free_region(&staging.region) {
                eprintln!("rdmad-verbs: ibv_destroy_qp: {e}");
            }
        }
    }
    0
}

/// Copies the bytes a request's SGEs point at into the QP's next inline slot and returns
/// the one SGE that names them, or the errno: `EINVAL` past `max_inline_data` or without
/// inline room, `ENOMEM` while the slot's previous send may still be read.
///
/// # Safety
/// `list` must point at `n` `struct ibv_sge`, each naming `length` readable bytes of the
/// program's at `addr` (what libibverbs asks of an inline send's SGEs).
unsafe fn stage_inline(q: &Qp, list: *const sys::ibv_sge, n: c_int) -> Result<RegionSge, c_int> {
    let staging = q.inline.as_ref().ok_or(libc::EINVAL)?;
    if n < 0 || (n > 0 && list.is_null()) {
        return Err(libc::EINVAL);
    }
    // The slot's previous send is known complete: at most `slots` (the depth) are open.
    if q.sends.full() {
        return Err(libc::ENOMEM);
    }
    let offset = (q.sends.next() % staging.slots) as usize * staging.slot;
    let mut at = 0usize;
    for i in 0..n as usize {
        // SAFETY: i < n, as the caller promised.
        let sge = unsafe { *list.add(i) };
        let len = sge.length as usize;
        if at + len > staging.slot {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller promised `length` readable bytes at `addr`.
        let bytes = unsafe { std::slice::from_raw_parts(sge.addr as *const u8, len) };
        staging
            .map
            .write(offset + at, bytes)
            .map_err(|_| libc::EINVAL)?;
        at += len;
    }
    Ok(RegionSge {
        region: rdmad_client::names::object_id(staging.region.as_str()).unwrap_or(0),
        offset: offset as u64,
        length: at as u32,
    })
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_modify_qp(
    qp: *mut sys::ibv_qp,
    attr: *mut sys::ibv_qp_attr,
    mask: c_int,
) -> c_int {
    if attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a `struct ibv_qp_attr`.
    let attr = unsafe { &*attr };
    let mask = mask as u32;
    let mut dp = data_path();
    let Some(i) = dp.qp_index(qp) else {
        return libc::EINVAL;
    };
    let q = &mut dp.qps[i];
    if mask & sys::ibv_qp_attr_mask_IBV_QP_STATE == 0 {
        // Attributes without a state change: rdmad sets them at the move to RTS.
        return 0;
    }
    let target = attr.qp_state;
    let result = match (q.state, target) {
        // INIT → INIT (librdmacm moves a connecting queue pair so before RTR) takes the
        // port and access flags again.
        (State::Reset | State::Init, sys::ibv_qp_state_IBV_QPS_INIT) => {
            if mask & sys::ibv_qp_attr_mask_IBV_QP_PORT != 0 {
                q.port = attr.port_num;
            }
            if mask & sys::ibv_qp_attr_mask_IBV_QP_ACCESS_FLAGS != 0 {
                q.access = attr.qp_access_flags;
            }
            Ok(State::Init)
        }
        (State::Init, sys::ibv_qp_state_IBV_QPS_RTR) => {
            let needed = sys::ibv_qp_attr_mask_IBV_QP_AV
                | sys::ibv_qp_attr_mask_IBV_QP_PATH_MTU
                | sys::ibv_qp_attr_mask_IBV_QP_DEST_QPN
                | sys::ibv_qp_attr_mask_IBV_QP_RQ_PSN;
            if mask & needed != needed {
                Err(libc::EINVAL)
            } else {
                let ah = &attr.ah_attr;
                // SAFETY: `raw` is the union's only view: 16 bytes of GID.
                let raw = unsafe { ah.grh.dgid.raw };
                let gid = std::net::Ipv6Addr::from(raw);
                q.path_mtu = mtu_bytes(attr.path_mtu);
                let remote = Endpoint {
                    gid: gid.to_string(),
                    gid_index: 0,
                    qp_num: attr.dest_qp_num,
                    psn: attr.rq_psn,
                    mtu: q.path_mtu,
                    lid: ah.dlid,
                };
                let gid_index = (ah.is_global != 0).then_some(u32::from(ah.grh.sgid_index));
                match backend::backend()
                    .and_then(|b| b.connect_queue_pair(&q.path, &remote, gid_index))
                {
                    Ok(()) => {
                        q.remote = Some((remote, gid_index));
                        // Receives posted in INIT go to the ring now that the QP can
                        // take them.
                        for s in std::mem::take(&mut q.early_recvs) {
                            if let Err(e) = q.ring.submit(&s) {
                                eprintln!("rdmad-verbs: cannot queue a receive: {e}");
                            }
                        }
                        Ok(State::Rtr)
                    }
                    Err(e) => {
                        eprintln!("rdmad-verbs: ibv_modify_qp to RTR: {e}");
                        Err(libc::EINVAL)
                    }
                }
            }
        }
        (State::Rtr, sys::ibv_qp_state_IBV_QPS_RTS) => {
            let psn = if mask & sys::ibv_qp_attr_mask_IBV_QP_SQ_PSN != 0 {
                attr.sq_psn
            } else {
                0
            };
            match backend::backend().and_then(|b| b.ready_queue_pair(&q.path, psn)) {
                Ok(()) => Ok(State::Rts),
                Err(e) => {
                    eprintln!("rdmad-verbs: ibv_modify_qp to RTS: {e}");
                    Err(libc::EINVAL)
                }
            }
        }
        (State::Error, sys::ibv_qp_state_IBV_QPS_ERR) => Ok(State::Error),
        (_, sys::ibv_qp_state_IBV_QPS_ERR) => {
            // As on a device: what the QP holds completes with IBV_WC_WR_FLUSH_ERR.
            match backend::backend().and_then(|b| b.flush_queue_pair(&q.path)) {
                Ok(()) => Ok(State::Error),
                Err(e) => {
                    eprintln!("rdmad-verbs: ibv_modify_qp to ERR: {e}");
                    Err(libc::EINVAL)
                }
            }
        }
        (now, want) if qp_state(now) == want => Ok(now),
        _ => Err(libc::EINVAL),
    };
    match result {
        Ok(state) => {
            q.state = state;
            q.raw.state = qp_state(state);
            // Receives the library kept for the move to RTR never reached rdmad: they are
            // flushed here, as the device flushes those it holds.
            let flushed: Vec<sys::ibv_wc> = if state == State::Error {
                std::mem::take(&mut q.early_recvs)
                    .iter()
                    .map(|s| sys::ibv_wc {
                        wr_id: s.wr_id,
                        status: sys::ibv_wc_status_IBV_WC_WR_FLUSH_ERR,
                        opcode: sys::ibv_wc_opcode_IBV_WC_RECV,
                        qp_num: q.raw.qp_num,
                        ..Default::default()
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let recv_cq = q.raw.recv_cq;
            if !flushed.is_empty() {
                if let Some(cq) = dp.cq(recv_cq) {
                    cq.pending.extend(flushed);
                    if cq.armed {
                        events::kick(cq.raw.channel);
                    }
                }
            }
            0
        }
        Err(e) => e,
    }
}

#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_query_qp(
    qp: *mut sys::ibv_qp,
    attr: *mut sys::ibv_qp_attr,
    _mask: c_int,
    init_attr: *mut sys::ibv_qp_init_attr,
) -> c_int {
    if attr.is_null() || init_attr.is_null() {
        return libc::EINVAL;
    }
    let mut dp = data_path();
    let Some(i) = dp.qp_index(qp) else {
        return libc::EINVAL;
    };
    let q = &mut dp.qps[i];
    let mut a = sys::ibv_qp_attr {
        qp_state: qp_state(q.state),
        cur_qp_state: qp_state(q.state),
        path_mtu: mtu_enum(q.path_mtu),
        qp_access_flags: q.access,
        cap: q.cap,
        port_num: q.port,
        ..Default::default()
    };
    if let Some((remote, _)) = &q.remote {
        a.dest_qp_num = remote.qp_num;
        a.rq_psn = remote.psn;
    }
    let init = sys::ibv_qp_init_attr {
        qp_context: q.raw.qp_context,
        send_cq: q.raw.send_cq,
        recv_cq: q.raw.recv_cq,
        srq: std::ptr::null_mut(),
        cap: q.cap,
        qp_type: sys::ibv_qp_type_IBV_QPT_RC,
        sq_sig_all: c_int::from(q.sq_sig_all),
    };
    // SAFETY: the caller passes the two structures to fill.
    unsafe {
        attr.write(a);
        init_attr.write(init);
    }
    0
}

/// The SGEs of a work request as rdmad's (region, offset, length), or `None` if one is not
/// inside an MR of this context.
///
/// # Safety
/// `list` must point at `n` `struct ibv_sge` (the program's work request).
unsafe fn sges(context: usize, list: *const sys::ibv_sge, n: c_int) -> Option<RegionSges> {
    if n < 0 || n as usize > MAX_SGE || (n > 0 && list.is_null()) {
        return None;
    }
    let mut out = RegionSges::new();
    for i in 0..n as usize {
        // SAFETY: i < n, as the caller promised.
        let s = unsafe { *list.add(i) };
        let (region, offset) = memory::translate(context, s.lkey, s.addr, s.length)?;
        out.push(RegionSge {
            region,
            offset,
            length: s.length,
        });
    }
    Some(out)
}

unsafe extern "C" fn post_send(
    qp: *mut sys::ibv_qp,
    mut wr: *mut sys::ibv_send_wr,
    bad_wr: *mut *mut sys::ibv_send_wr,
) -> c_int {
    let mut dp = data_path();
    let fail = |wr: *mut sys::ibv_send_wr, e: c_int| {
        if !bad_wr.is_null() {
            // SAFETY: the caller passes somewhere to put the failed request.
            unsafe { *bad_wr = wr };
        }
        e
    };
    let Some(i) = dp.qp_index(qp) else {
        return fail(wr, libc::EINVAL);
    };
    let q = &mut dp.qps[i];
    // In ERR the device takes requests and flushes them (IBV_WC_WR_FLUSH_ERR), as rxe
    // and mlx5 do.
    if q.state != State::Rts && q.state != State::Error {
        return fail(wr, libc::EINVAL);
    }
    let context = q.raw.context as usize;
    while !wr.is_null() {
        // SAFETY: the program's list of work requests.
        let w = unsafe { &*wr };
        let inline = w.send_flags & sys::ibv_send_flags_IBV_SEND_INLINE != 0
            && matches!(
                w.opcode,
                sys::ibv_wr_opcode_IBV_WR_SEND
                    | sys::ibv_wr_opcode_IBV_WR_SEND_WITH_IMM
                    | sys::ibv_wr_opcode_IBV_WR_RDMA_WRITE
                    | sys::ibv_wr_opcode_IBV_WR_RDMA_WRITE_WITH_IMM
            );
        let sges = if inline {
            // SAFETY: the request's own SGE list, whose bytes an inline send copies now.
            match unsafe { stage_inline(q, w.sg_list, w.num_sge) } {
                Ok(sge) => rdmad_client::smallvec::smallvec![sge],
                Err(e) => return fail(wr, e),
            }
        } else {
            // SAFETY: the request's own SGE list.
            match unsafe { sges(context, w.sg_list, w.num_sge) } {
                Some(sges) => sges,
                None => return fail(wr, libc::EINVAL),
            }
        };
        // SAFETY: reading the unions as the opcode says they are filled.
        let (imm, rdma, atomic) = unsafe { (w.__bindgen_anon_1.imm_data, w.wr.rdma, w.wr.atomic) };
        let (opcode, imm, remote_addr, rkey, compare_add, swap) = match w.opcode {
            sys::ibv_wr_opcode_IBV_WR_SEND => (Opcode::Send, None, 0, 0, 0, 0),
            sys::ibv_wr_opcode_IBV_WR_SEND_WITH_IMM => (Opcode::Send, Some(imm), 0, 0, 0, 0),
            sys::ibv_wr_opcode_IBV_WR_RDMA_WRITE => {
                (Opcode::Write, None, rdma.remote_addr, rdma.rkey, 0, 0)
            }
            sys::ibv_wr_opcode_IBV_WR_RDMA_WRITE_WITH_IMM => {
                (Opcode::Write, Some(imm), rdma.remote_addr, rdma.rkey, 0, 0)
            }
            sys::ibv_wr_opcode_IBV_WR_RDMA_READ => {
                (Opcode::Read, None, rdma.remote_addr, rdma.rkey, 0, 0)
            }
            sys::ibv_wr_opcode_IBV_WR_ATOMIC_FETCH_AND_ADD => (
                Opcode::FetchAdd,
                None,
                atomic.remote_addr,
                atomic.rkey,
                atomic.compare_add,
                0,
            ),
            sys::ibv_wr_opcode_IBV_WR_ATOMIC_CMP_AND_SWP => (
                Opcode::CompareSwap,
                None,
                atomic.remote_addr,
                atomic.rkey,
                atomic.compare_add,
                atomic.swap,
            ),
            _ => return fail(wr, libc::EOPNOTSUPP),
        };
        if q.sends.full() {
            return fail(wr, libc::ENOMEM);
        }
        let seq = q.sends.push(w.wr_id);
        let submission = Submission {
            opcode,
            wr_id: seq,
            signaled: q.sq_sig_all || w.send_flags & sys::ibv_send_flags_IBV_SEND_SIGNALED != 0,
            imm,
            remote_addr,
            rkey,
            compare_add,
            swap,
            sges,
        };
        let submitted = q.ring.submit(&submission);
        if !matches!(submitted, Ok(Ok(()))) {
            q.sends.unpush();
        }
        match submitted {
            Ok(Ok(())) => {}
            Ok(Err(_full)) => return fail(wr, libc::ENOMEM),
            Err(_) => return fail(wr, libc::EIO),
        }
        wr = w.next;
    }
    0
}

unsafe extern "C" fn post_recv(
    qp: *mut sys::ibv_qp,
    mut wr: *mut sys::ibv_recv_wr,
    bad_wr: *mut *mut sys::ibv_recv_wr,
) -> c_int {
    let mut dp = data_path();
    let fail = |wr: *mut sys::ibv_recv_wr, e: c_int| {
        if !bad_wr.is_null() {
            // SAFETY: the caller passes somewhere to put the failed request.
            unsafe { *bad_wr = wr };
        }
        e
    };
    let Some(i) = dp.qp_index(qp) else {
        return fail(wr, libc::EINVAL);
    };
    let q = &mut dp.qps[i];
    if q.state == State::Reset {
        return fail(wr, libc::EINVAL);
    }
    let context = q.raw.context as usize;
    while !wr.is_null() {
        // SAFETY: the program's list of work requests.
        let w = unsafe { &*wr };
        // SAFETY: the request's own SGE list.
        let Some(sges) = (unsafe { sges(context, w.sg_list, w.num_sge) }) else {
            return fail(wr, libc::EINVAL);
        };
        let mut s = Submission::new(Opcode::Recv, w.wr_id, RegionSge::default());
        s.sges = sges;
        if matches!(q.state, State::Rtr | State::Rts | State::Error) {
            match q.ring.submit(&s) {
                Ok(Ok(())) => {}
                Ok(Err(_full)) => return fail(wr, libc::ENOMEM),
                Err(_) => return fail(wr, libc::EIO),
            }
        } else {
            if q.early_recvs.len() >= q.cap.max_recv_wr as usize {
                return fail(wr, libc::ENOMEM);
            }
            q.early_recvs.push(s);
        }
        wr = w.next;
    }
    0
}

fn wc_status(status: Status) -> sys::ibv_wc_status {
    match status {
        Status::Success => sys::ibv_wc_status_IBV_WC_SUCCESS,
        Status::LocalLengthError => sys::ibv_wc_status_IBV_WC_LOC_LEN_ERR,
        Status::LocalProtectionError | Status::RegionAccessDenied => {
            sys::ibv_wc_status_IBV_WC_LOC_PROT_ERR
        }
        Status::WrFlushError => sys::ibv_wc_status_IBV_WC_WR_FLUSH_ERR,
        Status::RemoteInvalidRequestError => sys::ibv_wc_status_IBV_WC_REM_INV_REQ_ERR,
        Status::RemoteAccessError => sys::ibv_wc_status_IBV_WC_REM_ACCESS_ERR,
        Status::RemoteOperationError => sys::ibv_wc_status_IBV_WC_REM_OP_ERR,
        Status::RetryExceeded => sys::ibv_wc_status_IBV_WC_RETRY_EXC_ERR,
        Status::RnrRetryExceeded => sys::ibv_wc_status_IBV_WC_RNR_RETRY_EXC_ERR,
        Status::InvalidEntry | Status::QueueFull => sys::ibv_wc_status_IBV_WC_LOC_QP_OP_ERR,
        Status::DeviceError => sys::ibv_wc_status_IBV_WC_GENERAL_ERR,
    }
}

fn work_completion(c: &Completion, qp_num: u32) -> sys::ibv_wc {
    let opcode = match c.opcode {
        Opcode::Send => sys::ibv_wc_opcode_IBV_WC_SEND,
        Opcode::Write => sys::ibv_wc_opcode_IBV_WC_RDMA_WRITE,
        Opcode::Read => sys::ibv_wc_opcode_IBV_WC_RDMA_READ,
        Opcode::FetchAdd => sys::ibv_wc_opcode_IBV_WC_FETCH_ADD,
        Opcode::CompareSwap => sys::ibv_wc_opcode_IBV_WC_COMP_SWAP,
        Opcode::Recv if c.imm.is_some() && c.byte_len == 0 => {
            sys::ibv_wc_opcode_IBV_WC_RECV_RDMA_WITH_IMM
        }
        Opcode::Recv => sys::ibv_wc_opcode_IBV_WC_RECV,
    };
    let mut wc = sys::ibv_wc {
        wr_id: c.wr_id,
        status: wc_status(c.status),
        opcode,
        vendor_err: c.detail,
        byte_len: c.byte_len,
        qp_num,
        wc_flags: if c.imm.is_some() {
            sys::ibv_wc_flags_IBV_WC_WITH_IMM
        } else {
            0
        },
        ..Default::default()
    };
    wc.__bindgen_anon_1.imm_data = c.imm.unwrap_or(0);
    wc
}

unsafe extern "C" fn poll_cq(cq: *mut sys::ibv_cq, n: c_int, wc: *mut sys::ibv_wc) -> c_int {
    if n < 0 || (n > 0 && wc.is_null()) {
        return -1;
    }
    let mut dp = data_path();
    let Some(this) = dp.cq(cq) else {
        return -1;
    };
    let mut got: Vec<sys::ibv_wc> = Vec::new();
    while got.len() < n as usize {
        match this.pending.pop_front() {
            Some(w) => got.push(w),
            None => break,
        }
    }
    let mut elsewhere: Vec<(*mut sys::ibv_cq, sys::ibv_wc)> = Vec::new();
    for q in dp.qps.iter_mut() {
        let (send, recv) = (q.raw.send_cq, q.raw.recv_cq);
        if !std::ptr::eq(send, cq) && !std::ptr::eq(recv, cq) {
            continue;
        }
        while got.len() < n as usize {
            let Ok(Some(c)) = q.ring.poll() else {
                break;
            };
            let (target, w) = q.take_completion(c);
            if std::ptr::eq(target, cq) {
                got.push(w);
            } else {
                elsewhere.push((target, w));
            }
        }
    }
    for (target, w) in elsewhere {
        if let Some(other) = dp.cq(target) {
            other.pending.push_back(w);
            if other.armed {
                // Its ring's wake-up was this CQ's to read: tell its channel.
                events::kick(other.raw.channel);
            }
        }
    }
    drop(dp);
    for (i, w) in got.iter().enumerate() {
        // SAFETY: the caller's array has room for `n` entries; i < n.
        unsafe { wc.add(i).write(*w) };
    }
    if got.is_empty() {
        // The "device" behind the ring is rdmad's worker, a thread that needs a CPU: a
        // program busy-polling an empty CQ (perftest, ibv_rc_pingpong) gives its CPU up
        // for a moment, else where spinners outnumber cores each completion would wait
        // for the scheduler's next tick (4 ms here) rather than microseconds.
        std::thread::yield_now();
    }
    got.len() as c_int
}

/// The data-path ops of every context (the inline verbs of `verbs.h` call them).
pub fn context_ops() -> sys::ibv_context_ops {
    sys::ibv_context_ops {
        poll_cq: Some(poll_cq),
        req_notify_cq: Some(events::req_notify_cq),
        post_send: Some(post_send),
        post_recv: Some(post_recv),
        ..Default::default()
    }
}

symver! {
    __rdmad_ibv_create_cq => "ibv_create_cq" @ "IBVERBS_1.1";
    __rdmad_ibv_destroy_cq => "ibv_destroy_cq" @ "IBVERBS_1.1";
    __rdmad_ibv_create_qp => "ibv_create_qp" @ "IBVERBS_1.1";
    __rdmad_ibv_destroy_qp => "ibv_destroy_qp" @ "IBVERBS_1.1";
    __rdmad_ibv_modify_qp => "ibv_modify_qp" @ "IBVERBS_1.1";
    __rdmad_ibv_query_qp => "ibv_query_qp" @ "IBVERBS_1.1";
}
