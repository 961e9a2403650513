//! Direct connections (`Manager.OpenDirect`, `rdmad_client::connect_direct`): the same
//! objects peer to peer, as the caller the bus vouched for, closed with the connection,
//! bounded per user — and what the operator on the bus sees of them.

use rdmad_tests::bus::PrivateBus;
use rdmad_tests::client::Client;
use rdmad_tests::daemon::{object_counts, rdmactl_ok, start_loopback, Daemon};
use rdmad_tests::NOBODY;
use serde_json::Value;

/// A second unprivileged user, present on every Debian system (`daemon`).
const OTHER: u32 = 1;

const CONFIG: &str = "[[pool]]\nname = \"cold\"\ncapacity = \"64MiB\"\n\
                      size_classes = [\"4KiB\", \"64KiB\"]\n\
                      [quota.default]\nregions = 2\nsessions = 2\n";

async fn daemon() -> (PrivateBus, Daemon) {
    start_loopback(CONFIG).await
}

/// SIGTERM, then: a zero exit, and nothing the daemon served kept its engine.
async fn stops_cleanly(d: &mut Daemon) {
    d.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(d.wait().await.success(), "{}", d.stderr());
    let log = d.stderr();
    assert!(
        log.contains("stopped") && !log.contains("still hold"),
        "{log}"
    );
}

fn session_of(sessions: &Value, uid: u32) -> &Value {
    sessions
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["uid"] == uid)
        .unwrap_or_else(|| panic!("no session of uid {uid}: {sessions}"))
}

/// Everything a bus client does works on a direct connection, as the same user under the
/// same quota: sessions, regions and their memory, keys shared with a bus client, queue
/// pairs and their rings. The operator sees the session as the user's, on a connection
/// named after the bus connection it came from.
#[tokio::test]
async fn a_direct_connection_serves_the_callers_objects_under_its_quota() {
    let (bus, mut d) = daemon().await;
    let mut alice = Client::start_direct(&bus, Some(NOBODY));
    let mut bob = Client::start(&bus, Some(OTHER));
    let session = alice.ok("open");
    bob.ok("open");
    alice.ok("alloc cold 100");
    alice.ok("write 0 10 direct");
    assert_eq!(alice.ok("read 0 10 6"), "direct");
    alice.ok("alloc cold 4096");
    let refused = alice.err("alloc cold 4096", "org.rdmad1.Error.QuotaExceeded");
    assert!(
        refused.contains("regions of user nobody (uid 65534): 2 in use"),
        "{refused}"
    );

    // A key made on the direct connection attaches on the bus, and the bytes are shared.
    let key = alice.ok("share 0 ro");
    bob.ok(&format!("attach {}", key[0].as_str().unwrap()));
    assert_eq!(bob.ok("read 0 10 6"), "direct");

    // The operator's view, from the bus.
    let sessions: Value =
        serde_json::from_str(&rdmactl_ok(&bus, None, &["-j", "session"])).unwrap();
    let theirs = session_of(&sessions, NOBODY);
    assert_eq!(
        theirs["session"],
        session
            .as_str()
            .unwrap()
            .rsplit('/')
            .next()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    );
    assert_eq!(theirs["regions"], 2);
    let listed = alice.ok("sessions");
    let own = session_of(&listed, NOBODY);
    let name = own["bus_name"].as_str().unwrap();
    assert!(
        name.starts_with(':') && name.contains("/direct"),
        "a direct connection's name says where it came from: {name}"
    );
    assert_eq!(
        listed.as_array().unwrap().len(),
        1,
        "the user sees only its own sessions: {listed}"
    );

    // Queue pairs: two of alice's, connected to each other, exchange SENDs through their
    // rings.
    let dev = alice.ok("devices")[0]["name"].as_str().unwrap().to_owned();
    alice.ok(&format!("qp {dev} 16"));
    alice.ok(&format!("qp {dev} 16"));
    let (a, b) = (alice.ok("endpoint 0"), alice.ok("endpoint 1"));
    alice.ok(&format!("connect 0 {b}"));
    alice.ok(&format!("connect 1 {a}"));
    let rtt = alice.ok("rtt 0 1 0 100");
    assert_eq!(rtt["count"], 100, "{rtt}");

    // A queue pair on the bus too, so that the stop below withdraws both kinds.
    bob.ok(&format!("qp {dev} 16"));

    // OpenDirect belongs on the bus.
    let again = alice.err("open-direct-on-direct", "org.rdmad1.Error.InvalidArgument");
    assert!(again.contains("called on the bus"), "{again}");

    // The daemon stops cleanly with the direct connection open: nothing it served keeps
    // the engine.
    stops_cleanly(&mut d).await;
}

