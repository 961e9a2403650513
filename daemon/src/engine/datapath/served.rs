//! What the worker does for one queue pair ([`ServedQp`]): it takes the client's
//! submissions from the ring, copying each entry out of shared memory before looking at
//! it, validates and translates them against the session's rights snapshot, posts them to
//! the device, polls the CQ and writes completions back as the ring has room. The worker's
//! own requests (window binds and invalidations) go through the same send queue.

use std::collections::VecDeque;
use std::sync::Arc;

use rdmad_client::ring::{self, header, Completion, Opcode, Status, Submission, SQE_SIZE};
use rustc_hash::FxHashMap as HashMap;

use super::validate::{self, RegionRights};
use super::worker::{Reply, WorkerError};
use crate::engine::qp::{QpId, QueuePairRecord};
use crate::provider::{PostError, ProviderError, WcOpcode, WcStatus, WorkCompletion};

/// The most submissions one QP gets taken in one pass of the worker: a QP with a full ring
/// waits for the next pass like every other, so each pass over N busy QPs costs at most N
/// such batches (and, on a software device, N turns of bounded copying).
const TAKE_PER_PASS: u32 = 64;

/// A request the device is working on: what the client called it, and what it pins.
struct InFlight {
    client_wr_id: u64,
    opcode: Opcode,
    signaled: bool,
    _pins: validate::Pins,
}

/// The requests the device is working on, under the ids the device knows them by: a slot
/// of a table that only grows to the most requests ever in flight at once, and the slot's
/// generation, so an id that is stale (or not ours) finds nothing. Freed slots are reused
/// last-freed first, while they are still in the cache.
#[derive(Default)]
struct InFlightTable {
    slots: Vec<Slot>,
    free: Vec<u32>,
}

#[derive(Default)]
struct Slot {
    generation: u32,
    flight: Option<InFlight>,
}

impl InFlightTable {
    /// Generations stay below 2^31: an id never has [`INTERNAL`]'s bit.
    const GENERATIONS: u32 = 1 << 31;

    /// The id the next [`InFlightTable::insert`] returns.
    fn next_id(&self) -> u64 {
        match self.free.last() {
            Some(&index) => Self::id(self.slots[index as usize].generation, index),
            None => Self::id(0, self.slots.len() as u32),
        }
    }

    fn insert(&mut self, flight: InFlight) -> u64 {
        match self.free.pop() {
            Some(index) => {
                let slot = &mut self.slots[index as usize];
                slot.flight = Some(flight);
                Self::id(slot.generation, index)
            }
            None => {
                let index = self.slots.len() as u32;
                self.slots.push(Slot {
                    generation: 0,
                    flight: Some(flight),
                });
                Self::id(0, index)
            }
        }
    }

    fn remove(&mut self, id: u64) -> Option<InFlight> {
        let (generation, index) = ((id >> 32) as u32, id as u32);
        let slot = self.slots.get_mut(index as usize)?;
        if slot.generation != generation {
            return None;
        }
        let flight = slot.flight.take()?;
        slot.generation = (slot.generation + 1) % Self::GENERATIONS;
        self.free.push(index);
        Some(flight)
    }

    fn id(generation: u32, index: u32) -> u64 {
        (u64::from(generation) << 32) | u64::from(index)
    }
}

/// The worker's private view of one QP: its own copies of the indices (never read back
/// from shared memory), requests in flight, completions waiting for ring space.
pub(super) struct ServedQp {
    pub(super) id: QpId,
    pub(super) record: Arc<QueuePairRecord>,
    /// The daemon's own requests (window binds and invalidations) and who waits for them.
    internal: HashMap<u64, (Reply, std::time::Instant)>,
    pub(super) sq_head: u32,
    cq_tail: u32,
    /// The id of the worker's next own request (with [`INTERNAL`]).
    next_internal: u64,
    in_flight: InFlightTable,
    sends: u32,
    recvs: u32,
    /// Completions waiting for room in the ring: bounded, because the worker stops taking
    /// submissions while it holds a ring's worth (see [`ServedQp::can_consume`]).
    backlog: VecDeque<Completion>,
    /// Receives the device would not take because the QP is in the error state
    /// ([`ProviderError::Flushed`]), completed flushed: they join the backlog once the
    /// device has flushed the receives it holds, so receives complete in the order they
    /// were posted. Counted against the receive queue's depth.
    flushed_recvs: VecDeque<Completion>,
    /// Whether the device completed a request with an error (not a flush): an RC QP is in
    /// the error state from then on, and the worker has moved it there once more so that
    /// the provider knows it too (see `flushed_recvs`).
    device_failed: bool,
    /// Whether `CQ_WAITING` is set in the ring.
    waiting: bool,
    /// Impossible submission tails the client published: the first is logged as a
    /// warning, the rest only counted (each is a refusal), so a client cannot flood the
    /// log from the worker every other QP shares.
    bad_tails: u64,
    /// Reused for every pass, so that a steady stream of requests allocates no batches.
    scratch: Scratch,
    /// When the worker last found work for this QP.
    pub(super) last_active: std::time::Instant,
}

