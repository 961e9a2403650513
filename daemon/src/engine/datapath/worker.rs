//! The data-path worker of one device: it consumes every QP's submission ring, copies each
//! entry out of shared memory before looking at it, checks and translates it, posts it to
//! the device, polls the CQs and writes completions back. When there is nothing to do for
//! a while it sets `SQ_NEED_WAKEUP` in every ring, arms the CQs and sleeps on the doorbell
//! and completion-channel descriptors (io_uring's SQPOLL is the model).

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use rdmad_client::ring::{self, header, Completion, Opcode, Status, Submission, SQE_SIZE};

use super::validate::{self, RegionRights, Work};
use crate::engine::qp::{QpId, QueuePairRecord};
use crate::lock::lock;
use crate::provider::{MemoryRegion, PostError, WcOpcode, WcStatus, WorkCompletion};

/// The QPs a worker serves, shared with the engine that adds and removes them.
#[derive(Debug, Default)]
pub struct WorkerQps {
    qps: Mutex<Vec<(QpId, Arc<QueuePairRecord>)>>,
    /// Bumped by every change; the worker copies it to `applied` once it has let go of
    /// removed QPs.
    wanted: Mutex<u64>,
    applied: Mutex<u64>,
    applied_cv: std::sync::Condvar,
}

/// The most submissions one QP gets taken in one pass of the worker: a QP with a full ring
/// waits for the next pass like every other, so each pass over N busy QPs costs at most N
/// such batches (and, on a software device, N turns of bounded copying).
const TAKE_PER_PASS: u32 = 64;

/// A request the device is working on: what the client called it, and what it pins.
struct InFlight {
    client_wr_id: u64,
    opcode: Opcode,
    signaled: bool,
    _pins: Vec<Arc<dyn MemoryRegion>>,
}

/// The worker's private view of one QP: its own copies of the indices (never read back
/// from shared memory), requests in flight, completions waiting for ring space.
struct QpState {
    id: QpId,
    record: Arc<QueuePairRecord>,
    /// The daemon's own requests (window binds and invalidations) and who waits for them.
    internal: HashMap<u64, std::sync::mpsc::Sender<Result<(), String>>>,
    sq_head: u32,
    cq_tail: u32,
    next_wr: u64,
    in_flight: HashMap<u64, InFlight>,
    sends: u32,
    recvs: u32,
    /// Completions waiting for room in the ring: bounded, because the worker stops taking
    /// submissions while it holds a ring's worth (see [`QpState::can_consume`]).
    backlog: VecDeque<Completion>,
    /// Whether `CQ_WAITING` is set in the ring.
    waiting: bool,
}

impl QpState {
    fn new(id: QpId, record: Arc<QueuePairRecord>) -> QpState {
        QpState {
            id,
            record,
            internal: HashMap::new(),
            sq_head: 0,
            cq_tail: 0,
            next_wr: 1,
            in_flight: HashMap::new(),
            sends: 0,
            recvs: 0,
            backlog: VecDeque::new(),
            waiting: false,
        }
    }

    /// Whether the worker takes submissions: not while a full ring of completions waits
    /// for the client to make room, so a client that never reads its completions cannot
    /// make the daemon hold more than a ring's worth (plus one batch) for it.
    fn can_consume(&self) -> bool {
        self.backlog.len() < self.record.layout.cq_entries as usize
    }

    /// Whether there is work the worker can do now, without waiting for the client.
    fn ready(&self) -> bool {
        let ring = &self.record.ring;
        let submitted = ring.load_u32(header::SQ_TAIL).unwrap_or(self.sq_head) != self.sq_head;
        let room = !self.backlog.is_empty()
            && ring
                .load_u32(header::CQ_HEAD)
                .map(|head| self.cq_tail.wrapping_sub(head) < self.record.layout.cq_entries)
                .unwrap_or(false);
        (submitted && self.can_consume()) || room || self.record.cq.needs_polling()
    }

    /// Publishes the ring's flags: `SQ_NEED_WAKEUP` as asked, `CQ_WAITING` as the backlog
    /// says.
    fn store_flags(&mut self, need_wakeup: bool) {
        self.waiting = !self.backlog.is_empty();
        let flags = if need_wakeup { ring::SQ_NEED_WAKEUP } else { 0 }
            | if self.waiting { ring::CQ_WAITING } else { 0 };
        let _ = self.record.ring.store_u32(header::SQ_FLAGS, flags);
        let _ = self
            .record
            .ring
            .store_u32(header::CQ_OVERFLOW, self.backlog.len() as u32);
    }

