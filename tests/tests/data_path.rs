//! The shared-memory data path: work requests through a QP's rings, checked by the daemon
//! against the session's regions, run on the device, completions back through the ring.
//! Every test runs on loopback and, as `rxe_*`, on Soft-RoCE in the VM tier.

rdmad::on_both_providers!(async
    send_and_receive_through_the_rings / rxe_send_and_receive_through_the_rings,
    sigkill_mid_transfer_releases_everything / rxe_sigkill_mid_transfer_releases_everything,
    remote_access_through_exports_until_released / rxe_remote_access_through_exports_until_released,
    released_and_freed_exports_refuse_their_rkey / rxe_released_and_freed_exports_refuse_their_rkey,
    hostile_submissions_fail_alone / rxe_hostile_submissions_fail_alone,
    killed_session_with_exports_and_a_slow_worker_leaves_nothing
        / rxe_killed_session_with_exports_and_a_slow_worker_leaves_nothing,
    small_sends_and_writes_go_inline / rxe_small_sends_and_writes_go_inline,
    an_export_of_a_flushed_queue_pair_is_released_quietly
        / rxe_an_export_of_a_flushed_queue_pair_is_released_quietly,
    what_is_posted_after_a_flush_completes_flushed
        / rxe_what_is_posted_after_a_flush_completes_flushed,
);

mod bodies {
    use rdmad_tests::bus::PrivateBus;
    use rdmad_tests::client::{assert_completion, Client};
    use rdmad_tests::daemon::{object_counts, start_on, start_with_env, wait_for_sessions};
    use rdmad_tests::{kernel_verbs_objects, NOBODY};

    const OTHER: u32 = 1;

    /// Two processes of different users, each with a session, a region and a QP,
    /// connected to each other.
    fn connected_pair(bus: &PrivateBus) -> (Client, Client) {
        connected_pair_with(bus, "")
    }

    /// As [`connected_pair`], each QP made with `max_inline` (none: "").
    fn connected_pair_with(bus: &PrivateBus, max_inline: &str) -> (Client, Client) {
        let mut a = Client::start(bus, Some(NOBODY));
        let mut b = Client::start(bus, Some(OTHER));
        for c in [&mut a, &mut b] {
            c.ok("open");
            c.ok("alloc default 4096");
        }
        let dev = a.ok("devices")[0]["name"].as_str().unwrap().to_owned();
        a.ok(&format!("qp {dev} 16 16 {max_inline}"));
        b.ok(&format!("qp {dev} 16 16 {max_inline}"));
        let ea = a.ok("endpoint 0");
        let eb = b.ok("endpoint 0");
        a.ok(&format!("connect 0 {eb}"));
        b.ok(&format!("connect 0 {ea}"));
        (a, b)
    }

    pub async fn send_and_receive_through_the_rings(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, _d) = start_on(provider, "").await;
        let (mut a, mut b) = connected_pair(&bus);
        b.ok("post 0 recv 0 100 64 7");
        a.ok("write 0 0 hello-through-rdmad");
        a.ok("post 0 send 0 0 19 1");
        assert_completion(&a.ok("wait 0"), 1, "Success", "Send");
        let got = b.ok("wait 0");
        assert_completion(&got, 7, "Success", "Recv");
        assert_eq!(got["byte_len"], 19);
        assert_eq!(b.ok("read 0 100 19"), "hello-through-rdmad");

