//! The data-path worker of one device: a thread that serves every QP of the device in
//! turn (the work done for one QP is in `served`: taking submissions, validating, posting,
//! polling, delivering completions), takes the engine's commands and QP changes, and when
//! there is nothing to do for a while sets `SQ_NEED_WAKEUP` in every ring, arms the CQs
//! and sleeps on the doorbell and completion-channel descriptors (io_uring's SQPOLL is
//! the model).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

use super::served::ServedQp;
use crate::engine::qp::{QpId, QueuePairRecord};
use crate::lock::lock;
use crate::provider::{PostError, WcStatus};

/// The QPs a worker serves, shared with the engine that adds and removes them.
#[derive(Debug, Default)]
pub struct WorkerQps {
    qps: Mutex<Vec<(QpId, Arc<QueuePairRecord>)>>,
    /// Bumped by every change; the worker copies it to `applied` once it has let go of
    /// removed QPs. An atomic, so that the worker's look at it each pass takes no lock.
    wanted: AtomicU64,
    applied: Mutex<u64>,
    applied_cv: std::sync::Condvar,
}

/// Why work the engine asked a worker to post ([`Worker::run`]) did not complete.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The device refused to post it.
    #[error(transparent)]
    Post(#[from] PostError),
    /// The device completed it with an error.
    #[error("the device answered {0:?}")]
    Completion(WcStatus),
    #[error("the queue pair's send queue is full")]
    SendQueueFull,
    #[error("queue pair {0} is not served")]
    NotServed(QpId),
    /// No completion within the bound [`Worker::run`] waits.
    #[error("the device did not complete the request within 60 s")]
    TimedOut,
    /// The worker dropped the request unanswered: it stopped, or let go of the queue pair
    /// first.
    #[error("the data-path worker let go of the queue pair before the request completed")]
    Stopped,
}

/// How long [`Worker::run`] waits for the device to complete the work it posts.
pub(super) const RUN_TIMEOUT: Duration = Duration::from_secs(60);

/// Where a worker sends the outcome of a command.
pub type Reply = std::sync::mpsc::Sender<Result<(), WorkerError>>;

/// Work the engine asks a worker to post on a QP: memory-window binds and invalidations
/// go through the QP's own send queue, so they are ordered with the client's requests.
pub struct Command {
    pub qp: QpId,
    pub op: crate::provider::SendOp,
    pub reply: Reply,
}

impl WorkerQps {
    fn bump(&self) -> u64 {
        self.wanted.fetch_add(1, Ordering::AcqRel) + 1
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

/// Commands for the worker: a list, and a flag the worker reads each pass without taking
/// the list's lock.
#[derive(Default)]
struct Commands {
    list: Mutex<Vec<Command>>,
    pending: AtomicBool,
}

impl Commands {
    fn push(&self, command: Command) {
        lock(&self.list).push(command);
        self.pending.store(true, Ordering::Release);
    }

    fn take(&self) -> Vec<Command> {
        // A plain load first: the worker looks every pass, and a locked swap would make
        // each look wait for the pass's stores to the rings to leave this CPU.
        if !self.pending.load(Ordering::Acquire) || !self.pending.swap(false, Ordering::AcqRel) {
            return Vec::new();
        }
        std::mem::take(&mut *lock(&self.list))
    }
}

/// A running worker; dropping it stops the thread.
pub struct Worker {
    qps: Arc<WorkerQps>,
    commands: Arc<Commands>,
    wake: OwnedFd,
    stop: Arc<AtomicBool>,
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
    /// Starts worker number `index`.
    pub fn spawn(index: usize, spin: Duration) -> std::io::Result<Worker> {
        let qps = Arc::new(WorkerQps::default());
        let commands: Arc<Commands> = Arc::default();
        let wake = eventfd()?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (qps, stop, commands) =
                (Arc::clone(&qps), Arc::clone(&stop), Arc::clone(&commands));
            let wake = wake.try_clone()?;
            let served = Served::new(&wake)?;
            std::thread::Builder::new()
                .name(format!("rdmad-dp-{index}"))
                .spawn(move || run(served, &qps, &commands, &wake, &stop, spin))?
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
    pub fn run(&self, qp: QpId, op: crate::provider::SendOp) -> Result<(), WorkerError> {
        let (reply, answer) = std::sync::mpsc::channel();
        self.commands.push(Command { qp, op, reply });
        self.poke();
        match answer.recv_timeout(RUN_TIMEOUT) {
            Ok(result) => result,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(WorkerError::TimedOut),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(WorkerError::Stopped),
        }
    }

    /// How many QPs the worker serves.
    pub fn load(&self) -> usize {
        lock(&self.qps.qps).len()
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
        self.stop.store(true, Ordering::Release);
        self.poke();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("a data-path worker panicked");
            }
        }
    }
}

/// How long after its last work the worker spins without giving up its CPU, before it
/// starts yielding it between passes (see `run`): a pass over a few QPs takes tens of
/// nanoseconds and a `sched_yield` a few hundred, so work that comes soon after the last
/// (the client's next request, the next batch) is seen at once rather than after a system
/// call; and a thread waiting for this CPU waits at most this long more.
const PURE_SPIN: Duration = Duration::from_micros(2);

/// How long a QP has had no work before the worker looks at it only now and then.
const REST_AFTER: Duration = Duration::from_millis(1);
/// Resting QPs looked at per pass, in turn: with R of them, each is looked at every
/// R / `REST_LOOKS` passes, and a pass over the busy ones costs at most this many more.
const REST_LOOKS: usize = 16;
/// Resting QPs looked at per pass while the worker spins without yielding ([`PURE_SPIN`])
/// after a pass that found nothing: such passes follow each other every few tens of
/// nanoseconds, and sixteen looks at other rings would make each one several times longer,
/// and so delay the busy QPs' next look by as much (`rdmad-bench ring` with 1,000 idle
/// QPs: 1.15–1.29× a lone QP's latency with sixteen, 1.00–1.08× with one). Passes that
/// find work, and passes between yields, look at [`REST_LOOKS`].
const SPIN_REST_LOOKS: usize = 1;

/// The QPs a worker serves, split by how often it looks at them: busy ones every pass,
/// resting ones (no work for [`REST_AFTER`]) a few per pass, so that a thousand idle QPs
/// cost an active one a few loads per pass rather than a thousand.
struct Served {
    busy: Vec<ServedQp>,
    resting: Vec<ServedQp>,
    cursor: usize,
    /// What the worker sleeps on: its wake-up eventfd and every served QP's doorbell and
    /// completion channel, registered once while the QP is served (see [`Event`]).
    epoll: Epoll,
}

/// What an epoll event of a worker is about: `u64` data, the QP's id shifted left by two
/// and the kind in the low bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Wake,
    Doorbell(QpId),
    Completions(QpId),
}

