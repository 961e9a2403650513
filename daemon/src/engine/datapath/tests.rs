//! The data path end to end on the loopback device: a client's ring, the worker, a QP.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmad_client::queue_pair::QueuePairRing;
use rdmad_client::ring::{self, header, Opcode, RegionSge, Status, Submission};
use rdmad_client::types::RingInfo;

use crate::config::{Config, ProviderChoice};
use crate::engine::qp::{QpOptions, QueuePairRecord};
use crate::engine::{Engine, Limits, Owner};

/// The client's end of `q`'s rings, as `CreateQueuePair` hands it out.
pub(in crate::engine) fn ring_of(q: &QueuePairRecord) -> QueuePairRing {
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
    let (engine, mut qps) = engine_with("", 1);
    (engine, qps.remove(0))
}

/// A loopback engine started from configuration `text`, a session of uid 1000 and `n`
/// queue pairs in it.
fn engine_with(text: &str, n: usize) -> (Engine, Vec<Arc<QueuePairRecord>>) {
    let config = Config::parse(std::path::Path::new("t.toml"), text).unwrap();
    let engine = Engine::start(
        config,
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
    let qps = (0..n)
        .map(|_| {
            let id = engine
                .create_qp(&alice, &limits, s, "loopback0", QpOptions::default())
                .unwrap()
                .id;
            engine.registry.own_qp(&alice, id).unwrap()
        })
        .collect();
    (engine, qps)
}

/// A request the worker refuses before the device: it names a region the session does
/// not have (`RegionAccessDenied`).
fn refused(wr_id: u64) -> Submission {
    Submission::new(
        Opcode::Send,
        wr_id,
        RegionSge {
            region: 77,
            offset: 0,
            length: 8,
        },
    )
}

#[test]
fn a_refused_submission_comes_back_as_a_completion() {
    let (_engine, q) = loopback_qp();
    let mut ring = ring_of(&q);
    ring.submit(&refused(9)).unwrap().unwrap();
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

/// What the engine's callers put after "cannot bind a window over region N: " and
/// "invalidation failed: ": the messages the worker's errors always had.
#[test]
fn worker_errors_keep_their_messages() {
    use super::worker::WorkerError;
    use crate::provider::WcStatus;
    for (error, message) in [
        (
            WorkerError::Completion(WcStatus::MemoryWindowBindError),
            "the device answered MemoryWindowBindError",
        ),
        (
            WorkerError::SendQueueFull,
            "the queue pair's send queue is full",
        ),
        (
            WorkerError::NotServed(crate::engine::QpId(7)),
            "queue pair 7 is not served",
        ),
        (
            WorkerError::TimedOut,
            "the device did not complete the request within 60 s",
        ),
        (
            WorkerError::Stopped,
            "the data-path worker let go of the queue pair before the request completed",
        ),
    ] {
        assert_eq!(error.to_string(), message);
    }
}

/// An engine with `workers` data-path workers that never sleep during a test (so a QP's
/// requests are found by the worker's passes, not by a doorbell), and `n` queue pairs.
fn engine_with_qps(workers: u32, n: usize) -> (Engine, Vec<Arc<QueuePairRecord>>) {
    engine_with(
        &format!("[daemon]\nworkers = {workers}\nworker_spin_us = 1000000\n"),
        n,
    )
}

/// Submits a refused request and waits for its completion: proof that the QP is served.
fn answered(ring: &mut QueuePairRing, wr_id: u64) {
    ring.submit(&refused(wr_id)).unwrap().unwrap();
    let c = ring.wait(Duration::from_secs(10)).unwrap();
    assert_eq!(
        c.map(|c| (c.wr_id, c.status)),
        Some((wr_id, Status::RegionAccessDenied))
    );
}

/// New queue pairs go to the worker serving the fewest, and each is served there.
#[test]
fn queue_pairs_are_spread_over_the_workers() {
    let (_engine, qps) = engine_with_qps(3, 7);
    let mut per_worker = [0; 3];
    for q in &qps {
        per_worker[*q.worker.get().expect("a worker serves it")] += 1;
    }
    assert_eq!(per_worker, [3, 2, 2]);
    for (i, q) in qps.iter().enumerate() {
        answered(&mut ring_of(q), i as u64);
    }
}

/// A queue pair idle long enough to rest (looked at only a few per pass) among hundreds of
/// others is still served without a doorbell, every time it wakes up.
#[test]
fn a_resting_queue_pair_is_still_served() {
    let (_engine, qps) = engine_with_qps(1, 300);
    let mut ring = ring_of(&qps[0]);
    // The worker does not sleep (a 1 s spin), so no doorbell is rung: the client sees
    // SQ_NEED_WAKEUP clear.
    for round in 0..20 {
        answered(&mut ring, round);
        // Long enough for every QP to rest (1 ms without work).
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            qps[0].ring.load_u32(header::SQ_FLAGS).unwrap() & ring::SQ_NEED_WAKEUP,
            0,
            "the worker slept"
        );
    }
}

/// A batch is published with one store of the tail: every request of it comes back, in
/// order; a batch larger than the ring's free room queues exactly what fits.
#[test]
fn a_batch_is_published_at_once_and_no_more_than_fits() {
    let (_engine, q) = loopback_qp();
    let mut ring = ring_of(&q);
    let take = |ring: &mut QueuePairRing, n: u64| {
        for wr_id in 0..n {
            let c = ring.wait(Duration::from_secs(10)).unwrap();
            assert_eq!(
                c.map(|c| (c.wr_id, c.status)),
                Some((wr_id, Status::RegionAccessDenied))
            );
        }
    };
    let three: Vec<Submission> = (0..3).map(refused).collect();
    assert_eq!(ring.submit_all(&three).unwrap(), 3);
    take(&mut ring, 3);
    let sq = u64::from(q.layout.sq_entries);
    let too_many: Vec<Submission> = (0..sq + 5).map(refused).collect();
    assert_eq!(ring.submit_all(&too_many).unwrap() as u64, sq);
    take(&mut ring, sq);
    assert_eq!(ring.poll().unwrap(), None);
}

/// A device that takes only the first `take` requests of each batch (as one whose queue
/// fills part-way does), and completes what it took when its CQ is polled — unless it
/// `holds` them. In the error state (`failed`) it refuses receives as flushed, as rxe does,
/// and completes what it took flushed.
#[derive(Debug)]
struct TakesPrefix {
    take: usize,
    failed: std::sync::atomic::AtomicBool,
    holds: std::sync::atomic::AtomicBool,
    posted: std::sync::Mutex<Vec<(u64, crate::provider::WcOpcode)>>,
    event: std::os::fd::OwnedFd,
}

impl TakesPrefix {
    fn new(take: usize, failed: bool) -> Arc<TakesPrefix> {
        Arc::new(TakesPrefix {
            take,
            failed: failed.into(),
            holds: false.into(),
            posted: std::sync::Mutex::new(Vec::new()),
            event: std::fs::File::open("/dev/null").unwrap().into(),
        })
    }

    fn post(
        &self,
        ids: impl ExactSizeIterator<Item = u64>,
        opcode: crate::provider::WcOpcode,
    ) -> Result<(), crate::provider::PostError> {
        let asked = ids.len();
        let mut posted = self.posted.lock().unwrap();
        posted.extend(ids.take(self.take).map(|id| (id, opcode)));
        if asked <= self.take {
            return Ok(());
        }
        Err(crate::provider::PostError {
            posted: self.take,
            error: crate::provider::ProviderError::InvalidArgument {
                device: "prefix0".into(),
                message: "queue full".into(),
            },
        })
    }
}

impl crate::provider::QueuePair for TakesPrefix {
    fn qp_num(&self) -> u32 {
        1
    }
    fn state(&self) -> crate::provider::Result<crate::provider::QpState> {
        Ok(crate::provider::QpState::Rts)
    }
    fn to_init(&self, _: u8, _: crate::provider::Access) -> crate::provider::Result<()> {
        Ok(())
    }
    fn to_rtr(
        &self,
        _: &crate::provider::RemoteEndpoint,
        _: &crate::provider::RtrAttributes,
    ) -> crate::provider::Result<()> {
        Ok(())
    }
    fn to_rts(&self, _: &crate::provider::RtsAttributes) -> crate::provider::Result<()> {
        Ok(())
    }
    fn to_error(&self) -> crate::provider::Result<()> {
        Ok(())
    }
    fn post_send(&self, wrs: &[crate::provider::SendWr]) -> Result<(), crate::provider::PostError> {
        self.post(wrs.iter().map(|w| w.wr_id), crate::provider::WcOpcode::Send)
    }
    fn post_recv(&self, wrs: &[crate::provider::RecvWr]) -> Result<(), crate::provider::PostError> {
        if self.failed.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(crate::provider::PostError::none(
                crate::provider::ProviderError::Flushed {
                    device: "prefix0".into(),
                },
            ));
        }
        self.post(wrs.iter().map(|w| w.wr_id), crate::provider::WcOpcode::Recv)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The CQ of a [`TakesPrefix`]: every request it took and does not hold completes,
/// successfully or, once it failed, flushed.
#[derive(Debug)]
struct PrefixCq(Arc<TakesPrefix>);

impl crate::provider::CompletionQueue for PrefixCq {
    fn poll(
        &self,
        out: &mut Vec<crate::provider::WorkCompletion>,
        max: usize,
    ) -> crate::provider::Result<usize> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.0.holds.load(Relaxed) {
            return Ok(0);
        }
        let status = if self.0.failed.load(Relaxed) {
            crate::provider::WcStatus::WrFlushError
        } else {
            crate::provider::WcStatus::Success
        };
        let mut posted = self.0.posted.lock().unwrap();
        let n = posted.len().min(max);
        out.extend(
            posted
                .drain(..n)
                .map(|(wr_id, opcode)| crate::provider::WorkCompletion {
                    wr_id,
                    status,
                    opcode,
                    byte_len: 0,
                    imm: None,
                    qp_num: 1,
                }),
        );
        Ok(n)
    }
    fn arm(&self) -> crate::provider::Result<()> {
        Ok(())
    }
    fn event_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.0.event)
    }
    fn acknowledge_events(&self) -> crate::provider::Result<u32> {
        Ok(0)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A record like `q`'s (its session and options) with `rights`, on a device of its own and
/// a ring of its own, which no worker serves: the test serves it by hand.
fn record_on(
    q: &QueuePairRecord,
    device: &Arc<TakesPrefix>,
    rights: Arc<super::rights::SessionRights>,
) -> Arc<QueuePairRecord> {
    record_with(
        q,
        Arc::clone(device) as Arc<dyn crate::provider::QueuePair>,
        Arc::new(PrefixCq(Arc::clone(device))),
        rights,
    )
}

/// A record like `q` (its options and ring layout) on a ring of its own, for `qp` and its
/// send and receive CQ `cq`.
fn record_with(
    q: &QueuePairRecord,
    qp: Arc<dyn crate::provider::QueuePair>,
    cq: Arc<dyn crate::provider::CompletionQueue>,
    rights: Arc<super::rights::SessionRights>,
) -> Arc<QueuePairRecord> {
    let ring = crate::engine::qp::new_ring(&q.layout).unwrap();
    Arc::new(QueuePairRecord {
        session: q.session,
        rights,
        owner_uid: q.owner_uid,
        device: "prefix0".into(),
        options: q.options,
        domain: q.domain,
        exports: std::sync::Mutex::default(),
        link: std::sync::Mutex::new(None),
        connecting: std::sync::atomic::AtomicBool::new(false),
        qp,
        cq,
        ring: Arc::new(ring),
        layout: q.layout,
        doorbell: super::wakeup::WakePipe::doorbell().unwrap(),
        completion_event: super::wakeup::WakePipe::completions().unwrap(),
        local: q.local.clone(),
        max_message: q.max_message,
        remote: std::sync::Mutex::new(None),
        counters: crate::engine::qp::QpCounters::default(),
        worker: std::sync::OnceLock::new(),
    })
}

/// A record on `device` (see [`record_on`]), its client's ring, and the worker's view of it,
/// for a test to serve by hand.
fn by_hand(
    q: &QueuePairRecord,
    device: &Arc<TakesPrefix>,
    rights: Arc<super::rights::SessionRights>,
) -> (Arc<QueuePairRecord>, QueuePairRing, super::served::ServedQp) {
    let record = record_on(q, device, rights);
    let ring = ring_of(&record);
    let served =
        super::served::ServedQp::new(crate::engine::qp::QpId(u64::MAX), Arc::clone(&record));
    (record, ring, served)
}

/// The record's counters: posted, completed, failed, refused.
fn counts(record: &QueuePairRecord) -> [u64; 4] {
    let c = &record.counters;
    [&c.posted, &c.completed, &c.failed, &c.refused]
        .map(|n| n.load(std::sync::atomic::Ordering::Relaxed))
}

/// What a client reads back for receives `ids`, all flushed.
fn flushed_recvs(ids: std::ops::Range<u64>) -> Vec<(u64, Status, Opcode)> {
    ids.map(|i| (i, Status::WrFlushError, Opcode::Recv))
        .collect()
}

/// A session's rights to validate's two test regions (1 writable, 2 read-only, 8 KiB each)
/// and region 1's registration, whose reference count tells how many requests pin it.
fn rights_and_region_1() -> (
    Arc<super::rights::SessionRights>,
    Arc<dyn crate::provider::MemoryRegion>,
) {
    let (rights, mut mrs) = super::validate::tests::rights();
    let session = Arc::new(super::rights::SessionRights::default());
    session.store(rights);
    (session, mrs.swap_remove(0))
}

/// A request of 8 bytes of region 1 (see [`rights_and_region_1`]).
fn on_region(opcode: Opcode, wr_id: u64) -> Submission {
    Submission::new(
        opcode,
        wr_id,
        RegionSge {
            region: 1,
            offset: 0,
            length: 8,
        },
    )
}

/// Serves `record` until nothing moves; returns every completion its client then reads,
/// in the order they were delivered.
fn serve_in_order(
    served: &mut super::served::ServedQp,
    ring: &mut QueuePairRing,
) -> Vec<(u64, Status, Opcode)> {
    while served.serve() {}
    let mut got = Vec::new();
    while let Some(c) = ring.poll().unwrap() {
        got.push((c.wr_id, c.status, c.opcode));
    }
    got
}

/// [`serve_in_order`], sorted by wr_id (where the order of delivery is not what a test is
/// about: refusals come back before the completions of requests staged ahead of them).
fn serve_all(
    served: &mut super::served::ServedQp,
    ring: &mut QueuePairRing,
) -> Vec<(u64, Status, Opcode)> {
    let mut got = serve_in_order(served, ring);
    got.sort_by_key(|c| c.0);
    got
}

/// What a client reads back for requests `0..n` of which the device took the first
/// `taken`: those complete, the rest are refused as the device's.
fn outcomes(n: u64, taken: u64, opcode: impl Fn(u64) -> Opcode) -> Vec<(u64, Status, Opcode)> {
    (0..n)
        .map(|i| {
            let status = if i < taken {
                Status::Success
            } else {
                Status::DeviceError
            };
            (i, status, opcode(i))
        })
        .collect()
}

/// A device that takes the first 3 of a batch of 5 sends: the 3 it took complete as the
/// device says, the other 2 come back refused (`DeviceError`, not counted against the
/// client), nothing stays in flight or pins the region it used, and the counters say 3
/// posted, 3 completed. The same for receives, and for a batch of both; receives a device
/// refuses as flushed complete `WrFlushError`.
#[test]
fn what_a_device_does_not_take_of_a_batch_comes_back_refused() {
    let (_engine, q) = loopback_qp();
    let (rights, mr) = rights_and_region_1();
    // Held by the rights and by `mr`: every request adds one while it is in flight.
    let unpinned = Arc::strong_count(&mr);
    let device = TakesPrefix::new(3, false);
    let (record, mut ring, mut served) = by_hand(&q, &device, Arc::clone(&rights));
    for opcode in [Opcode::Send, Opcode::Recv] {
        let batch: Vec<Submission> = (0..5).map(|i| on_region(opcode, i)).collect();
        assert_eq!(ring.submit_all(&batch).unwrap(), 5);
        let expected = outcomes(5, 3, |_| opcode);
        assert_eq!(serve_all(&mut served, &mut ring), expected, "{opcode:?}");
        assert!(served.may_rest(), "{opcode:?}: requests left in flight");
        assert!(!served.expects_completions(), "{opcode:?}");
        assert_eq!(
            Arc::strong_count(&mr),
            unpinned,
            "{opcode:?}: the region stays pinned"
        );
    }
    // Four sends, then four receives, in one batch: the device takes the first 3 of each
    // kind (receives and sends are posted as two batches), so wr 3 and 7 are refused.
    let kind = |i: u64| if i < 4 { Opcode::Send } else { Opcode::Recv };
    let batch: Vec<Submission> = (0..8).map(|i| on_region(kind(i), i)).collect();
    assert_eq!(ring.submit_all(&batch).unwrap(), 8);
    let mut expected = outcomes(8, 8, kind);
    for refused in [3, 7] {
        expected[refused].1 = Status::DeviceError;
    }
    assert_eq!(serve_all(&mut served, &mut ring), expected);
    assert!(served.may_rest(), "requests left in flight");
    assert_eq!(Arc::strong_count(&mr), unpinned, "the region stays pinned");
    assert_eq!(counts(&record), [12, 12, 0, 0]);

    let device = TakesPrefix::new(3, true);
    let (record, mut ring, mut served) = by_hand(&q, &device, rights);
    let batch: Vec<Submission> = (0..4).map(|i| on_region(Opcode::Recv, i)).collect();
    assert_eq!(ring.submit_all(&batch).unwrap(), 4);
    assert_eq!(serve_all(&mut served, &mut ring), flushed_recvs(0..4));
    assert_eq!(
        Arc::strong_count(&mr),
        unpinned,
        "flushed receives pin the region"
    );
    assert_eq!(counts(&record), [0, 0, 4, 0]);
}

/// Receives posted after the QP failed, which the device refuses as flushed, complete
/// after the receives the device still holds from before, in the order all of them were
/// posted: a client matching receives to incoming messages by order never sees a later
/// receive finish first. Nothing stays pinned, and all four count as failed.
#[test]
fn receives_refused_as_flushed_complete_after_those_the_device_holds() {
    use std::sync::atomic::Ordering::Relaxed;
    let (_engine, q) = loopback_qp();
    let (rights, mr) = rights_and_region_1();
    let unpinned = Arc::strong_count(&mr);
    let device = TakesPrefix::new(8, false);
    device.holds.store(true, Relaxed);
    let (record, mut ring, mut served) = by_hand(&q, &device, rights);
    let recvs = |ids: std::ops::Range<u64>| -> Vec<Submission> {
        ids.map(|i| on_region(Opcode::Recv, i)).collect()
    };
    assert_eq!(ring.submit_all(&recvs(0..2)).unwrap(), 2);
    assert_eq!(serve_in_order(&mut served, &mut ring), []);
    // The QP fails; the device has not flushed the two it holds yet.
    device.failed.store(true, Relaxed);
    assert_eq!(ring.submit_all(&recvs(2..4)).unwrap(), 2);
    assert_eq!(
        serve_in_order(&mut served, &mut ring),
        [],
        "receives refused as flushed overtook the receives the device holds"
    );
    device.holds.store(false, Relaxed);
    assert_eq!(serve_in_order(&mut served, &mut ring), flushed_recvs(0..4));
    assert!(served.may_rest(), "requests left in flight");
    assert!(!served.expects_completions());
    assert_eq!(
        Arc::strong_count(&mr),
        unpinned,
        "flushed receives pin the region"
    );
    assert_eq!(counts(&record), [2, 0, 4, 0]);
}

/// A QP whose requests wait in the device for ever — a SEND retried while its peer posts
/// no receive, a receive no message comes for — may rest (looked at only now and then once
/// nothing has moved for it for a while): a tenant's QPs parked so do not make every pass
/// of a worker its neighbours share look at each of them (`rdmad-bench ring`: a lone
/// WRITE's latency with 1,000 such QPs on its worker went from 16 µs to 0.7 µs). When the
/// device completes them at last, the completions come back.
#[test]
fn a_queue_pair_whose_requests_never_complete_may_rest() {
    use std::sync::atomic::Ordering::Relaxed;
    let (_engine, q) = loopback_qp();
    let (rights, _mr) = rights_and_region_1();
    let device = TakesPrefix::new(8, false);
    device.holds.store(true, Relaxed);
    let (_record, mut ring, mut served) = by_hand(&q, &device, rights);
    let requests = [on_region(Opcode::Send, 1), on_region(Opcode::Recv, 2)];
    assert_eq!(ring.submit_all(&requests).unwrap(), 2);
    assert_eq!(serve_in_order(&mut served, &mut ring), []);
    assert!(served.expects_completions());
    assert!(
        served.may_rest(),
        "a SEND in flight that never completes keeps its QP busy"
    );
    device.holds.store(false, Relaxed);
    assert_eq!(
        serve_all(&mut served, &mut ring),
        [
            (1, Status::Success, Opcode::Send),
            (2, Status::Success, Opcode::Recv)
        ]
    );
}

/// In the steady state the worker allocates nothing for a request: batches of 32 RDMA
/// WRITEs of 64 B on the loopback device, each taken from the ring, checked, posted, run by
/// the device, reaped and delivered, make no heap allocation on the thread serving them
/// once its buffers have grown to a batch — and every write still lands and completes.
#[test]
fn a_steady_stream_of_writes_allocates_nothing() {
    use crate::provider::loopback::tests::{pair, Opts};
    use crate::provider::loopback::LoopbackDevice;
    use crate::provider::Access;
    let (_engine, q) = loopback_qp();
    let dev = LoopbackDevice::new("lo-steady");
    let opts = Opts {
        depth: 128,
        cq_depth: 256,
        mr_access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        ..Opts::default()
    };
    // `a` posts; its region is the session's region 1; the writes land in `b`'s.
    let (a, b) = pair(&dev, &opts);
    let (source, target) = (&a.mr, &b.mr);
    let mut region = super::validate::RegionRights::default();
    region.insert(
        crate::engine::RegionId(1),
        super::validate::RegionRight {
            mr: Arc::clone(source),
            writable: true,
            in_domains: Vec::new(),
        },
    );
    let rights = Arc::new(super::rights::SessionRights::default());
    rights.store(region);
    let record = record_with(&q, Arc::clone(&a.qp), Arc::clone(&a.cq), rights);
    let mut ring = ring_of(&record);
    let mut served =
        super::served::ServedQp::new(crate::engine::qp::QpId(u64::MAX), Arc::clone(&record));

    let mut next = 0u64;
    let mut round = |ring: &mut QueuePairRing, served: &mut super::served::ServedQp| {
        let batch: Vec<Submission> = (next..next + 32)
            .map(|i| Submission {
                remote_addr: target.addr() + (i % 64) * 64,
                rkey: target.rkey(),
                ..Submission::new(
                    Opcode::Write,
                    i,
                    RegionSge {
                        region: 1,
                        offset: (i % 64) * 64,
                        length: 64,
                    },
                )
            })
            .collect();
        source
            .memory()
            .write_at((next % 64) as usize * 64, &next.to_le_bytes())
            .unwrap();
        assert_eq!(ring.submit_all(&batch).unwrap(), 32);
        let made = allocation_counter::measure(|| while served.serve() {});
        for i in next..next + 32 {
            let c = ring.poll().unwrap().expect("a completion for every write");
            assert_eq!((c.wr_id, c.status), (i, Status::Success));
        }
        assert!(ring.poll().unwrap().is_none());
        let mut landed = [0u8; 8];
        target
            .memory()
            .read_at((next % 64) as usize * 64, &mut landed)
            .unwrap();
        assert_eq!(
            u64::from_le_bytes(landed),
            next,
            "batch {next}: the write did not land"
        );
        next += 32;
        made.count_total
    };
    // The worker's buffers grow to a batch the first time.
    assert!(
        round(&mut ring, &mut served) > 0,
        "the allocation counter counts nothing"
    );
    for _ in 0..100 {
        round(&mut ring, &mut served);
    }
    let made: u64 = (0..1000).map(|_| round(&mut ring, &mut served)).sum();
    assert_eq!(made, 0, "allocations for 32,000 writes in the steady state");
    assert_eq!(counts(&record), [32 * 1101, 32 * 1101, 0, 0]);
}
