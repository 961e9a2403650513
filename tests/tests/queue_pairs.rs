//! Queue pairs over D-Bus: created by the daemon for a session, described by their
//! endpoint, connected to a peer, listed, refused to others, released with their session.
//! Every test runs on loopback and, as `rxe_*`, on Soft-RoCE in the VM tier.

rdmad::on_both_providers!(async
    two_processes_connect_their_queue_pairs / rxe_two_processes_connect_their_queue_pairs,
    bad_endpoints_and_options_are_refused / rxe_bad_endpoints_and_options_are_refused,
    other_users_cannot_touch_a_queue_pair / rxe_other_users_cannot_touch_a_queue_pair,
    queue_pairs_die_with_their_session / rxe_queue_pairs_die_with_their_session,
);

/// Connecting by address needs the kernel's RDMA connection manager: on `loopback0` both
/// `ConnectTo` and `Listen` say so, after the checks every device makes — the port policy
/// (a low port needs a `[[listen.grant]]`), addresses, sizes of private data, options.
#[tokio::test(flavor = "multi_thread")]
async fn connecting_by_address_says_what_is_wrong() {
    use rdmad_tests::client::Client;
    use rdmad_tests::daemon::start_on;
    use rdmad_tests::NOBODY;

    let (bus, _d) = start_on("loopback", "").await;
    let mut a = Client::start(&bus, Some(NOBODY));
    a.ok("open");
    a.ok("qp loopback0");
    let low = a.err("listen 127.0.0.1 80", "org.rdmad1.Error.NotAuthorized");
    assert!(
        low.contains("port 80") && low.contains("1024-65535") && low.contains("[[listen.grant]]"),
        "{low}"
    );
    let no_cm = a.err("listen 127.0.0.1 7471", "org.rdmad1.Error.NotSupported");
    assert!(
        no_cm.contains("rdma_cm needs a kernel RDMA device"),
        "{no_cm}"
    );
    let no_cm = a.err(
        "connect-to 0 127.0.0.1 7471",
        "org.rdmad1.Error.NotSupported",
    );
    assert!(
        no_cm.contains("rdma_cm needs a kernel RDMA device"),
        "{no_cm}"
    );
    let bad = a.err(
        "connect-to 0 peer.example 7471",
        "org.rdmad1.Error.InvalidArgument",
    );
    assert!(bad.contains("not an IPv4 or IPv6 address"), "{bad}");
    let bad = a.err(
        "connect-to 0 127.0.0.1 0",
        "org.rdmad1.Error.InvalidArgument",
    );
    assert!(bad.contains("port 0"), "{bad}");
    let long = "x".repeat(57);
    let bad = a.err(
        &format!("connect-to 0 127.0.0.1 7471 {long}"),
        "org.rdmad1.Error.InvalidArgument",
    );
    assert!(bad.contains("57 bytes") && bad.contains("(56)"), "{bad}");
    let none = a.err("accept 9", "org.rdmad1.Error.NoSuchObject");
    assert!(none.contains("listener 9"), "{none}");
    // Nothing was made on the way: the QP is still the only one, and unconnected.
    let info = a.ok("qpinfo 0");
    assert_eq!(
        (info["state"].as_str(), info["peer"].as_str()),
        (Some("reset"), Some(""))
    );
    // A queue pair connected by endpoint is refused, and keeps its connection.
    a.ok("qp loopback0");
    let (e0, e1) = (a.ok("endpoint 0"), a.ok("endpoint 1"));
    a.ok(&format!("connect 0 {e1}"));
    a.ok(&format!("connect 1 {e0}"));
    let busy = a.err(
        "connect-to 0 127.0.0.1 7471",
        "org.rdmad1.Error.InvalidArgument",
    );
    assert!(busy.contains("connected already"), "{busy}");
    assert_eq!(a.ok("qpinfo 0")["state"], "rts");

    // A grant lets the user past the policy (and on to the device's answer).
    let (bus, _d) = start_on(
        "loopback",
        "[[listen.grant]]\nports = [\"80\", \"600-700\"]\nusers = [\"nobody\"]\n",
    )
    .await;
    let mut b = Client::start(&bus, Some(NOBODY));
    b.ok("open");
    let past = b.err("listen 127.0.0.1 80", "org.rdmad1.Error.NotSupported");
    assert!(past.contains("rdma_cm"), "{past}");
    b.err("listen 127.0.0.1 650", "org.rdmad1.Error.NotSupported");
    b.err("listen 127.0.0.1 701", "org.rdmad1.Error.NotAuthorized");
}