/// A direct connection that closes (its process killed) closes its sessions and releases
/// everything in them, as a bus connection that leaves the bus does; its bus connection
/// going away does not close it.
#[tokio::test]
async fn closing_a_direct_connection_releases_its_sessions() {
    let (bus, d) = daemon().await;
    let baseline = object_counts(&bus).await;
    let mut alice = Client::start_direct(&bus, Some(NOBODY));
    alice.ok("open");
    alice.ok("alloc cold 65536");
    let during = object_counts(&bus).await;
    assert_eq!(during["sessions"], baseline["sessions"] + 1);
    assert_eq!(during["mrs"], baseline["mrs"] + 1);

    alice.kill();
    d.wait_for_log("direct connection closed", 1).await;
    let after = object_counts(&bus).await;
    for kind in ["sessions", "regions", "mrs", "qps"] {
        assert_eq!(
            after[kind], baseline[kind],
            "{kind}: {after:?} vs {baseline:?}"
        );
    }
}

/// An administrator on the bus closes a session made on a direct connection: its objects
/// are withdrawn from that connection (the owner's next call finds no object), and the
/// owner's connection keeps working.
#[tokio::test]
async fn an_administrator_closes_a_direct_session_from_the_bus() {
    let (bus, _d) = daemon().await;
    let mut owner = Client::start_direct(&bus, Some(NOBODY));
    let mut admin = Client::start(&bus, None);
    let session = owner.ok("open");
    let region = owner.ok("alloc cold 4096");
    let served = owner.ok("objects");
    assert!(
        served.as_array().unwrap().contains(&region[0]),
        "the region is served on the direct connection: {served}"
    );
    admin.ok(&format!("close-session {}", session.as_str().unwrap()));
    owner.err("info 0", "org.freedesktop.DBus.Error.UnknownObject");
    let served = owner.ok("objects");
    assert!(
        !served.as_array().unwrap().contains(&region[0])
            && !served.as_array().unwrap().contains(&session),
        "withdrawn: {served}"
    );
    owner.ok("open");
    owner.ok("alloc cold 4096");
}

/// A tenant that opens direct connections without end is stopped at the per-user limit
/// with an error naming it; another user still opens one and works, and when the tenant
/// drops its connections the daemon holds none of them.
#[tokio::test]
async fn one_user_cannot_exhaust_direct_connections() {
    let (bus, d) = daemon().await;
    let mut hog = Client::start(&bus, Some(NOBODY));
    let flood = hog.ok("directs 100");
    assert_eq!(flood["opened"], 64, "{flood}");
    assert_eq!(
        flood["then"]["error"], "org.rdmad1.Error.QuotaExceeded",
        "{flood}"
    );
    let message = flood["then"]["message"].as_str().unwrap();
    assert!(
        message.contains("user 65534 holds 64 direct connections, the most one user may hold"),
        "{message}"
    );

    let mut neighbour = Client::start_direct(&bus, Some(OTHER));
    neighbour.ok("open");
    neighbour.ok("alloc cold 4096");

    hog.ok("drop-directs");
    d.wait_for_log("direct connection closed", 64).await;
    let again = hog.ok("directs 1");
    assert_eq!(again["opened"], 1, "{again}");
}