/// What one pass over a QP builds, kept between passes.
#[derive(Default)]
struct Scratch {
    sends: Vec<crate::provider::SendWr>,
    recvs: Vec<crate::provider::RecvWr>,
    /// The requests staged for the device, in order: their ids, and whether each is a
    /// receive.
    staged: Vec<(u64, bool)>,
    wcs: Vec<WorkCompletion>,
}

impl ServedQp {
    pub(super) fn new(id: QpId, record: Arc<QueuePairRecord>) -> ServedQp {
        ServedQp {
            id,
            record,
            internal: HashMap::default(),
            sq_head: 0,
            cq_tail: 0,
            next_internal: 1,
            in_flight: InFlightTable::default(),
            sends: 0,
            recvs: 0,
            backlog: VecDeque::new(),
            flushed_recvs: VecDeque::new(),
            device_failed: false,
            waiting: false,
            bad_tails: 0,
            scratch: Scratch::default(),
            last_active: std::time::Instant::now(),
        }
    }

    /// Whether the worker takes submissions: not while a full ring of completions waits
    /// for the client to make room, so a client that never reads its completions cannot
    /// make the daemon hold more than a ring's worth (plus one batch) for it.
    pub(super) fn can_consume(&self) -> bool {
        self.backlog.len() < self.record.layout.cq_entries as usize
    }

    /// Whether the device owes this QP completions (receives included): only then is its
    /// CQ polled or armed, so that a worker's pass over idle QPs costs a load of each
    /// submission tail and nothing more.
    pub(super) fn expects_completions(&self) -> bool {
        self.sends + self.recvs > 0
    }

    /// Whether the worker may look at this QP only now and then (once nothing has moved
    /// for it for a while): no completions waiting for ring space, no request of the
    /// daemon's own (a window bind) in flight that its caller still waits for. The client's
    /// requests in flight do not keep it busy: a receive may wait for ever for its message,
    /// and so may a SEND, retried for as long as its peer posts no receive — a user's QPs
    /// parked so would otherwise make every pass of the worker its neighbours share look at
    /// each of them. A software device that moves a request a turn at a time keeps its QP
    /// busy (something moves on every pass).
    pub(super) fn may_rest(&self) -> bool {
        // A request of the daemon's own whose caller gave up waiting (it may sit for ever
        // behind a SEND that is never received) no longer keeps the QP busy.
        self.backlog.is_empty()
            && self
                .internal
                .values()
                .all(|(_, posted)| posted.elapsed() >= super::worker::RUN_TIMEOUT)
    }

    /// Everything the worker does for this QP in one look: takes submissions, polls the CQ
    /// if the device owes completions, delivers; returns whether anything moved.
    pub(super) fn serve(&mut self) -> bool {
        let mut busy = false;
        let sq_tail = self
            .record
            .ring
            .load_u32(header::SQ_TAIL)
            .unwrap_or(self.sq_head);
        if sq_tail != self.sq_head && self.can_consume() {
            let rights = self.record.rights.load();
            self.consume(&rights, sq_tail);
            busy = true;
        }
        if self.expects_completions() {
            busy |= self.reap();
            // A software device moves large requests a turn per poll: keep polling.
            busy |= self.record.cq.needs_polling();
        }
        if self.recvs == 0 && !self.flushed_recvs.is_empty() {
            self.backlog.extend(self.flushed_recvs.drain(..));
            busy = true;
        }
        busy | self.deliver()
    }

