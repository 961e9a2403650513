//! What the two-host tests share (`tests/two_hosts*.rs`): the peer of the run, a pair of
//! rdmad clients connected across the wire, and the check that both daemons are back
//! where they started.

use std::collections::HashMap;

use crate::bus::PrivateBus;
use crate::client::{assert_completion, Client};
use crate::daemon::{object_counts, wait_for_sessions};
use crate::peer::{Peer, PeerRdmad};
use crate::NOBODY;

/// The peer of this run; a test run any other way fails here, saying how to run it.
pub fn peer() -> Peer {
    Peer::from_env().expect(
        "no peer guest (RDMAD_VM_PEER is not set): two-host tests run in the VM tier's \
         two-guest mode, CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=tests/vm/pair-runner",
    )
}

/// A client of this host's rdmad and one of the peer's rdmad, each as `nobody` with a
/// 1 MiB region and a QP on rxe0, connected to each other by their daemons' endpoints.
pub fn connected_across(bus: &PrivateBus, peer_rdmad: &PeerRdmad) -> (Client, Client) {
    let mut a = Client::start(bus, Some(NOBODY));
    let mut b = Client::on_peer(peer_rdmad, Some(NOBODY));
    for c in [&mut a, &mut b] {
        c.ok("open");
        c.ok("alloc default 1048576");
        c.ok("qp rxe0 64 64");
    }
    let (ea, eb) = (a.ok("endpoint 0"), b.ok("endpoint 0"));
    a.ok(&format!("connect 0 {eb}"));
    b.ok(&format!("connect 0 {ea}"));
    (a, b)
}

/// Once every session is gone, this host's daemon's objects are back at `before`.
pub async fn assert_back(bus: &PrivateBus, before: &HashMap<String, u64>) {
    wait_for_sessions(bus, 0).await;
    let after = object_counts(bus).await;
    for kind in ["qps", "cqs", "mws", "mrs", "regions", "sessions"] {
        assert_eq!(after[kind], before[kind], "{kind}: {before:?} -> {after:?}");
    }
}

/// Once every session is gone on both hosts, each daemon's objects are back at `before`.
pub async fn assert_both_back(
    bus: &PrivateBus,
    before_here: &HashMap<String, u64>,
    peer_rdmad: &PeerRdmad,
    before_there: &HashMap<String, u64>,
) {
    wait_for_sessions(bus, 0).await;
    let after_here = object_counts(bus).await;
    let after_there = peer_rdmad.settled(0);
    for kind in ["qps", "cqs", "mws", "mrs", "regions", "sessions"] {
        assert_eq!(
            after_here[kind], before_here[kind],
            "here {kind}: {after_here:?}"
        );
        assert_eq!(
            after_there[kind], before_there[kind],
            "peer {kind}: {after_there:?}"
        );
    }
}

/// Starts a stream of 1 MiB RDMA WRITEs from `a` into an export of `b`'s (its first WRITE
/// has landed), for a fault to meet under way.
pub fn stream_under_way(a: &mut Client, b: &mut Client) {
    let export = b.ok("export 0 0 w");
    let (addr, rkey) = (export[0].as_u64().unwrap(), export[1].as_u64().unwrap());
    a.ok("post 0 recv 0 0 64 99");
    a.ok(&format!("post 0 write 0 0 8 1 {addr} {rkey}"));
    assert_completion(&a.ok("wait 0"), 1, "Success", "Write");
    a.send(&format!("stream 0 0 100000 1048576 {addr} {rkey}"));
}

/// The stream [`stream_under_way`] started, after a fault: it ended in a WRITE the device
/// failed with one of `statuses` (e.g. `RetryExceeded` when nothing answers any more)
/// instead of hanging; the WRITEs still in flight and the receive posted before the stream complete
/// flushed; the writer's queue pair is in the error state and its daemon still serves it.
pub fn assert_stream_failed(a: &mut Client, statuses: &[&str]) {
    let answer = a.answer();
    eprintln!("the stream after the fault: {answer}");
    for what in [
        &["statistic", "show", "link", "rxe0/1"][..],
        &["resource", "show", "qp"],
    ] {
        if let Ok(out) = std::process::Command::new("rdma").args(what).output() {
            eprintln!(
                "rdma {}:\n{}",
                what.join(" "),
                String::from_utf8_lossy(&out.stdout)
            );
        }
    }
    let failed = answer["message"].as_str().unwrap_or_default();
    assert!(
        answer.get("error").is_some()
            && statuses
                .iter()
                .any(|s| failed.ends_with(&format!("failed: {s}"))),
        "the stream should end in a WRITE the device failed with one of {statuses:?}: {answer}"
    );
    assert_eq!(a.ok("qpinfo 0")["state"], "error");
    // What was in flight behind the failed WRITE is flushed, and the receive.
    loop {
        let c = a.ok("wait 0");
        assert_eq!(c["status"], "WrFlushError", "{c}");
        if c["wr_id"] == 99 {
            break;
        }
    }
    assert_eq!(a.ok("qps").as_array().map(Vec::len), Some(1));
}