/// A peer writes the headers of a direct connection: a sender it makes up changes nothing.
/// Naming an administrator's bus connection gets it neither the administrator's view nor
/// the administrator's rights; naming a connection rdmad never saw sends rdmad asking the
/// peer for credentials nowhere.
#[tokio::test]
async fn a_made_up_sender_on_a_direct_connection_is_ignored() {
    let (bus, _d) = daemon().await;
    let mut admin = Client::start(&bus, None);
    admin.ok("open");
    let admin_name = admin.ok("whoami");
    let admin_name = admin_name.as_str().unwrap();
    let mut hog = Client::start_direct(&bus, Some(NOBODY));
    hog.ok("open");
    assert_eq!(
        hog.ok(&format!("forged {admin_name} ListSessions")),
        serde_json::json!([NOBODY]),
        "the caller's own sessions only"
    );
    let refused = hog.err(
        &format!("forged {admin_name} Reload"),
        "org.rdmad1.Error.NotAuthorized",
    );
    assert!(
        refused.contains("Reload needs administrator rights"),
        "{refused}"
    );
    assert_eq!(
        hog.ok("forged :1.99999 ListSessions"),
        serde_json::json!([NOBODY])
    );
    // The administrator is still what it was.
    assert_eq!(admin.ok("sessions").as_array().unwrap().len(), 2);
}

/// A peer that sends calls on a direct connection and never reads the replies is read no
/// further once its calls awaiting replies reach their bound: its own writes stop, the
/// daemon holds a bounded backlog, another user's calls go on, and the daemon still stops
/// cleanly with it connected.
#[tokio::test]
async fn a_peer_that_never_reads_its_replies_is_not_read_either() {
    let (bus, mut d) = daemon().await;
    let mut hog = Client::start(&bus, Some(NOBODY));
    let written = hog.ok("flood-direct 200000").as_u64().unwrap();
    println!("{written} calls written before rdmad stopped reading");
    assert!(
        written < 20_000,
        "rdmad kept reading calls whose replies were never read: {written} written"
    );
    let mut neighbour = Client::start_direct(&bus, Some(OTHER));
    neighbour.ok("open");
    neighbour.ok("alloc cold 4096");
    rdmactl_ok(&bus, None, &["status"]);

    stops_cleanly(&mut d).await;
}

/// Calls that would escape a direct connection's bounds close it: one that asks for no
/// reply (it would run uncounted), one whose header announces a 100 MiB message (rdmad
/// would have to make room for it before reading a byte of it), and one that comes a byte
/// at a time, each byte with 253 descriptors (rdmad would hold every one until the message
/// is whole: a few thousand bytes would fill its descriptor table). The neighbour's calls
/// go on, and the daemon holds no more descriptors than before.
#[tokio::test]
async fn calls_that_would_escape_the_bounds_close_the_direct_connection() {
    let (bus, mut d) = daemon().await;
    let mut hog = Client::start(&bus, Some(NOBODY));
    let fds_before = std::fs::read_dir(format!("/proc/{}/fd", d.child.id().unwrap()))
        .unwrap()
        .count();
    assert_eq!(hog.ok("raw-direct noreply"), "closed");
    assert_eq!(hog.ok("raw-direct huge"), "closed");
    assert_eq!(hog.ok("raw-direct fds"), "closed");
    let fds_after = std::fs::read_dir(format!("/proc/{}/fd", d.child.id().unwrap()))
        .unwrap()
        .count();
    assert!(
        fds_after <= fds_before + 8,
        "the daemon's descriptors went from {fds_before} to {fds_after}"
    );
    let mut neighbour = Client::start_direct(&bus, Some(OTHER));
    neighbour.ok("open");
    neighbour.ok("alloc cold 4096");
    stops_cleanly(&mut d).await;
}