mod bodies {
    use rdmad_tests::client::Client;
    use rdmad_tests::daemon::{object_counts, rdmactl_ok, start_on, wait_for_sessions};
    use rdmad_tests::NOBODY;
    use serde_json::Value;

    const OTHER: u32 = 1;

    fn device(client: &mut Client) -> String {
        client.ok("devices")[0]["name"].as_str().unwrap().to_owned()
    }

    pub async fn two_processes_connect_their_queue_pairs(provider: &str) {
        let (bus, _d) = start_on(provider, "").await;
        let mut a = Client::start(&bus, Some(NOBODY));
        let mut b = Client::start(&bus, Some(OTHER));
        a.ok("open");
        b.ok("open");
        let dev = device(&mut a);
        let created = a.ok(&format!("qp {dev} 64"));
        assert!(created[0].as_str().unwrap().starts_with("/org/rdmad1/qp/"));
        assert!(created[2].as_u64().unwrap() >= 64, "{created}");
        b.ok(&format!("qp {dev}"));

        let ea = a.ok("endpoint 0");
        let eb = b.ok("endpoint 0");
        assert!(
            ea["gid"].as_str().unwrap().starts_with("::ffff:"),
            "prefers the IPv4-mapped GID: {ea}"
        );
        assert!(ea["qp_num"].as_u64().unwrap() > 0);
        assert!(ea["psn"].as_u64().unwrap() <= 0xff_ffff);
        assert_eq!(a.ok("qpinfo 0")["state"], "reset");

        a.ok(&format!("connect 0 {eb}"));
        b.ok(&format!("connect 0 {ea}"));
        let info = a.ok("qpinfo 0");
        assert_eq!(info["state"], "rts");
        assert_eq!(
            info["peer"],
            format!("{}/{}", eb["gid"].as_str().unwrap(), eb["qp_num"])
        );
        let again = a.err(
            &format!("connect 0 {eb}"),
            "org.rdmad1.Error.InvalidArgument",
        );
        assert!(again.contains("connected already"), "{again}");

        let listed = a.ok("qps");
        assert_eq!(
            listed.as_array().unwrap().len(),
            1,
            "a user sees only its own"
        );
        let json: Value = serde_json::from_str(&rdmactl_ok(&bus, None, &["-j", "qp"])).unwrap();
        assert_eq!(json.as_array().unwrap().len(), 2, "root sees both");
        assert!(json.as_array().unwrap().iter().all(|q| q["state"] == "rts"));
        let text = rdmactl_ok(&bus, Some(NOBODY), &["qp"]);
        assert!(text.starts_with("qp 1 session "), "{text}");
        assert!(text.contains(" state rts "), "{text}");
    }

