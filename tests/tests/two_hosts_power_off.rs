//! A fault across hosts: the peer guest powered off under a transfer. A binary of its
//! own: the peer does not come back, so nothing may run after it (scripts/test-vm runs it
//! with tests/vm/pair-runner, as `two_hosts`).

use rdmad_tests::across::{
    assert_back, assert_stream_failed, connected_across, peer, stream_under_way,
};
use rdmad_tests::daemon::{object_counts, start_on};

/// The peer guest is powered off (`sysrq o`, no shutdown of anything first) in the middle
/// of a stream of 1 MiB WRITEs from this host's rdmad client into the peer's: the writer's
/// WRITEs fail, its queue pair goes to the error state and flushes, its daemon keeps
/// serving, and once the client is gone this daemon holds nothing of it.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_the_peer_powered_off_mid_stream_fails_the_transfer_cleanly() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let peer_rdmad = peer.start_rdmad("");
    let (bus, _daemon) = start_on("verbs", "").await;
    let before = object_counts(&bus).await;
    {
        let (mut a, mut b) = connected_across(&bus, &peer_rdmad);
        stream_under_way(&mut a, &mut b);
        // The agent answers before the power goes.
        peer.spawn(
            None,
            &["sh", "-c", "sleep 1 && echo o > /proc/sysrq-trigger"],
            &[],
        );
        assert_stream_failed(&mut a, &["RetryExceeded"]);
    }
    peer_rdmad.gone_with_its_host();
    assert_back(&bus, &before).await;
}