        // A read-only attachment can be a source, never a destination.
        let key = a.ok("share 0 ro")[0].as_str().unwrap().to_owned();
        b.ok(&format!("attach {key}"));
        a.ok("write 0 200 from-a-region");
        a.ok("post 0 recv 0 300 64 8");
        b.ok("post 0 send 1 200 13 2");
        assert_completion(&b.ok("wait 0"), 2, "Success", "Send");
        assert_completion(&a.ok("wait 0"), 8, "Success", "Recv");
        assert_eq!(a.ok("read 0 300 13"), "from-a-region");
        b.ok("post 0 recv 1 0 64 3");
        let refused = b.ok("wait 0");
        assert_completion(&refused, 3, "RegionAccessDenied", "Recv");
    }

    /// A QP created with `max_inline` hands the device small SENDs and WRITEs with their
    /// bytes (on rxe0 `IBV_SEND_INLINE`, which the device refuses unless the QP was made
    /// for it): they land like any others, the first byte to the last; a larger one goes
    /// by address; more than rdmad allows is refused when the QP is made, saying the range.
    pub async fn small_sends_and_writes_go_inline(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, _d) = start_on(provider, "").await;
        let (mut a, mut b) = connected_pair_with(&bus, "64");
        let dev = a.ok("devices")[0]["name"].as_str().unwrap().to_owned();
        let refused = a.err(
            &format!("qp {dev} 16 16 257"),
            "org.rdmad1.Error.InvalidArgument",
        );
        assert!(
            refused.contains("max_inline 257 is out of range: 0 to 256"),
            "{refused}"
        );

        let inline = "0123456789abcdef".repeat(4);
        let by_address = "by-address-".repeat(10);
        b.ok("post 0 recv 0 0 64 1");
        b.ok("post 0 recv 0 100 200 2");
        a.ok(&format!("write 0 0 {inline}"));
        a.ok(&format!("write 0 100 {by_address}"));
        a.ok("post 0 send 0 0 64 10");
        a.ok("post 0 send 0 100 110 11");
        assert_completion(&a.ok("wait 0"), 10, "Success", "Send");
        assert_completion(&a.ok("wait 0"), 11, "Success", "Send");
        let got = b.ok("wait 0");
        assert_completion(&got, 1, "Success", "Recv");
        assert_eq!(got["byte_len"], 64);
        assert_eq!(b.ok("read 0 0 64"), inline.as_str());
        let got = b.ok("wait 0");
        assert_completion(&got, 2, "Success", "Recv");
        assert_eq!(got["byte_len"], 110);
        assert_eq!(b.ok("read 0 100 110"), by_address.as_str());

        let export = b.ok("export 0 0 w");
        let (addr, rkey) = (export[0].as_u64().unwrap(), export[1].as_u64().unwrap());
        a.ok("write 0 300 inline-write");
        a.ok(&format!("post 0 write 0 300 12 12 {} {rkey}", addr + 500));
        assert_completion(&a.ok("wait 0"), 12, "Success", "Write");
        assert_eq!(b.ok("read 0 500 12"), "inline-write");
        let counters = a.ok("qpinfo 0");
        assert_eq!(counters["refused"], 0, "{counters}");
        assert_eq!(counters["completed"], 3, "{counters}");
    }

    /// A client that moved its QP to the error state (`Flush`) and then releases an export
    /// through it: the device flushes the invalidation posted on that QP, which is
    /// expected (deallocating the window is the invalidation), so the release succeeds,
    /// the window is gone and nothing is logged as a failure.
    pub async fn an_export_of_a_flushed_queue_pair_is_released_quietly(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, d) = start_on(provider, "").await;
        let (mut a, mut b) = connected_pair(&bus);
        let baseline = object_counts(&bus).await;
        let export = a.ok("export 0 0 w");
        let (addr, rkey, id) = (
            export[0].as_u64().unwrap(),
            export[1].as_u64().unwrap(),
            export[3].as_u64().unwrap(),
        );
        b.ok("write 0 0 before-flush");
        b.ok(&format!("post 0 write 0 0 12 1 {addr} {rkey}"));
        assert_completion(&b.ok("wait 0"), 1, "Success", "Write");
        assert_eq!(object_counts(&bus).await["mws"], baseline["mws"] + 1);
        a.ok("flush 0");
        a.ok(&format!("unexport 0 {id}"));
        assert_eq!(object_counts(&bus).await["mws"], baseline["mws"]);
        // Everything logged before a later session's opening is in stderr once it is.
        let mut later = Client::start(&bus, Some(NOBODY));
        later.ok("open");
        let log = d.wait_for_log("session opened", 3).await;
        assert!(
            !log.contains("WARN") && !log.contains("ERROR"),
            "the release of a flushed QP's export is no failure:\n{log}"
        );
    }

    /// Requests a client posts after moving its QP to the error state (`Flush`) complete
    /// flushed, receives in the order they were posted after the one the QP held. (Soft-RoCE
    /// never completes a receive posted to a QP in that state: rdmad completes those
    /// itself. A program that waits for them, as rping's CQ thread does when it
    /// disconnects, would otherwise wait for ever.)
    pub async fn what_is_posted_after_a_flush_completes_flushed(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, _d) = start_on(provider, "").await;
        let (mut a, _b) = connected_pair(&bus);
        a.ok("post 0 recv 0 0 64 1");
        a.ok("flush 0");
        a.ok("post 0 recv 0 0 64 2");
        a.ok("post 0 recv 0 64 64 3");
        a.ok("post 0 send 0 128 8 4");
        let mut recvs = Vec::new();
        let mut sends = Vec::new();
        for _ in 0..4 {
            let c = a.ok("wait 0");
            assert_eq!(c["status"], "WrFlushError", "{c}");
            match c["opcode"].as_str() {
                Some("Recv") => recvs.push(c["wr_id"].as_u64().unwrap()),
                _ => sends.push(c["wr_id"].as_u64().unwrap()),
            }
        }
        assert_eq!((recvs, sends), (vec![1, 2, 3], vec![4]));
    }

    /// Malformed, foreign, out-of-bounds and flooding requests each fail with an error
    /// completion; the QP and the daemon go on serving.
    pub async fn hostile_submissions_fail_alone(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, daemon) = start_on(provider, "").await;
        let (mut a, mut b) = connected_pair(&bus);
        let mut stranger = Client::start(&bus, Some(OTHER));
        stranger.ok("open");
        let foreign = stranger.ok("alloc default 4096")[0]
            .as_str()
            .unwrap()
            .rsplit('/')
            .next()
            .unwrap()
            .to_owned();

        a.ok("post-garbage 0 11");
        assert_completion(&a.ok("wait 0"), 11, "InvalidEntry", "Send");
        a.ok(&format!("post 0 send #{foreign} 0 8 12"));
        assert_completion(&a.ok("wait 0"), 12, "RegionAccessDenied", "Send");
        a.ok("post 0 send #999999 0 8 13");
        assert_completion(&a.ok("wait 0"), 13, "RegionAccessDenied", "Send");
        a.ok("post 0 send 0 4000 200 14");
        assert_completion(&a.ok("wait 0"), 14, "RegionAccessDenied", "Send");
        a.ok("post 0 send 0 18446744073709551615 8 15");
        assert_completion(&a.ok("wait 0"), 15, "RegionAccessDenied", "Send");

        // More receives than the queue holds: the extra ones are refused.
        for i in 0..20 {
            a.ok(&format!("post 0 recv 0 0 8 {}", 100 + i));
        }
        for i in 16..20 {
            let c = a.ok("wait 0");
            assert_completion(&c, 100 + i, "QueueFull", "Recv");
            assert_eq!(c["detail"], 16, "the detail is the depth");
        }

        // An impossible ring index is refused and skipped, every time; the log says so
        // once per QP, however often the client does it.
        for n in 1..=20 {
            b.ok(&format!("bad-tail 0 {n}"));
            assert_completion(&b.ok("wait 0"), 0, "InvalidEntry", "Send");
        }
        assert_eq!(b.ok("qpinfo 0")["refused"], 20);
        // Logged before the refusals were delivered, so before a fourth session opens
        // (a, b and the stranger opened the first three).
        let mut later = Client::start(&bus, Some(OTHER));
        later.ok("open");
        let log = daemon.wait_for_log("session opened", 4).await;
        assert_eq!(
            log.matches("submission tail out of range").count(),
            1,
            "{log}"
        );

        let counters = a.ok("qpinfo 0");
        assert_eq!(
            counters["refused"], 9,
            "garbage, 4 bad regions, 4 over depth: {counters}"
        );
        assert_eq!(counters["posted"], 16, "{counters}");
        let json: serde_json::Value = serde_json::from_str(&rdmad_tests::daemon::rdmactl_ok(
            &bus,
            Some(rdmad_tests::NOBODY),
            &["-j", "qp"],
        ))
        .unwrap();
        assert_eq!(
            json[0]["refused"], 9,
            "rdmactl qp shows the counters: {json}"
        );

        // The QPs still work: b's send lands in the first of a's receives.
        b.ok("write 0 0 still-alive");
        b.ok("post 0 send 0 0 8 20");
        assert_completion(&b.ok("wait 0"), 20, "Success", "Send");
        let got = a.ok("wait 0");
        assert_completion(&got, 100, "Success", "Recv");
        assert_eq!(got["byte_len"], 8);
        assert_eq!(a.ok("read 0 0 8"), "still-al");
    }

    /// Clients killed with SIGKILL while requests are in flight (sends waiting for
    /// receives) leave nothing behind.
    pub async fn sigkill_mid_transfer_releases_everything(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, _d) = start_on(
            provider,
            "[[pool]]\nname = \"default\"\ncapacity = \"16MiB\"\nsize_classes = [\"4KiB\"]\n",
        )
        .await;
        let baseline = object_counts(&bus).await;
        let (mut a, mut b) = connected_pair(&bus);
        for i in 0..8 {
            a.ok(&format!("post 0 recv 0 {} 64 {i}", i * 64));
        }
        for i in 0..16 {
            // The first 8 land, the other 8 wait for receives that never come.
            b.ok(&format!("post 0 send 0 0 32 {}", 100 + i));
        }
        let _ = b.ok("wait 0");
        let during = object_counts(&bus).await;
        assert_eq!(during["qps"], baseline["qps"] + 2);
        a.kill();
        b.kill();
        let after = wait_for_sessions(&bus, 0).await;
        for kind in ["qps", "cqs", "mws", "mrs", "regions", "queue_pairs", "keys"] {
            assert_eq!(
                after[kind], baseline[kind],
                "{kind}: {after:?} vs {baseline:?}"
            );
        }
    }

    /// A peer writes, reads and adds into a region through the rkey of an export; once
    /// the export is released (or the region freed) the same rkey gets a remote access
    /// error and never the memory.
    pub async fn remote_access_through_exports_until_released(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, _d) = start_on(provider, "").await;
        let (mut a, mut b) = connected_pair(&bus);
        let export = a.ok("export 0 0 rwa");
        let (addr, rkey) = (export[0].as_u64().unwrap(), export[1].as_u64().unwrap());
        assert_eq!(export[2], 4096);

        b.ok("write 0 0 remote-write");
        b.ok(&format!("post 0 write 0 0 12 1 {} {rkey}", addr + 100));
        assert_completion(&b.ok("wait 0"), 1, "Success", "Write");
        assert_eq!(a.ok("read 0 100 12"), "remote-write");

        a.ok("write 0 2000 readable");
        b.ok(&format!("post 0 read 0 500 8 2 {} {rkey}", addr + 2000));
        assert_completion(&b.ok("wait 0"), 2, "Success", "Read");
        assert_eq!(b.ok("read 0 500 8"), "readable");

        b.ok(&format!("post 0 fadd 0 1024 8 3 {} {rkey}", addr + 3000));
        assert_completion(&b.ok("wait 0"), 3, "Success", "FetchAdd");

        // Beyond the region: refused by the device.
        b.ok(&format!("post 0 write 0 0 12 4 {} {rkey}", addr + 4090));
        let beyond = b.ok("wait 0");
        assert_eq!(beyond["status"], "RemoteAccessError", "{beyond}");
    }

    /// After `ReleaseExport`, and after freeing the region, the old rkey is refused.
    pub async fn released_and_freed_exports_refuse_their_rkey(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, _d) = start_on(provider, "").await;
        for how in ["release", "free"] {
            let (mut a, mut b) = connected_pair(&bus);
            let export = a.ok("export 0 0 w");
            let (addr, rkey, id) = (
                export[0].as_u64().unwrap(),
                export[1].as_u64().unwrap(),
                export[3].as_u64().unwrap(),
            );
            b.ok("write 0 0 first");
            b.ok(&format!("post 0 write 0 0 5 1 {addr} {rkey}"));
            assert_completion(&b.ok("wait 0"), 1, "Success", "Write");
            assert_eq!(a.ok("read 0 0 5"), "first");
            match how {
                "release" => a.ok(&format!("unexport 0 {id}")),
                _ => a.ok("free 0"),
            };
            b.ok("write 0 0 stale");
            b.ok(&format!("post 0 write 0 0 5 2 {addr} {rkey}"));
            let c = b.ok("wait 0");
            assert_eq!(
                (c["wr_id"].as_u64(), c["status"].as_str()),
                (Some(2), Some("RemoteAccessError")),
                "{how}: {c}"
            );
            // Released: the memory is as it was. Freed: its pages went back, and what the
            // owner kept reads zeros; either way the stale write never landed.
            let untouched = if how == "release" {
                "first"
            } else {
                "\0\0\0\0\0"
            };
            assert_eq!(
                a.ok("read 0 0 5"),
                untouched,
                "{how}: the memory was not touched"
            );
        }
    }

    /// A session killed while two of its regions are exported (through two queue pairs),
    /// with a data-path worker slow to let go of its queue pairs — 15 s, longer than the
    /// daemon waits for it (5 s; `rdmad::test_hooks`): the windows go before the memory
    /// all the same. While the worker still holds the dead session's queue pairs, no window
    /// is left and the peer's old rkeys get a remote access error; once it lets go, nothing
    /// is left — on rxe0 `rdma resource show` is back to its baseline too.
    pub async fn killed_session_with_exports_and_a_slow_worker_leaves_nothing(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        const COLD: &str =
            "[[pool]]\nname = \"default\"\ncapacity = \"16MiB\"\nsize_classes = [\"4KiB\"]\n";
        let (bus, d) = start_with_env(
            provider,
            COLD,
            vec![("RDMAD_TEST_HANDBACK_DELAY_MS", "15000".to_owned())],
        )
        .await;
        let baseline = object_counts(&bus).await;
        let kernel = kernel_verbs_objects(provider);
        let mut a = Client::start(&bus, Some(NOBODY));
        let mut b = Client::start(&bus, Some(OTHER));
        let dev = a.ok("devices")[0]["name"].as_str().unwrap().to_owned();
        for c in [&mut a, &mut b] {
            c.ok("open");
            for _ in 0..2 {
                c.ok("alloc default 4096");
                c.ok(&format!("qp {dev} 16 16"));
            }
        }
        for n in 0..2 {
            let (ea, eb) = (
                a.ok(&format!("endpoint {n}")),
                b.ok(&format!("endpoint {n}")),
            );
            a.ok(&format!("connect {n} {eb}"));
            b.ok(&format!("connect {n} {ea}"));
        }
        // a's region n exported through its queue pair n, whose peer is b's n.
        let exports: Vec<(u64, u64)> = (0..2)
            .map(|n| {
                let e = a.ok(&format!("export {n} {n} w"));
                (e[0].as_u64().unwrap(), e[1].as_u64().unwrap())
            })
            .collect();
        for (n, (addr, rkey)) in exports.iter().enumerate() {
            b.ok(&format!("post {n} write {n} 0 8 1 {addr} {rkey}"));
            assert_completion(&b.ok(&format!("wait {n}")), 1, "Success", "Write");
        }
        // A receive in flight on a's second queue pair: the worker pins region 1 for it.
        a.ok("post 1 recv 1 100 64 9");

        a.kill();
        let during = wait_for_sessions(&bus, 1).await;
        assert_eq!(
            (during["queue_pairs"], during["qps"]),
            (2, baseline["qps"] + 4),
            "a's session is closed, its queue pairs still held by the worker: {during:?}"
        );
        assert_eq!(
            during["mws"], baseline["mws"],
            "no window is left: {during:?}"
        );
        assert_eq!(during["lingering"], 0, "{during:?}");
        for (n, (addr, rkey)) in exports.iter().enumerate() {
            b.ok(&format!("post {n} write {n} 0 8 2 {addr} {rkey}"));
            let c = b.ok(&format!("wait {n}"));
            assert_eq!(
                (c["wr_id"].as_u64(), c["status"].as_str()),
                (Some(2), Some("RemoteAccessError")),
                "export {n}: {c}"
            );
        }

        // The worker lets go of a's queue pairs (and destroys them) once the hold ends;
        // b's are let go of after them.
        d.wait_for_log("test hook: the data-path workers let go again", 1)
            .await;
        b.kill();
        let after = wait_for_sessions(&bus, 0).await;
        assert_eq!(after, baseline, "objects");
        assert_eq!(
            kernel_verbs_objects(provider),
            kernel,
            "the kernel's verbs objects"
        );
    }
}