    /// Whether there is work the worker can do now, without waiting for the client.
    pub(super) fn ready(&self) -> bool {
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
    pub(super) fn store_flags(&mut self, need_wakeup: bool) {
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

    /// Takes up to [`TAKE_PER_PASS`] of what the client submitted up to `tail` (the
    /// submission tail as the worker just loaded it). Called only when `tail` is past the
    /// worker's head and [`ServedQp::can_consume`] holds (`serve` checks both).
    fn consume(&mut self, rights: &RegionRights, tail: u32) {
        debug_assert!(self.can_consume() && tail != self.sq_head);
        let ring = Arc::clone(&self.record.ring);
        let layout = self.record.layout;
        let pending = tail.wrapping_sub(self.sq_head);
        if pending > layout.sq_entries {
            // An impossible tail: the client broke the protocol. Skip to it and refuse it;
            // say so once per QP.
            self.bad_tails += 1;
            if self.bad_tails == 1 {
                tracing::warn!(
                    session = %self.record.session,
                    qp = %self.id,
                    tail,
                    head = self.sq_head,
                    "submission tail out of range (later ones on this queue pair are only \
                     counted as refused)"
                );
            } else {
                tracing::debug!(qp = %self.id, times = self.bad_tails, "another impossible tail");
            }
            self.refuse(0, Opcode::Send, Status::InvalidEntry, 1);
            self.sq_head = tail;
            let _ = ring.store_u32(header::SQ_HEAD, self.sq_head);
            return;
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        let (sends, recvs, staged) = (&mut scratch.sends, &mut scratch.recvs, &mut scratch.staged);
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
                    tracing::debug!(
                        session = %self.record.session,
                        qp = %self.id,
                        "refused submission: {e}"
                    );
                    self.refuse(wr_id, Opcode::Send, Status::InvalidEntry, 0);
                    continue;
                }
            };
            let is_recv = sub.opcode == Opcode::Recv;
            let (depth, used) = if is_recv {
                (
                    self.record.options.recv_depth,
                    self.recvs + self.flushed_recvs.len() as u32 + recvs.len() as u32,
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
            let wr = self.in_flight.next_id();
            match validate::check_length(&sub, self.record.max_message).and_then(|()| {
                validate::check_into(
                    &sub,
                    rights,
                    self.record.options.max_sge,
                    self.record.domain.map(|(_, id)| id),
                    wr,
                    (sends, recvs),
                )
            }) {
                Ok(pins) => {
                    if !is_recv {
                        if let Some(w) = sends.last_mut() {
                            w.inline = validate::goes_inline(w, self.record.options.max_inline);
                        }
                    }
                    let id = self.in_flight.insert(InFlight {
                        client_wr_id: sub.wr_id,
                        opcode: sub.opcode,
                        signaled: sub.signaled,
                        _pins: pins,
                    });
                    debug_assert_eq!(id, wr);
                    staged.push((id, is_recv));
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
                tracing::debug!(qp = %self.id, "{what}: {e}");
                e.posted.min(len)
            }
        };
        // A device takes a prefix of each batch: how many of the receives and of the
        // sends it took, the first of each in the order they were staged.
        let mut recvs_taken = 0;
        let mut recvs_flushed = false;
        if !recvs.is_empty() {
            let result = self.record.qp.post_recv(recvs);
            recvs_flushed = matches!(
                &result,
                Err(PostError {
                    error: ProviderError::Flushed { .. },
                    ..
                })
            );
            recvs_taken = taken("post_recv", recvs.len(), result);
        }
        let mut sends_taken = 0;
        if !sends.is_empty() {
            sends_taken = taken("post_send", sends.len(), self.record.qp.post_send(sends));
        }
        self.recvs += recvs_taken as u32;
        self.sends += sends_taken as u32;
        let posted = (recvs_taken + sends_taken) as u64;
        // What the device did not take leaves the table.
        let (mut recvs_left, mut sends_left) = (recvs_taken, sends_taken);
        for (wr, is_recv) in staged.drain(..) {
            let left = if is_recv {
                &mut recvs_left
            } else {
                &mut sends_left
            };
            if *left > 0 {
                *left -= 1;
                continue;
            }
            let Some(flight) = self.in_flight.remove(wr) else {
                continue;
            };
            if is_recv && recvs_flushed {
                self.record
                    .counters
                    .failed
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.flushed_recvs.push_back(Completion {
                    wr_id: flight.client_wr_id,
                    status: Status::WrFlushError,
                    opcode: Opcode::Recv,
                    byte_len: 0,
                    imm: None,
                    detail: 0,
                });
            } else {
                self.refuse(flight.client_wr_id, flight.opcode, Status::DeviceError, 0);
            }
        }
        self.record
            .counters
            .posted
            .fetch_add(posted, std::sync::atomic::Ordering::Relaxed);
        sends.clear();
        recvs.clear();
        self.scratch = scratch;
    }

    /// Takes completions from the CQ (into those waiting for the ring); returns whether
    /// there were any.
    pub(super) fn reap(&mut self) -> bool {
        let mut wcs = std::mem::take(&mut self.scratch.wcs);
        wcs.clear();
        if let Err(e) = self.record.cq.poll(&mut wcs, 64) {
            tracing::warn!(qp = %self.id, "poll: {e}");
            self.scratch.wcs = wcs;
            return false;
        }
        let any = !wcs.is_empty();
        if !self.device_failed
            && wcs
                .iter()
                .any(|wc| !matches!(wc.status, WcStatus::Success | WcStatus::WrFlushError))
        {
            self.device_failed = true;
            if let Err(e) = self.record.qp.to_error() {
                tracing::debug!(qp = %self.id, "after an error completion: {e}");
            }
        }
        // Counted here and published once per poll: one shared write each, not one a
        // request.
        let (mut completed, mut failed) = (0u64, 0u64);
        for wc in wcs.drain(..) {
            let internal = if wc.wr_id & INTERNAL != 0 {
                self.internal.remove(&wc.wr_id)
            } else {
                None
            };
            if let Some((waiter, _)) = internal {
                self.sends -= 1;
                let result = match wc.status {
                    WcStatus::Success => Ok(()),
                    other => Err(WorkerError::Completion(other)),
                };
                let _ = waiter.send(result);
                continue;
            }
            let Some(flight) = self.in_flight.remove(wc.wr_id) else {
                continue;
            };
            if flight.opcode == Opcode::Recv {
                self.recvs -= 1;
            } else {
                self.sends -= 1;
            }
            let status = status_of(wc.status);
            if status == Status::Success {
                completed += 1;
            } else {
                failed += 1;
            }
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
        let counters = &self.record.counters;
        for (counter, n) in [(&counters.completed, completed), (&counters.failed, failed)] {
            if n > 0 {
                counter.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            }
        }
        self.scratch.wcs = wcs;
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
            // Store the tail, then load the client's flag; the client stores the flag, then
            // loads the tail. A client that spins is not woken: no system call for it.
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            let sleeping = ring
                .load_u32(header::CQ_FLAGS)
                .map_or(true, |flags| flags & ring::CQ_NEED_WAKEUP != 0);
            if sleeping {
                self.record.completion_event.signal();
            }
        }
        if self.waiting || !self.backlog.is_empty() {
            self.store_flags(false);
        }
        delivered > 0
    }
}

/// Internal request ids have the top bit set; the client's never reach the device.
const INTERNAL: u64 = 1 << 63;

impl ServedQp {
    pub(super) fn run_command(&mut self, op: crate::provider::SendOp, reply: Reply) {
        if self.sends >= self.record.options.send_depth {
            let _ = reply.send(Err(WorkerError::SendQueueFull));
            return;
        }
        let wr_id = INTERNAL | self.next_internal;
        self.next_internal += 1;
        let wr = crate::provider::SendWr {
            wr_id,
            op,
            sges: Default::default(),
            signaled: true,
            inline: false,
        };
        match self.record.qp.post_send(std::slice::from_ref(&wr)) {
            Ok(()) => {
                self.sends += 1;
                self.internal
                    .insert(wr_id, (reply, std::time::Instant::now()));
            }
            Err(e) => {
                let _ = reply.send(Err(WorkerError::Post(e)));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn flight(client_wr_id: u64) -> InFlight {
        InFlight {
            client_wr_id,
            opcode: Opcode::Write,
            signaled: true,
            _pins: validate::Pins::new(),
        }
    }

    #[test]
    fn in_flight_ids_are_found_once_and_never_after_their_slot_is_reused() {
        let mut table = InFlightTable::default();
        let first = table.next_id();
        assert_eq!(table.insert(flight(10)), first);
        let second = table.insert(flight(11));
        assert_ne!(first, second);
        assert_eq!(table.remove(first).map(|f| f.client_wr_id), Some(10));
        // Completed once: the same id again, or an id the worker never gave, finds nothing.
        assert!(table.remove(first).is_none());
        assert!(table.remove(second + 1000).is_none());
        assert!(table.remove(INTERNAL | second).is_none());
        // The slot comes back under a new id; the old one still finds nothing.
        let reused = table.next_id();
        assert_eq!(table.insert(flight(12)), reused);
        assert_ne!(reused, first);
        assert_eq!(reused as u32, first as u32, "the freed slot is reused");
        assert!(table.remove(first).is_none());
        assert_eq!(table.remove(reused).map(|f| f.client_wr_id), Some(12));
        assert_eq!(table.remove(second).map(|f| f.client_wr_id), Some(11));
        assert_eq!(
            table.slots.len(),
            2,
            "the table grows only to the most in flight"
        );
    }
}