    fn refuse(&mut self, wr_id: u64, opcode: Opcode, status: Status, detail: u32) {
        if status != Status::DeviceError {
            self.record
                .counters
                .refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.backlog.push_back(Completion {
            wr_id,
            status,
            opcode,
            byte_len: 0,
            imm: None,
            detail,
        });
    }

    /// Consumes what the client submitted; returns whether there was anything.
    fn consume(&mut self, rights: &RegionRights) -> bool {
        if !self.can_consume() {
            return false;
        }
        let ring = Arc::clone(&self.record.ring);
        let layout = self.record.layout;
        let Ok(tail) = ring.load_u32(header::SQ_TAIL) else {
            return false;
        };
        let pending = tail.wrapping_sub(self.sq_head);
        if pending == 0 {
            return false;
        }
        if pending > layout.sq_entries {
            // An impossible tail: the client broke the protocol. Skip to it and say so once.
            tracing::warn!(
                qp = self.id,
                tail,
                head = self.sq_head,
                "submission tail out of range"
            );
            self.refuse(0, Opcode::Send, Status::InvalidEntry, 1);
            self.sq_head = tail;
            let _ = ring.store_u32(header::SQ_HEAD, self.sq_head);
            return true;
        }
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let mut staged = Vec::new();
        for _ in 0..pending.min(TAKE_PER_PASS) {
            let mut bytes = [0u8; SQE_SIZE];
            // Copy first: the client may rewrite the slot at any moment.
            if ring.read_at(layout.sqe(self.sq_head), &mut bytes).is_err() {
                break;
            }
            self.sq_head = self.sq_head.wrapping_add(1);
            let sub = match Submission::decode(&bytes) {
                Ok(s) => s,
                Err((wr_id, e)) => {
                    tracing::debug!(qp = self.id, "refused submission: {e}");
                    self.refuse(wr_id, Opcode::Send, Status::InvalidEntry, 0);
                    continue;
                }
            };
            let is_recv = sub.opcode == Opcode::Recv;
            let (depth, used) = if is_recv {
                (
                    self.record.options.recv_depth,
                    self.recvs + recvs.len() as u32,
                )
            } else {
                (
                    self.record.options.send_depth,
                    self.sends + sends.len() as u32,
                )
            };
            if used >= depth {
                self.refuse(sub.wr_id, sub.opcode, Status::QueueFull, depth);
                continue;
            }
            let wr = self.next_wr;
            match validate::check_length(&sub, self.record.max_message)
                .and_then(|()| validate::check(&sub, rights, self.record.options.max_sge, wr))
            {
                Ok(checked) => {
                    self.next_wr += 1;
                    match checked.work {
                        Work::Send(w) => sends.push(w),
                        Work::Recv(w) => recvs.push(w),
                    }
                    staged.push((
                        wr,
                        InFlight {
                            client_wr_id: sub.wr_id,
                            opcode: sub.opcode,
                            signaled: sub.signaled,
                            _pins: checked.pins,
                        },
                    ));
                }
                Err(refusal) => self.refuse(sub.wr_id, sub.opcode, refusal.status, refusal.detail),
            }
        }
        let _ = ring.store_u32(header::SQ_HEAD, self.sq_head);
        // Exactly the requests the device took are in flight (and keep their regions
        // pinned until they complete); the rest of a batch it stopped part-way is refused.
        let taken = |what: &str, len: usize, result: Result<(), PostError>| match result {
            Ok(()) => len,
            Err(e) => {
                tracing::debug!(qp = self.id, "{what}: {e}");
                e.posted
            }
        };
        let mut posted = std::collections::HashSet::new();
        if !recvs.is_empty() {
            let n = taken("post_recv", recvs.len(), self.record.qp.post_recv(&recvs));
            posted.extend(recvs.iter().take(n).map(|w| w.wr_id));
        }
        if !sends.is_empty() {
            let n = taken("post_send", sends.len(), self.record.qp.post_send(&sends));
            posted.extend(sends.iter().take(n).map(|w| w.wr_id));
        }
        for (wr, flight) in staged {
            if posted.contains(&wr) {
                if flight.opcode == Opcode::Recv {
                    self.recvs += 1;
                } else {
                    self.sends += 1;
                }
                self.in_flight.insert(wr, flight);
                self.record
                    .counters
                    .posted
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            } else {
                self.refuse(flight.client_wr_id, flight.opcode, Status::DeviceError, 0);
            }
        }
        true
    }

    /// Takes completions from the CQ; returns whether there were any.
    fn reap(&mut self) -> bool {
        let mut wcs: Vec<WorkCompletion> = Vec::new();
        if let Err(e) = self.record.cq.poll(&mut wcs, 64) {
            tracing::warn!(qp = self.id, "poll: {e}");
            return false;
        }
        let any = !wcs.is_empty();
        for wc in wcs {
            if let Some(waiter) = self.internal.remove(&wc.wr_id) {
                self.sends -= 1;
                let result = match wc.status {
                    WcStatus::Success => Ok(()),
                    other => Err(format!("the device answered {other:?}")),
                };
                let _ = waiter.send(result);
                continue;
            }
            let Some(flight) = self.in_flight.remove(&wc.wr_id) else {
                continue;
            };
            if flight.opcode == Opcode::Recv {
                self.recvs -= 1;
            } else {
                self.sends -= 1;
            }
            let status = status_of(wc.status);
            let counter = if status == Status::Success {
                &self.record.counters.completed
            } else {
                &self.record.counters.failed
            };
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if flight.signaled || status != Status::Success || flight.opcode == Opcode::Recv {
                let opcode = match wc.opcode {
                    WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => Opcode::Recv,
                    _ => flight.opcode,
                };
                self.backlog.push_back(Completion {
                    wr_id: flight.client_wr_id,
                    status,
                    opcode,
                    byte_len: wc.byte_len,
                    imm: wc.imm,
                    detail: 0,
                });
            }
        }
        any
    }

    /// Writes waiting completions into the ring as far as it has room; returns whether it
    /// delivered any.
    fn deliver(&mut self) -> bool {
        if self.backlog.is_empty() {
            return false;
        }
        let ring = Arc::clone(&self.record.ring);
        let layout = self.record.layout;
        let Ok(head) = ring.load_u32(header::CQ_HEAD) else {
            return false;
        };
        let used = self.cq_tail.wrapping_sub(head);
        // A head the client moved past our tail is a lie; treat the ring as full.
        let room = layout.cq_entries.saturating_sub(used);
        let mut delivered = 0;
        while delivered < room {
            let Some(c) = self.backlog.pop_front() else {
                break;
            };
            if ring
                .write_at(layout.cqe(self.cq_tail), &c.encode())
                .is_err()
            {
                break;
            }
            self.cq_tail = self.cq_tail.wrapping_add(1);
            delivered += 1;
        }
        if delivered > 0 {
            let _ = ring.store_u32(header::CQ_TAIL, self.cq_tail);
            self.record.completion_event.signal();
        }
        if self.waiting || !self.backlog.is_empty() {
            self.store_flags(false);
        }
        delivered > 0
    }
}

/// Work the engine asks a worker to post on a QP: memory-window binds and invalidations
/// go through the QP's own send queue, so they are ordered with the client's requests.
pub struct Command {
    pub qp: QpId,
    pub op: crate::provider::SendOp,
    pub reply: std::sync::mpsc::Sender<Result<(), String>>,
}

/// Internal request ids have the top bit set; the client's never reach the device.
const INTERNAL: u64 = 1 << 63;

impl QpState {
    fn run_command(
        &mut self,
        op: crate::provider::SendOp,
        reply: std::sync::mpsc::Sender<Result<(), String>>,
    ) {
        if self.sends >= self.record.options.send_depth {
            let _ = reply.send(Err("the queue pair's send queue is full".into()));
            return;
        }
        let wr_id = INTERNAL | self.next_wr;
        self.next_wr += 1;
        let wr = crate::provider::SendWr {
            wr_id,
            op,
            sges: Vec::new(),
            signaled: true,
        };
        match self.record.qp.post_send(std::slice::from_ref(&wr)) {
            Ok(()) => {
                self.sends += 1;
                self.internal.insert(wr_id, reply);
            }
            Err(e) => {
                let _ = reply.send(Err(e.to_string()));
            }
        }
    }
}

fn status_of(s: WcStatus) -> Status {
    match s {
        WcStatus::Success => Status::Success,
        WcStatus::LocalLengthError => Status::LocalLengthError,
        WcStatus::LocalProtectionError => Status::LocalProtectionError,
        WcStatus::WrFlushError => Status::WrFlushError,
        WcStatus::RemoteInvalidRequestError => Status::RemoteInvalidRequestError,
        WcStatus::RemoteAccessError => Status::RemoteAccessError,
        WcStatus::RemoteOperationError => Status::RemoteOperationError,
        WcStatus::RetryExceeded => Status::RetryExceeded,
        WcStatus::RnrRetryExceeded => Status::RnrRetryExceeded,
        WcStatus::MemoryWindowBindError | WcStatus::Other(_) => Status::DeviceError,
    }
}

impl WorkerQps {
    fn bump(&self) -> u64 {
        let mut wanted = lock(&self.wanted);
        *wanted += 1;
        *wanted
    }