impl Event {
    fn data(self) -> u64 {
        match self {
            Event::Wake => 0,
            Event::Doorbell(id) => id.0 << 2 | 1,
            Event::Completions(id) => id.0 << 2 | 2,
        }
    }

    fn of(data: u64) -> Event {
        let id = QpId(data >> 2);
        match data & 3 {
            1 => Event::Doorbell(id),
            2 => Event::Completions(id),
            _ => Event::Wake,
        }
    }
}

impl Served {
    fn all(&self) -> impl Iterator<Item = &ServedQp> {
        self.busy.iter().chain(&self.resting)
    }

    fn all_mut(&mut self) -> impl Iterator<Item = &mut ServedQp> {
        self.busy.iter_mut().chain(&mut self.resting)
    }

    fn new(wake: &OwnedFd) -> std::io::Result<Served> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        epoll.add(
            wake.as_fd(),
            EpollEvent::new(EpollFlags::EPOLLIN, Event::Wake.data()),
        )?;
        Ok(Served {
            busy: Vec::new(),
            resting: Vec::new(),
            cursor: 0,
            epoll,
        })
    }

    /// Serves exactly the QPs of `current`: drops the others (and their descriptors from
    /// the epoll set), adds the new ones as busy.
    fn apply(&mut self, current: &[(QpId, Arc<QueuePairRecord>)]) {
        let wanted: std::collections::HashSet<QpId> = current.iter().map(|(id, _)| *id).collect();
        let epoll = &self.epoll;
        let forget = |q: &ServedQp| {
            let _ = epoll.delete(q.record.doorbell.daemon_end());
            let _ = epoll.delete(q.record.cq.event_fd());
        };
        for list in [&mut self.busy, &mut self.resting] {
            list.retain(|q| {
                let keep = wanted.contains(&q.id);
                if !keep {
                    forget(q);
                }
                keep
            });
        }
        let have: std::collections::HashSet<QpId> = self.all().map(|q| q.id).collect();
        for (id, record) in current {
            if !have.contains(id) {
                for (fd, event) in [
                    (record.doorbell.daemon_end(), Event::Doorbell(*id)),
                    (record.cq.event_fd(), Event::Completions(*id)),
                ] {
                    if let Err(e) =
                        epoll.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, event.data()))
                    {
                        tracing::warn!(qp = %id, "cannot watch a queue pair's descriptor: {e}");
                    }
                }
                self.busy.push(ServedQp::new(*id, Arc::clone(record)));
            }
        }
    }

    fn find(&mut self, id: QpId) -> Option<&mut ServedQp> {
        self.all_mut().find(|q| q.id == id)
    }

    /// One pass: every busy QP, and `looks` resting ones (at most all of them). Returns
    /// whether anything moved.
    fn pass(&mut self, now: Instant, looks: usize) -> bool {
        let mut moved = false;
        let mut i = 0;
        while i < self.busy.len() {
            let q = &mut self.busy[i];
            if q.serve() {
                q.last_active = now;
                moved = true;
            } else if q.may_rest() && now.duration_since(q.last_active) >= REST_AFTER {
                let q = self.busy.swap_remove(i);
                self.resting.push(q);
                continue;
            }
            i += 1;
        }
        let looks = looks.min(self.resting.len());
        for _ in 0..looks {
            if self.cursor >= self.resting.len() {
                self.cursor = 0;
            }
            if self.resting[self.cursor].serve() {
                let mut q = self.resting.swap_remove(self.cursor);
                q.last_active = now;
                self.busy.push(q);
                moved = true;
            } else {
                self.cursor += 1;
            }
        }
        moved
    }
}

