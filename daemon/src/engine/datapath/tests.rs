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