    /// Waits until the worker has applied change `generation` (bounded, so a stuck device
    /// cannot stall the caller for ever).
    fn wait_applied(&self, generation: u64) {
        let mut applied = lock(&self.applied);
        let deadline = Instant::now() + Duration::from_secs(5);
        while *applied < generation {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!("the data-path worker did not let go of a queue pair in time");
                return;
            }
            applied = self
                .applied_cv
                .wait_timeout(applied, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

/// A running worker; dropping it stops the thread.
pub struct Worker {
    qps: Arc<WorkerQps>,
    commands: Arc<Mutex<Vec<Command>>>,
    wake: OwnedFd,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").finish_non_exhaustive()
    }
}

fn eventfd() -> std::io::Result<OwnedFd> {
    use nix::sys::eventfd::{EfdFlags, EventFd};
    Ok(EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?.into())
}

fn drain(fd: BorrowedFd<'_>) {
    let mut buf = [0u8; 8];
    while matches!(nix::unistd::read(fd.as_raw_fd(), &mut buf), Ok(8)) {}
}

impl Worker {
    /// Starts the worker of `device`.
    pub fn spawn(device: &str, spin: Duration) -> std::io::Result<Worker> {
        let qps = Arc::new(WorkerQps::default());
        let commands: Arc<Mutex<Vec<Command>>> = Arc::default();
        let wake = eventfd()?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let (qps, stop, commands) =
                (Arc::clone(&qps), Arc::clone(&stop), Arc::clone(&commands));
            let wake = wake.try_clone()?;
            std::thread::Builder::new()
                .name(format!("rdmad-dp-{device}"))
                .spawn(move || run(&qps, &commands, &wake, &stop, spin))?
        };
        Ok(Worker {
            qps,
            commands,
            wake,
            stop,
            thread: Some(thread),
        })
    }

    /// Posts `op` on QP `qp` and waits for its completion (bounded: a device that never
    /// answers is an error, not a hang).
    pub fn run(&self, qp: QpId, op: crate::provider::SendOp) -> Result<(), String> {
        let (reply, answer) = std::sync::mpsc::channel();
        lock(&self.commands).push(Command { qp, op, reply });
        self.poke();
        match answer.recv_timeout(Duration::from_secs(60)) {
            Ok(result) => result,
            Err(_) => Err("the device did not complete the request within 60 s".into()),
        }
    }

    /// Starts serving a QP's rings.
    pub fn add(&self, id: QpId, record: Arc<QueuePairRecord>) {
        lock(&self.qps.qps).push((id, record));
        self.qps.bump();
        self.poke();
    }

    /// Stops serving QPs and returns once the worker holds none of them any more, so the
    /// caller's release really destroys them.
    pub fn remove(&self, ids: &[QpId]) {
        let before = lock(&self.qps.qps).len();
        lock(&self.qps.qps).retain(|(q, _)| !ids.contains(q));
        if lock(&self.qps.qps).len() == before {
            return;
        }
        let generation = self.qps.bump();
        self.poke();
        self.qps.wait_applied(generation);
    }

    fn poke(&self) {
        let _ = nix::unistd::write(self.wake.as_fd(), &1u64.to_ne_bytes());
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        self.poke();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("a data-path worker panicked");
            }
        }
    }
}