fn run(
    mut served: Served,
    shared: &WorkerQps,
    commands: &Commands,
    wake: &OwnedFd,
    stop: &AtomicBool,
    spin: Duration,
) {
    let mut last_work = Instant::now();
    let mut seen = 0;
    let mut full = false;
    // Whether the last pass found work.
    let mut moved = true;
    while !stop.load(Ordering::Acquire) {
        // Commands are taken before the QP changes are looked at: a command for a QP just
        // added (`add`, then `run`) then always finds it served.
        let pending = commands.take();
        let wanted = shared.wanted.load(Ordering::Acquire);
        if wanted != seen && !handback_held(&served, shared) {
            served.apply(&lock(&shared.qps).clone());
            seen = wanted;
            *lock(&shared.applied) = wanted;
            shared.applied_cv.notify_all();
        }
        let mut busy = false;
        for command in pending {
            busy = true;
            match served.find(command.qp) {
                Some(q) => q.run_command(command.op, command.reply),
                None => {
                    let _ = command.reply.send(Err(WorkerError::NotServed(command.qp)));
                }
            }
        }
        let now = Instant::now();
        let looks = if std::mem::take(&mut full) {
            usize::MAX
        } else if !moved && now.duration_since(last_work) < PURE_SPIN {
            SPIN_REST_LOOKS
        } else {
            REST_LOOKS
        };
        moved = served.pass(now, looks);
        busy |= moved;
        if busy {
            last_work = now;
            continue;
        }
        let idle = now.duration_since(last_work);
        if idle < PURE_SPIN {
            std::hint::spin_loop();
            continue;
        }
        if idle < spin {
            // Spin, but give the CPU to anyone else who wants it: with more spinners than
            // cores (clients busy-polling, several workers), a bare spin holds a core for a
            // whole scheduler slice while the thread that would make progress waits.
            std::thread::yield_now();
            continue;
        }
        if sleep(&mut served, wake) {
            // Whatever woke the worker may be a resting QP's: look at all of them once,
            // and spin again before the next sleep. (After a quiet time-out it sleeps
            // again at once.)
            full = true;
            last_work = Instant::now();
        }
    }
}

/// Whether a test holds back the hand-back of QPs this change lets go of (debug builds
/// only, see `test_hooks`): the worker then goes on serving what it has.
fn handback_held(served: &Served, shared: &WorkerQps) -> bool {
    crate::test_hooks::hold_handback(|| {
        let current = lock(&shared.qps);
        served
            .all()
            .any(|q| current.iter().all(|(id, _)| *id != q.id))
    })
}

/// Sleeps until a doorbell, a completion or a wake-up: asks every client for a doorbell,
/// arms the CQs of the QPs the device owes completions (no other can raise an event), and
/// waits on the epoll set. Only the descriptors that fired are read. Returns whether
/// anything did, or work was found before the wait.
fn sleep(served: &mut Served, wake: &OwnedFd) -> bool {
    // An armed CQ raises an event for its next completion only, so each is polled once
    // more after arming: a completion that came in between is found now, not after the
    // wait's time-out.
    let mut completed = false;
    for q in served.all_mut() {
        q.store_flags(true);
        if q.expects_completions() {
            let _ = q.record.cq.arm();
            completed |= q.reap();
        }
    }
    // Work that arrived between the last look and the flags is seen now. The fence pairs
    // with the client's (store tail or head, fence, load flags): one of the two sees the
    // other. Completions held back for a full ring are not work until the client makes
    // room (and rings the doorbell, as CQ_WAITING asks): the worker does not spin on them.
    std::sync::atomic::fence(Ordering::SeqCst);
    let mut events = [EpollEvent::empty(); 64];
    let mut fired = 0;
    let ready = completed || served.all().any(ServedQp::ready);
    if !ready {
        // A bounded wait: the loop looks at everything again after it, whether or not
        // anything announced itself (a test hook holding a change back, say).
        fired = served
            .epoll
            .wait(&mut events, EpollTimeout::from(100u16))
            .unwrap_or(0);
    }
    for event in &events[..fired] {
        match Event::of(event.data()) {
            Event::Wake => drain(wake.as_fd()),
            Event::Doorbell(id) => {
                if let Some(q) = served.find(id) {
                    q.record.doorbell.drain();
                }
            }
            Event::Completions(id) => {
                if let Some(q) = served.find(id) {
                    let _ = q.record.cq.acknowledge_events();
                }
            }
        }
    }
    for q in served.all_mut() {
        q.store_flags(false);
    }
    ready || fired > 0
}