    pub async fn bad_endpoints_and_options_are_refused(provider: &str) {
        let (bus, _d) = start_on(provider, "").await;
        let mut a = Client::start(&bus, Some(NOBODY));
        a.ok("open");
        let dev = device(&mut a);
        let unknown = a.err("qp nosuchdev", "org.rdmad1.Error.NoSuchObject");
        assert!(
            unknown.contains("no device named \"nosuchdev\""),
            "{unknown}"
        );
        let deep = a.err(
            &format!("qp {dev} 99999999"),
            "org.rdmad1.Error.InvalidArgument",
        );
        assert!(
            deep.contains("send_depth 99999999 is out of range"),
            "{deep}"
        );
        a.ok(&format!("qp {dev}"));
        let good = a.ok("endpoint 0");
        let mut bad = good.clone();
        bad["gid"] = "banana".into();
        let e = a.err(
            &format!("connect 0 {bad}"),
            "org.rdmad1.Error.InvalidArgument",
        );
        assert!(e.contains("gid \"banana\" is not a GID"), "{e}");
        let mut bad = good.clone();
        bad["mtu"] = 1000.into();
        assert!(a
            .err(
                &format!("connect 0 {bad}"),
                "org.rdmad1.Error.InvalidArgument"
            )
            .contains("mtu 1000"));
        let mut bad = good.clone();
        bad["qp_num"] = 0.into();
        assert!(a
            .err(
                &format!("connect 0 {bad}"),
                "org.rdmad1.Error.InvalidArgument"
            )
            .contains("remote QPN 0"));
        let mut bad = good.clone();
        bad["psn"] = 0x100_0000.into();
        assert!(a
            .err(
                &format!("connect 0 {bad}"),
                "org.rdmad1.Error.InvalidArgument"
            )
            .contains("remote PSN"));
        assert_eq!(
            a.ok("qpinfo 0")["state"],
            "reset",
            "a refused connect changes nothing"
        );
    }

    pub async fn other_users_cannot_touch_a_queue_pair(provider: &str) {
        let (bus, _d) = start_on(provider, "[quota.default]\nqps = 1\n").await;
        let mut owner = Client::start(&bus, Some(NOBODY));
        let mut intruder = Client::start(&bus, Some(OTHER));
        owner.ok("open");
        intruder.ok("open");
        let dev = device(&mut owner);
        let path = owner.ok(&format!("qp {dev}"))[0]
            .as_str()
            .unwrap()
            .to_owned();
        let quota = owner.err(&format!("qp {dev}"), "org.rdmad1.Error.QuotaExceeded");
        assert!(quota.contains("queue pairs of user nobody"), "{quota}");
        let endpoint = owner.ok("endpoint 0");
        for command in [
            format!("endpoint {path}"),
            format!("qpinfo {path}"),
            format!("destroy {path}"),
            format!("connect {path} {endpoint}"),
        ] {
            intruder.err(&command, "org.rdmad1.Error.NotAuthorized");
        }
        assert!(intruder.ok("qps").as_array().unwrap().is_empty());
        assert_eq!(owner.ok("qpinfo 0")["state"], "reset");
        owner.ok("destroy 0");
        owner.err("qpinfo 0", "org.freedesktop.DBus.Error.UnknownObject");
        owner.ok(&format!("qp {dev}"));
    }

    pub async fn queue_pairs_die_with_their_session(provider: &str) {
        let (bus, _d) = start_on(provider, "").await;
        let baseline = object_counts(&bus).await;
        let mut a = Client::start(&bus, Some(NOBODY));
        let mut b = Client::start(&bus, Some(OTHER));
        a.ok("open");
        b.ok("open");
        let dev = device(&mut a);
        a.ok(&format!("qp {dev}"));
        a.ok(&format!("qp {dev}"));
        b.ok(&format!("qp {dev}"));
        let ea = a.ok("endpoint 0");
        let eb = b.ok("endpoint 0");
        a.ok(&format!("connect 0 {eb}"));
        b.ok(&format!("connect 0 {ea}"));
        let during = object_counts(&bus).await;
        assert_eq!(during["qps"], baseline["qps"] + 3);
        assert_eq!(during["cqs"], baseline["cqs"] + 3);
        assert_eq!(during["queue_pairs"], 3);

        a.ok("close");
        b.kill();
        // The departure is handled when the bus announces it.
        let settled = wait_for_sessions(&bus, 0).await;
        for kind in ["qps", "cqs", "mws", "queue_pairs", "sessions"] {
            assert_eq!(
                settled[kind], baseline[kind],
                "{kind}: {settled:?} vs {baseline:?}"
            );
        }
    }
}