fn run(
    shared: &WorkerQps,
    commands: &Mutex<Vec<Command>>,
    wake: &OwnedFd,
    stop: &std::sync::atomic::AtomicBool,
    spin: Duration,
) {
    let mut qps: Vec<QpState> = Vec::new();
    let mut last_work = Instant::now();
    let mut seen = 0;
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        // Commands are taken before the QP changes are looked at: a command for a QP just
        // added (`add`, then `run`) then always finds it served.
        let pending = std::mem::take(&mut *lock(commands));
        let wanted = *lock(&shared.wanted);
        if wanted != seen && !handback_held(&qps, shared) {
            let current = lock(&shared.qps).clone();
            qps.retain(|q| current.iter().any(|(id, _)| *id == q.id));
            for (id, record) in current {
                if !qps.iter().any(|q| q.id == id) {
                    qps.push(QpState::new(id, record));
                }
            }
            seen = wanted;
            *lock(&shared.applied) = wanted;
            shared.applied_cv.notify_all();
        }
        let mut busy = false;
        for command in pending {
            busy = true;
            match qps.iter_mut().find(|q| q.id == command.qp) {
                Some(q) => q.run_command(command.op, command.reply),
                None => {
                    let _ = command
                        .reply
                        .send(Err(format!("queue pair {} is not served", command.qp)));
                }
            }
        }
        for q in &mut qps {
            let sq_tail = q.record.ring.load_u32(header::SQ_TAIL).unwrap_or(q.sq_head);
            if sq_tail != q.sq_head && q.can_consume() {
                let rights = q.record.rights.load();
                busy |= q.consume(&rights);
            }
            busy |= q.reap();
            // A software device moves large requests a turn per poll: keep polling.
            busy |= q.record.cq.needs_polling();
            busy |= q.deliver();
        }
        if busy {
            last_work = Instant::now();
            continue;
        }
        if last_work.elapsed() < spin {
            std::hint::spin_loop();
            continue;
        }
        sleep(&mut qps, wake);
        last_work = Instant::now();
    }
}

