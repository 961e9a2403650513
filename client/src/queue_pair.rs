//! The client's end of a queue pair's rings: submit work requests, take completions, wait.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use crate::mapping::RegionMapping;
use crate::ring::{self, header, Completion, Layout, Submission, CQE_SIZE};
use crate::types::RingInfo;

/// How long a spinning wait polls without giving up its CPU before it starts yielding it
/// between polls: a poll of an empty ring is a load and a `sched_yield` a system call, so
/// a completion that comes within this is taken at once rather than after one; and a
/// thread waiting for this CPU (the daemon's worker, where spinners outnumber cores) waits
/// at most this long more.
const PURE_SPIN: Duration = Duration::from_micros(2);

/// A queue pair's rings, mapped.
#[derive(Debug)]
pub struct QueuePairRing {
    map: RegionMapping,
    layout: Layout,
    doorbell: OwnedFd,
    completions: OwnedFd,
    sq_tail: u32,
    /// The worker's submission head as last loaded (see [`QueuePairRing::sq_room`]).
    sq_head_seen: u32,
    cq_head: u32,
}

/// How [`QueuePairRing::wait_with`] waits while no completion is there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Sleep on the completion channel at once: no CPU while waiting, a wake-up's latency
    /// (a system call on each side) per completion waited for.
    Block,
    /// Busy-poll the ring for up to this long, then sleep as `Block` does: while spinning
    /// there is no wake-up (the daemon writes no channel, the client sleeps in no
    /// `poll(2)`); after its first 2 µs the spinner yields its CPU between polls to
    /// whoever else wants it.
    Spin(Duration),
}

/// The submission ring is full: take completions, then submit again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingFull;

