//! A fault across hosts: the wire going down under a transfer (`ip link set eth0 down` in
//! this guest, up again once the transfer failed). A binary of its own, so that no other
//! test shares the run with a wire that comes and goes (scripts/test-vm runs it with
//! tests/vm/pair-runner, as `two_hosts`).

use rdmad_tests::across::{
    assert_both_back, assert_stream_failed, connected_across, peer, stream_under_way,
};
use rdmad_tests::daemon::{object_counts, start_on};

/// Sets this guest's end of the wire `down` or `up`.
fn link(state: &str) {
    let out = std::process::Command::new("ip")
        .args(["link", "set", "eth0", state])
        .output()
        .expect("run ip");
    assert!(out.status.success(), "ip link set eth0 {state}: {out:?}");
}

/// The link goes down in the middle of a stream of 1 MiB WRITEs from this host's rdmad
/// client into the peer's: the device fails the writer's next WRITE, its queue pair goes
/// to the error state and flushes, its daemon keeps serving; once the link is back, both
/// daemons end with nothing of either client.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_the_link_going_down_mid_stream_fails_the_transfer_cleanly() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let peer_rdmad = peer.start_rdmad("");
    let before_there = peer_rdmad.settled(0);
    let (bus, _daemon) = start_on("verbs", "").await;
    let before_here = object_counts(&bus).await;
    {
        let (mut a, mut b) = connected_across(&bus, &peer_rdmad);
        stream_under_way(&mut a, &mut b);
        link("down");
        let failure = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            assert_stream_failed(&mut a, &["DeviceError", "RetryExceeded"])
        }));
        link("up");
        if let Err(panic) = failure {
            std::panic::resume_unwind(panic);
        }
    }
    assert_both_back(&bus, &before_here, &peer_rdmad, &before_there).await;
}