/// Whether a test holds back the hand-back of QPs this change lets go of (debug builds
/// only, see `test_hooks`): the worker then goes on serving what it has.
fn handback_held(qps: &[QpState], shared: &WorkerQps) -> bool {
    crate::test_hooks::hold_handback(|| {
        let current = lock(&shared.qps);
        qps.iter()
            .any(|q| current.iter().all(|(id, _)| *id != q.id))
    })
}

/// Arms everything and sleeps until a doorbell, a completion or a wake-up.
fn sleep(qps: &mut [QpState], wake: &OwnedFd) {
    let Ok(epoll) = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC) else {
        std::thread::sleep(Duration::from_millis(1));
        return;
    };
    let _ = epoll.add(wake.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, 0));
    for q in qps.iter_mut() {
        q.store_flags(true);
        let _ = q.record.cq.arm();
        let _ = epoll.add(
            q.record.doorbell.daemon_end(),
            EpollEvent::new(EpollFlags::EPOLLIN, 0),
        );
        let _ = epoll.add(
            q.record.cq.event_fd(),
            EpollEvent::new(EpollFlags::EPOLLIN, 0),
        );
    }
    // Work that arrived between the last look and the flags is seen now. The fence pairs
    // with the client's (store tail or head, fence, load flags): one of the two sees the
    // other. Completions held back for a full ring are not work until the client makes
    // room (and rings the doorbell, as CQ_WAITING asks): the worker does not spin on them.
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    let pending = qps.iter().any(QpState::ready);
    if !pending {
        let mut events = [EpollEvent::empty(); 16];
        let _ = epoll.wait(&mut events, EpollTimeout::from(100u16));
    }
    drain(wake.as_fd());
    for q in qps.iter_mut() {
        q.store_flags(false);
        q.record.doorbell.drain();
        let _ = q.record.cq.acknowledge_events();
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use rdmad_client::queue_pair::QueuePairRing;
    use rdmad_client::ring::{RegionSge, Status};
    use rdmad_client::types::RingInfo;

    use super::*;
    use crate::config::{Config, ProviderChoice};
    use crate::engine::qp::QpOptions;
    use crate::engine::{Engine, Limits, Owner};

    fn ring_of(q: &QueuePairRecord) -> QueuePairRing {
        QueuePairRing::new(
            q.ring.fd().try_clone_to_owned().unwrap(),
            q.doorbell.client_end().try_clone_to_owned().unwrap(),
            q.completion_event
                .client_end()
                .try_clone_to_owned()
                .unwrap(),
            RingInfo {
                size: q.ring.len() as u64,
                sq_entries: q.layout.sq_entries,
                cq_entries: q.layout.cq_entries,
            },
        )
        .unwrap()
    }

    /// A loopback engine and one queue pair of a session of uid 1000 (the engine must live
    /// as long as the QP is used).
    fn loopback_qp() -> (Engine, Arc<QueuePairRecord>) {
        let config = Config::default();
        let engine = Engine::start(
            config.clone(),
            PathBuf::from("/dev/null"),
            Some(ProviderChoice::Loopback),
        )
        .unwrap();
        let alice = Owner {
            uid: 1000,
            connection: ":1.1".into(),
            pid: None,
        };
        let limits = Limits::unlimited(1000);
        let s = engine.open_session(&alice, &limits).unwrap();
        let id = engine
            .create_qp(&alice, &limits, s, "loopback0", QpOptions::default())
            .unwrap()
            .id;
        let q = engine.registry.own_qp(&alice, id).unwrap();
        (engine, q)
    }

    #[test]
    fn a_refused_submission_comes_back_as_a_completion() {
        let (_engine, q) = loopback_qp();
        let mut ring = ring_of(&q);
        let sub = Submission::new(
            Opcode::Send,
            9,
            RegionSge {
                region: 77,
                offset: 0,
                length: 8,
            },
        );
        ring.submit(&sub).unwrap().unwrap();
        let c = ring
            .wait(Duration::from_secs(10))
            .unwrap()
            .expect("a completion");
        assert_eq!((c.wr_id, c.status), (9, Status::RegionAccessDenied));
    }

    /// A client that floods its ring and never reads a completion: the worker holds back at
    /// most a ring's worth plus one batch (then stops taking submissions, so the client sees
    /// its submission ring full), and loses nothing — every request comes back, in order,
    /// once the client reads.
    #[test]
    fn a_client_that_never_reads_completions_is_held_to_a_bound() {
        let (_engine, q) = loopback_qp();
        let (sq, cq) = (q.layout.sq_entries, q.layout.cq_entries);
        let mut ring = ring_of(&q);
        let refused = |wr_id| {
            Submission::new(
                Opcode::Send,
                wr_id,
                RegionSge {
                    region: 77,
                    offset: 0,
                    length: 8,
                },
            )
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut submitted = 0u64;
        loop {
            assert!(
                Instant::now() < deadline,
                "the worker never stopped taking work"
            );
            if ring.submit(&refused(submitted)).unwrap().is_ok() {
                submitted += 1;
                continue;
            }
            // The ring is full. Once a ring's worth waits, the worker takes nothing more.
            let held = q.ring.load_u32(header::CQ_OVERFLOW).unwrap();
            if held >= cq {
                break;
            }
            std::thread::yield_now();
        }
        let flags = q.ring.load_u32(header::SQ_FLAGS).unwrap();
        assert_ne!(flags & ring::CQ_WAITING, 0, "flags {flags:#x}");
        let held = q.ring.load_u32(header::CQ_OVERFLOW).unwrap();
        assert!(held <= cq + sq, "{held} completions held back");
        assert!(
            submitted <= u64::from(2 * cq + 2 * sq),
            "{submitted} submissions taken"
        );
        for wr_id in 0..submitted {
            let c = ring
                .wait(Duration::from_secs(10))
                .unwrap()
                .unwrap_or_else(|| panic!("completion {wr_id} of {submitted} never came"));
            assert_eq!((c.wr_id, c.status), (wr_id, Status::RegionAccessDenied));
        }
        assert_eq!(ring.poll().unwrap(), None);
        // And the worker takes work again. (It clears CQ_WAITING on its next pass, which
        // may come after the client's last poll: a stale flag costs one extra doorbell.)
        ring.submit(&refused(submitted)).unwrap().unwrap();
        let c = ring.wait(Duration::from_secs(10)).unwrap();
        assert_eq!(
            c.map(|c| (c.wr_id, c.status)),
            Some((submitted, Status::RegionAccessDenied))
        );
    }
}