impl QueuePairRing {
    /// Maps the ring that `Session.CreateQueuePair` returned and checks its header.
    pub fn new(
        ring: OwnedFd,
        doorbell: OwnedFd,
        completions: OwnedFd,
        info: RingInfo,
    ) -> io::Result<QueuePairRing> {
        let size = usize::try_from(info.size)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "ring too large"))?;
        let map = RegionMapping::map(ring, size, true)?;
        let layout = Layout {
            sq_entries: info.sq_entries,
            cq_entries: info.cq_entries,
        };
        let bad =
            |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("ring header: {what}"));
        for (offset, want) in layout.header_words() {
            if map.load_u32(offset)? != want {
                return Err(bad(&format!("word at {offset} is not {want}")));
            }
        }
        if layout.size() > size {
            return Err(bad("smaller than its layout"));
        }
        Ok(QueuePairRing {
            map,
            layout,
            doorbell,
            completions,
            sq_tail: 0,
            sq_head_seen: 0,
            cq_head: 0,
        })
    }

    /// Free submission slots, at least `wanted` of them if the ring has them. The worker's
    /// head is loaded again only when the last look at it shows fewer: it only moves
    /// forward, so an old look never overstates the room, and its cache line is the
    /// worker's (each load after the worker moved it is a transfer between cores).
    fn sq_room(&mut self, wanted: u32) -> io::Result<u32> {
        let entries = self.layout.sq_entries;
        let room = |head: u32| entries.saturating_sub(self.sq_tail.wrapping_sub(head));
        if room(self.sq_head_seen) < wanted {
            self.sq_head_seen = self.map.load_u32(header::SQ_HEAD)?;
        }
        Ok(room(self.sq_head_seen))
    }

    /// Queues one work request (and rings the doorbell if the daemon's worker sleeps).
    pub fn submit(&mut self, s: &Submission) -> io::Result<Result<(), RingFull>> {
        if self.sq_room(1)? == 0 {
            return Ok(Err(RingFull));
        }
        self.map.write(self.layout.sqe(self.sq_tail), &s.encode())?;
        self.sq_tail = self.sq_tail.wrapping_add(1);
        self.map.store_u32(header::SQ_TAIL, self.sq_tail)?;
        // Store the tail, then load the flag; the worker stores the flag, then loads the
        // tail. Without a full fence each could miss the other's store and the worker
        // would sleep on a submission.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if self.map.load_u32(header::SQ_FLAGS)? & ring::SQ_NEED_WAKEUP != 0 {
            self.ring_doorbell()?;
        }
        Ok(Ok(()))
    }

    /// Queues as many of `subs` as the ring has room for, in order, and publishes them with
    /// one store of the tail (and at most one doorbell); returns how many it queued.
    pub fn submit_all(&mut self, subs: &[Submission]) -> io::Result<usize> {
        let wanted = u32::try_from(subs.len()).unwrap_or(u32::MAX);
        let n = subs.len().min(self.sq_room(wanted)? as usize);
        if n == 0 {
            return Ok(0);
        }
        for (i, s) in subs[..n].iter().enumerate() {
            let slot = self.layout.sqe(self.sq_tail.wrapping_add(i as u32));
            self.map.write(slot, &s.encode())?;
        }
        self.sq_tail = self.sq_tail.wrapping_add(n as u32);
        self.map.store_u32(header::SQ_TAIL, self.sq_tail)?;
        // As in `submit`: store the tail, fence, then load the flag.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if self.map.load_u32(header::SQ_FLAGS)? & ring::SQ_NEED_WAKEUP != 0 {
            self.ring_doorbell()?;
        }
        Ok(n)
    }

    /// Writes raw bytes as the next submission (for testing the daemon's checks).
    pub fn submit_raw(&mut self, entry: &[u8; ring::SQE_SIZE]) -> io::Result<()> {
        self.map.write(self.layout.sqe(self.sq_tail), entry)?;
        self.sq_tail = self.sq_tail.wrapping_add(1);
        self.map.store_u32(header::SQ_TAIL, self.sq_tail)?;
        self.ring_doorbell()
    }

    /// Publishes an arbitrary submission tail (for testing the daemon's checks).
    pub fn set_tail_raw(&mut self, tail: u32) -> io::Result<()> {
        self.sq_tail = tail;
        self.map.store_u32(header::SQ_TAIL, tail)?;
        self.ring_doorbell()
    }

    /// The next completion, if one is there.
    pub fn poll(&mut self) -> io::Result<Option<Completion>> {
        let tail = self.map.load_u32(header::CQ_TAIL)?;
        if tail == self.cq_head {
            return Ok(None);
        }
        let mut bytes = [0u8; CQE_SIZE];
        self.map.read(self.layout.cqe(self.cq_head), &mut bytes)?;
        self.cq_head = self.cq_head.wrapping_add(1);
        self.map.store_u32(header::CQ_HEAD, self.cq_head)?;
        // Pairs with the worker's (set flag, fence, load head): one of the two sees the other.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if self.map.load_u32(header::SQ_FLAGS)? & ring::CQ_WAITING != 0 {
            self.ring_doorbell()?;
        }
        Completion::decode(&bytes)
            .map(Some)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "malformed completion"))
    }

    /// Whether a completion is there to take, without taking it.
    pub fn has_completion(&self) -> io::Result<bool> {
        Ok(self.map.load_u32(header::CQ_TAIL)? != self.cq_head)
    }

    /// Asks the daemon to write the completion channel when it delivers completions (or
    /// stops asking): for a client that sleeps on the channel itself, in an event loop of
    /// its own. After asking, look at [`QueuePairRing::has_completion`] before sleeping:
    /// a completion delivered just before the request finds no wake-up.
    pub fn request_wakeups(&mut self, on: bool) -> io::Result<()> {
        self.map
            .store_u32(header::CQ_FLAGS, if on { ring::CQ_NEED_WAKEUP } else { 0 })?;
        // Pairs with the worker's (store tail, fence, load flag).
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// The completion channel (the read end of a non-blocking pipe), for a client's own
    /// `poll`/`epoll`; read it empty with [`QueuePairRing::drain_wakeups`].
    pub fn completion_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.completions.as_fd()
    }

    /// Reads the completion channel empty, without waiting. `Ok(false)` once the daemon
    /// no longer serves the queue pair (its end is closed).
    pub fn drain_wakeups(&self) -> io::Result<bool> {
        let mut buf = [0u8; 256];
        loop {
            match nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&self.completions), &mut buf) {
                Ok(0) => return Ok(false),
                Ok(_) => continue,
                Err(nix::errno::Errno::EAGAIN) => return Ok(true),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Waits up to `timeout` for the next completion, sleeping on the completion channel.
    pub fn wait(&mut self, timeout: Duration) -> io::Result<Option<Completion>> {
        self.wait_with(Wait::Block, timeout)
    }

    /// Waits up to `timeout` for the next completion, spinning first if `how` says so.
    pub fn wait_with(&mut self, how: Wait, timeout: Duration) -> io::Result<Option<Completion>> {
        // A completion already there costs no look at the clock.
        if let Some(c) = self.poll()? {
            return Ok(Some(c));
        }
        let start = std::time::Instant::now();
        let deadline = start + timeout;
        if let Wait::Spin(budget) = how {
            let spin_until = start + budget.min(timeout);
            let pure_until = start + PURE_SPIN.min(budget).min(timeout);
            loop {
                if let Some(c) = self.poll()? {
                    return Ok(Some(c));
                }
                let now = std::time::Instant::now();
                if now >= spin_until {
                    break;
                }
                if now < pure_until {
                    std::hint::spin_loop();
                    continue;
                }
                // Let whoever else wants this CPU have it (the daemon's worker, the peer):
                // where spinners outnumber cores, a bare spin starves the thread that
                // would deliver the completion for a whole scheduler slice.
                std::thread::yield_now();
            }
        }
        loop {
            if let Some(c) = self.poll()? {
                return Ok(Some(c));
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            // Ask for a wake-up, then look again: the daemon stores its tail, then loads
            // the flag; one of the two sees the other's store.
            self.map.store_u32(header::CQ_FLAGS, ring::CQ_NEED_WAKEUP)?;
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            let found = self.poll();
            if !matches!(found, Ok(None)) {
                self.map.store_u32(header::CQ_FLAGS, 0)?;
                return found;
            }
            let slept = self.sleep(left);
            self.map.store_u32(header::CQ_FLAGS, 0)?;
            slept?;
        }
    }

    /// Sleeps on the completion channel for up to `left` (at most a second at a time) and
    /// reads it empty.
    fn sleep(&self, left: Duration) -> io::Result<()> {
        let mut fds = [nix::poll::PollFd::new(
            self.completions.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let ms = u16::try_from(left.as_millis().clamp(1, 1000)).unwrap_or(1000);
        nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms))?;
        let mut buf = [0u8; 256];
        match nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&self.completions), &mut buf) {
            // The daemon holds the other end as long as it serves the QP.
            Ok(0) => Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "rdmad no longer serves this queue pair (destroyed, or rdmad stopped)",
            )),
            Ok(_) | Err(nix::errno::Errno::EAGAIN) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Wakes the daemon's worker: one byte down the doorbell pipe. A full pipe holds a
    /// wake-up the worker has not read yet.
    fn ring_doorbell(&self) -> io::Result<()> {
        match nix::unistd::write(self.doorbell.as_fd(), &[1]) {
            Ok(_) | Err(nix::errno::Errno::EAGAIN) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::{Opcode, RegionSge, Status};

    /// A ring as the daemon lays it out, the client's end of it, and the daemon's: its own
    /// mapping of the memory and the doorbell's read end.
    struct Rig {
        client: QueuePairRing,
        daemon: RegionMapping,
        layout: Layout,
        doorbell: OwnedFd,
        cq_tail: u32,
    }

    fn pipe() -> (OwnedFd, OwnedFd) {
        nix::unistd::pipe2(nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_CLOEXEC).unwrap()
    }

    fn rig(sq_entries: u32, cq_entries: u32) -> Rig {
        let layout = Layout::new(sq_entries, cq_entries).unwrap();
        let size = layout.size();
        let fd = crate::mapping::tests::memfd(size);
        let daemon = RegionMapping::map(fd.try_clone().unwrap(), size, true).unwrap();
        for (offset, value) in layout.header_words() {
            daemon.store_u32(offset, value).unwrap();
        }
        let (doorbell, doorbell_client) = pipe();
        let (_completions_daemon, completions) = pipe();
        let info = RingInfo {
            size: size as u64,
            sq_entries: layout.sq_entries,
            cq_entries: layout.cq_entries,
        };
        let client = QueuePairRing::new(fd, doorbell_client, completions, info).unwrap();
        Rig {
            client,
            daemon,
            layout,
            doorbell,
            cq_tail: 0,
        }
    }

    impl Rig {
        /// Delivers a completion as the worker does: the entry, then the tail.
        fn deliver(&mut self, wr_id: u64) {
            let c = Completion {
                wr_id,
                status: Status::Success,
                opcode: Opcode::Write,
                byte_len: 8,
                imm: None,
                detail: 0,
            };
            self.daemon
                .write(self.layout.cqe(self.cq_tail), &c.encode())
                .unwrap();
            self.cq_tail += 1;
            self.daemon
                .store_u32(header::CQ_TAIL, self.cq_tail)
                .unwrap();
        }

        /// Doorbell bytes written since the last look.
        fn rings(&self) -> usize {
            let mut buf = [0u8; 64];
            match nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&self.doorbell), &mut buf) {
                Ok(n) => n,
                Err(nix::errno::Errno::EAGAIN) => 0,
                Err(e) => panic!("doorbell: {e}"),
            }
        }
    }

    fn write(wr_id: u64) -> Submission {
        Submission::new(
            Opcode::Write,
            wr_id,
            RegionSge {
                region: 1,
                offset: 0,
                length: 8,
            },
        )
    }

    /// A full submission ring is refused, and the room the daemon frees by moving its head
    /// is used, by `submit` and `submit_all` alike.
    #[test]
    fn the_submission_ring_takes_exactly_the_room_the_daemon_has_freed() {
        let mut r = rig(4, 4);
        for wr_id in 0..4 {
            assert_eq!(r.client.submit(&write(wr_id)).unwrap(), Ok(()));
        }
        assert_eq!(r.client.submit(&write(4)).unwrap(), Err(RingFull));
        assert_eq!(r.daemon.load_u32(header::SQ_TAIL).unwrap(), 4);
        // The daemon takes three.
        r.daemon.store_u32(header::SQ_HEAD, 3).unwrap();
        assert_eq!(r.client.submit_all(&[write(4), write(5)]).unwrap(), 2);
        assert_eq!(r.client.submit(&write(6)).unwrap(), Ok(()));
        assert_eq!(r.client.submit(&write(7)).unwrap(), Err(RingFull));
        assert_eq!(r.client.submit_all(&[write(7)]).unwrap(), 0);
        assert_eq!(r.daemon.load_u32(header::SQ_TAIL).unwrap(), 7);
        // What lies in the slots is what was submitted, in order.
        let mut bytes = [0u8; ring::SQE_SIZE];
        for wr_id in 3..7 {
            r.daemon
                .read(r.layout.sqe(wr_id as u32), &mut bytes)
                .unwrap();
            assert_eq!(Submission::decode(&bytes).unwrap().wr_id, wr_id);
        }
        // No worker sleeps here: nothing rang the doorbell.
        assert_eq!(r.rings(), 0);
    }

    /// A worker holding completions back for want of room (`CQ_WAITING`) is told by the
    /// doorbell as the client takes completions and so makes room; while it holds none,
    /// taking completions makes no system call.
    #[test]
    fn taking_completions_rings_the_doorbell_only_for_a_worker_holding_some_back() {
        let mut r = rig(4, 4);
        r.deliver(10);
        r.deliver(11);
        assert_eq!(r.client.poll().unwrap().map(|c| c.wr_id), Some(10));
        assert_eq!(r.rings(), 0, "rung with nothing held back");
        r.daemon
            .store_u32(header::SQ_FLAGS, ring::CQ_WAITING)
            .unwrap();
        assert_eq!(r.client.poll().unwrap().map(|c| c.wr_id), Some(11));
        assert_eq!(r.rings(), 1, "the worker holding completions was not told");
        // An empty ring: nothing taken, no room made, nothing rung.
        assert_eq!(r.client.poll().unwrap(), None);
        assert!(!r.client.has_completion().unwrap());
        assert_eq!(r.rings(), 0);
        r.deliver(12);
        assert_eq!(
            r.client
                .wait(Duration::from_secs(1))
                .unwrap()
                .map(|c| c.wr_id),
            Some(12)
        );
        assert_eq!(r.rings(), 1);
        r.daemon.store_u32(header::SQ_FLAGS, 0).unwrap();
        r.deliver(13);
        assert_eq!(r.client.poll().unwrap().map(|c| c.wr_id), Some(13));
        assert_eq!(r.rings(), 0);
    }
}
