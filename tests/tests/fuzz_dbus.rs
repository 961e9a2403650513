//! Fuzzing the D-Bus surface: several `rdmad-fuzz-dbus` processes (root and `nobody`, on
//! the bus and on direct connections) call every method of every interface with random
//! well- and ill-typed arguments while a
//! well-behaved client of a third user keeps doing real work. The daemon must answer every
//! call with a method return or a documented error, never panic, keep serving the
//! well-behaved client, and be back to its starting state once the fuzzers are gone.
//!
//! `RDMAD_FUZZ_CALLS` (calls per fuzzer process) and `RDMAD_FUZZ_SEED` (the seed the
//! fuzzers' seeds derive from; the time when unset) make a longer or a repeated run:
//! `scripts/fuzz-dbus` runs this test with many calls in a release build.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmad_client::proxy::ManagerProxy;
use rdmad_tests::client::Client;
use rdmad_tests::daemon::{as_user, object_counts, start_loopback, wait_for_sessions};
use rdmad_tests::{binary, NOBODY, TIMEOUT};
use serde_json::Value;

/// Calls per fuzzer process when `RDMAD_FUZZ_CALLS` is unset: with the six fuzzers below
/// the whole test takes about 10 s in a debug build on 2 CPUs (about 3000 calls/s in all),
/// well under 30 s with other tests running beside it.
const DEFAULT_CALLS: u64 = 5000;

/// The fuzzer processes: `None` runs as root (an administrator), `Some(uid)` as that user;
/// `true`: its calls go on direct connections (`--direct`), not through the bus daemon.
const FUZZERS: [(Option<u32>, bool); 6] = [
    (None, false),
    (Some(NOBODY), false),
    (None, false),
    (Some(NOBODY), false),
    (None, true),
    (Some(BIN), true),
];

/// The direct connections' unprivileged fuzzer's user (`bin`, uid 2 on Debian): a user of
/// its own, so that the bus fuzzers of `nobody` keep their quota to themselves.
const BIN: u32 = 2;

/// The well-behaved client's user (`daemon`); the fuzzers running as root never close its
/// sessions (`--spare-uid`), everything else they may do.
const WITNESS: u32 = 1;

/// The well-behaved client starts a fresh process after this many rounds (it keeps every
/// descriptor it was given).
const WITNESS_ROUNDS_PER_PROCESS: u64 = 200;

/// How much the daemon's resident set may grow over the run. Measured (VmRSS after the
/// fuzzers are gone, against before): +6 to +22 MiB after the default run in a debug build,
/// +35 MiB after 2 million calls in a release build, and on one release daemon fuzzed in
/// rounds of 400,000 calls: 8, 32, 35, 46, 49, 50, 51, 46, 52, 52, 53 MiB — the allocator
/// keeping freed memory (megabyte messages, a thread pool), levelling off, not growing
/// with the calls. Every object the fuzzers make is checked by count as well.
const RSS_GROWTH_BOUND_KIB: u64 = 64 * 1024;

/// Small pools and quotas, so the fuzzers run into every limit; the witness has its own
/// pool. No warm regions: the provider's object counts are exact at every moment.
const CONFIG: &str = r#"
[daemon]
log_level = "warn"

[[pool]]
name = "fuzz"
capacity = "12MiB"
size_classes = ["4KiB", "64KiB", "1MiB"]

[[pool]]
name = "fine"
capacity = "2MiB"
granularity = "4KiB"

[[pool]]
name = "witness"
capacity = "1MiB"
size_classes = ["4KiB"]
users = ["daemon"]

[quota.default]
sessions = 6
regions = 24
registered_bytes = "6MiB"
keys = 24
qps = 6

# Three fuzzers run as root (two on the bus, one on direct connections).
[quota.user.root]
sessions = 9
regions = 36
registered_bytes = "9MiB"
keys = 36
qps = 9
"#;

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a number")),
    )
}

/// `VmRSS` of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read /proc/PID/fd")
        .count()
}

/// One well-behaved round: a session, a region from the witness pool, a write and a read
/// through the mapping, free, close. Every step must succeed.
fn witness_round(client: &mut Client, index: u64, round: u64) {
    client.ok("open");
    let region = client.ok("alloc witness 4096");
    assert_eq!(region[1], 4096, "round {round}: {region}");
    let text = format!("witness-round-{round}");
    client.ok(&format!("write {index} 0 {text}"));
    assert_eq!(
        client.ok(&format!("read {index} 0 {}", text.len())),
        text.as_str(),
        "round {round}"
    );
    client.ok(&format!("free {index}"));
    client.ok("close");
}

#[derive(Default)]
struct Totals {
    calls: u64,
    ok: u64,
    methods: BTreeMap<String, (u64, u64, BTreeMap<String, u64>)>,
}

impl Totals {
    fn add(&mut self, summary: &Value) {
        self.calls += summary["calls"].as_u64().unwrap_or(0);
        self.ok += summary["ok"].as_u64().unwrap_or(0);
        for (label, s) in summary["methods"].as_object().into_iter().flatten() {
            let entry = self.methods.entry(label.clone()).or_default();
            entry.0 += s["calls"].as_u64().unwrap_or(0);
            entry.1 += s["ok"].as_u64().unwrap_or(0);
            for (name, n) in s["errors"].as_object().into_iter().flatten() {
                *entry.2.entry(name.clone()).or_default() += n.as_u64().unwrap_or(0);
            }
        }
    }

    fn ok_of(&self, label: &str) -> u64 {
        self.methods.get(label).map_or(0, |m| m.1)
    }

    fn print(&self, seconds: f64) {
        println!(
            "{:<52} {:>8} {:>8}  errors",
            "method (all fuzzers)", "calls", "ok"
        );
        for (label, (calls, ok, errors)) in &self.methods {
            let errors: Vec<String> = errors
                .iter()
                .map(|(name, n)| format!("{} {n}", rdmad_tests::short_error_name(name)))
                .collect();
            println!("{label:<52} {calls:>8} {ok:>8}  {}", errors.join(", "));
        }
        println!(
            "total: {} calls ({} succeeded) in {seconds:.1} s: {:.0} calls/s",
            self.calls,
            self.ok,
            self.calls as f64 / seconds.max(1e-9)
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn fuzzed_calls_never_break_the_daemon() {
    let calls = env_u64("RDMAD_FUZZ_CALLS").unwrap_or(DEFAULT_CALLS);
    let seed = env_u64("RDMAD_FUZZ_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_micros() as u64
    });
    println!(
        "fuzz_dbus: RDMAD_FUZZ_SEED={seed} RDMAD_FUZZ_CALLS={calls} ({} fuzzers)",
        FUZZERS.len()
    );

    let (bus, mut daemon) = start_loopback(CONFIG).await;
    let bus = Arc::new(bus);
    let pid = daemon.child.id().expect("rdmad is running");
    let connection = bus.connect().await;
    let manager = ManagerProxy::new(&connection).await.expect("manager proxy");
    let baseline = object_counts(&bus).await;
    let pools_before = manager.list_pools().await.expect("ListPools");
    let (rss_before, fds_before) = (rss_kib(pid), open_fds(pid));

    // The well-behaved client, on a thread of its own (it talks to a process in lock step).
    let stop = Arc::new(AtomicBool::new(false));
    let witness = {
        let (bus, stop) = (Arc::clone(&bus), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut client = Client::start(&bus, Some(WITNESS));
            let mut round = 0u64;
            while round == 0 || !stop.load(Ordering::Relaxed) {
                let index = round % WITNESS_ROUNDS_PER_PROCESS;
                if index == 0 && round > 0 {
                    client = Client::start(&bus, Some(WITNESS));
                }
                witness_round(&mut client, index, round);
                round += 1;
            }
            round
        })
    };

    let started = Instant::now();
    let mut fuzzers = Vec::new();
    for (i, (uid, direct)) in FUZZERS.iter().enumerate() {
        let mut command = tokio::process::Command::from(as_user(*uid, &binary("rdmad-fuzz-dbus")));
        if *direct {
            command.arg("--direct");
        }
        command
            .args(["--bus", &bus.address])
            .args(["--seed", &seed.wrapping_add(i as u64).to_string()])
            .args(["--calls", &calls.to_string()])
            .args(["--spare-uid", &WITNESS.to_string()])
            .args(["--quiet", "--summary"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        fuzzers.push((*uid, command.spawn().expect("spawn rdmad-fuzz-dbus")));
    }
    // Generous: the fuzzer fails by itself when a call gets no reply within a minute.
    let deadline = TIMEOUT + Duration::from_millis(20) * u32::try_from(calls).unwrap_or(u32::MAX);
    let mut totals = Totals::default();
    let mut failed = Vec::new();
    for (uid, child) in fuzzers {
        let output = tokio::time::timeout(deadline, child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("a fuzzer (uid {uid:?}) did not finish within {deadline:?}"))
            .expect("wait for rdmad-fuzz-dbus");
        let stdout = String::from_utf8_lossy(&output.stdout);
        for line in stdout.lines().filter(|l| !l.starts_with("summary ")) {
            println!("[fuzzer uid {uid:?}] {line}");
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !stderr.trim().is_empty() {
            println!("[fuzzer uid {uid:?} stderr] {stderr}");
        }
        if let Some(summary) = stdout.lines().find_map(|l| l.strip_prefix("summary ")) {
            totals.add(&serde_json::from_str(summary).expect("summary JSON"));
        }
        if !output.status.success() {
            failed.push(format!("uid {uid:?}: {}", output.status));
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let rounds = tokio::time::timeout(TIMEOUT, tokio::task::spawn_blocking(move || witness.join()))
        .await
        .unwrap_or_else(|_| panic!("the well-behaved client did not finish within {TIMEOUT:?}"))
        .expect("join the witness")
        .unwrap_or_else(|_| panic!("the well-behaved client failed (seed {seed}); see above"));
    totals.print(seconds);
    println!("fuzz_dbus: the well-behaved client did {rounds} rounds meanwhile");
    // Still alive, never panicked.
    assert!(
        daemon.child.try_wait().expect("try_wait").is_none(),
        "rdmad exited:\n{}",
        daemon.stderr()
    );
    assert!(
        !daemon.stderr().contains("panicked"),
        "rdmad panicked (RDMAD_FUZZ_SEED={seed}):\n{}",
        daemon.stderr()
    );
    // Everything the fuzzers and the witness made is gone once their connections are.
    let after = wait_for_sessions(&bus, 0).await;
    let (rss_after, fds_after) = (rss_kib(pid), open_fds(pid));
    println!(
        "fuzz_dbus: rdmad VmRSS {rss_before} KiB before, {rss_after} KiB after (bound \
         +{RSS_GROWTH_BOUND_KIB} KiB); {fds_before} descriptors before, {fds_after} after"
    );
    assert_eq!(
        after, baseline,
        "object counts after the run (left) differ from before (right)"
    );
    let pools_after = manager.list_pools().await.expect("ListPools");
    for (before, after) in pools_before.iter().zip(&pools_after) {
        assert_eq!(
            (after.name.as_str(), after.used, after.regions, after.free),
            (
                before.name.as_str(),
                before.used,
                before.regions,
                before.free
            ),
            "pool usage after the run"
        );
    }
    let sessions = manager.list_sessions().await.expect("ListSessions");
    assert!(sessions.is_empty(), "sessions left: {sessions:?}");
    // Nor is any of their D-Bus objects still served.
    let stale = stale_objects(&connection).await;
    assert!(
        stale.is_empty(),
        "objects still served after their owners left (RDMAD_FUZZ_SEED={seed}): {stale:?}"
    );
    assert_eq!(
        fds_after, fds_before,
        "rdmad's open descriptors: {fds_before} before, {fds_after} after"
    );
    assert!(
        rss_after <= rss_before + RSS_GROWTH_BOUND_KIB,
        "rdmad grew from {rss_before} KiB to {rss_after} KiB"
    );

    // It logs at warn level (CONFIG) only what should not happen: a window left bound to a
    // destroyed QP (rxe would hang), an object it could not withdraw, a failed teardown.
    let complaints: Vec<String> = daemon
        .stderr()
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .map(str::to_owned)
        .collect();
    assert!(
        complaints.is_empty(),
        "rdmad complained (RDMAD_FUZZ_SEED={seed}):\n{}",
        complaints.join("\n")
    );

    // Every reply was a method return or a documented error (see the FINDING and FAILURE
    // lines above otherwise). Checked after the daemon's state, so that a failed run still
    // says whether anything leaked.
    assert!(
        failed.is_empty(),
        "fuzzers failed (RDMAD_FUZZ_SEED={seed} RDMAD_FUZZ_CALLS={calls}): {failed:?}"
    );

    // The fuzzers got deep: real objects were made and used, not just refused.
    if calls >= DEFAULT_CALLS {
        for label in [
            "org.rdmad1.Manager.OpenSession",
            "org.rdmad1.Session.AllocateRegion",
            "org.rdmad1.Region.Share",
            "org.rdmad1.Session.AttachRegion",
            "org.rdmad1.Region.Free",
            "org.rdmad1.Session.Close",
            "org.rdmad1.Region.RevokeKey",
            "org.rdmad1.Session.CreateQueuePair",
            "org.rdmad1.QueuePair.Endpoint",
            "org.rdmad1.QueuePair.Connect",
            "org.rdmad1.Region.ExportRemote",
            "org.rdmad1.QueuePair.Destroy",
        ] {
            assert!(totals.ok_of(label) > 0, "no call of {label} succeeded");
        }
        assert_every_method_called(&totals);
    }
}

/// Every method of every interface was called (the fuzzers find them by introspection;
/// this is the API of docs/dbus-api.md).
fn assert_every_method_called(totals: &Totals) {
    let api = [
        (
            "org.rdmad1.Manager",
            &[
                "ListDevices",
                "GetDevice",
                "Reload",
                "OpenSession",
                "OpenDirect",
                "ListSessions",
                "ListRegions",
                "ListQueuePairs",
                "ListPools",
                "GetQuota",
                "RevokeKey",
            ][..],
        ),
        (
            "org.rdmad1.Session",
            &[
                "Close",
                "AllocateRegion",
                "AttachRegion",
                "CreateQueuePair",
                "GetInfo",
            ],
        ),
        (
            "org.rdmad1.Region",
            &[
                "Free",
                "Share",
                "ExportRemote",
                "ReleaseExport",
                "Register",
                "Deregister",
                "RevokeKey",
                "Detach",
                "GetInfo",
            ],
        ),
        (
            "org.rdmad1.QueuePair",
            &[
                "Endpoint", "Connect", "Ready", "Flush", "Destroy", "GetInfo",
            ],
        ),
        ("org.freedesktop.DBus.Properties", &["Get", "Set", "GetAll"]),
        ("org.freedesktop.DBus.Introspectable", &["Introspect"]),
        ("org.freedesktop.DBus.ObjectManager", &["GetManagedObjects"]),
    ];
    let uncalled: Vec<String> = api
        .iter()
        .flat_map(|(iface, methods)| methods.iter().map(move |m| format!("{iface}.{m}")))
        .filter(|label| !totals.methods.contains_key(label))
        .collect();
    assert!(uncalled.is_empty(), "never called: {uncalled:?}");
}

/// Regions and queue pairs made while their session is being closed (on the same
/// connection, concurrently) are never left served without their engine objects, nor their
/// queue pairs kept alive by the data-path worker. Found by the fuzzers; the fixes are in
/// `Context::publish_region`/`publish_qp` (daemon/src/dbus/context.rs) and
/// `Engine::create_qp` (daemon/src/engine/mod.rs).
#[tokio::test(flavor = "multi_thread")]
async fn objects_made_while_their_session_closes_are_not_left_served() {
    use futures_util::future::{join3, join_all};
    use rdmad_client::proxy::SessionProxy;
    let (bus, _daemon) = start_loopback(CONFIG).await;
    let connection = bus.connect().await;
    let manager = ManagerProxy::new(&connection).await.expect("manager proxy");
    let baseline = object_counts(&bus).await;
    for _ in 0..100 {
        let session = manager
            .open_session(Default::default())
            .await
            .expect("OpenSession");
        let proxy = SessionProxy::builder(&connection)
            .path(session)
            .expect("path")
            .build()
            .await
            .expect("session proxy");
        let regions = (0..3).map(|_| proxy.allocate_region("fuzz", 4096, Default::default()));
        let qps = (0..2).map(|_| proxy.create_queue_pair("loopback0", Default::default()));
        let _ = join3(join_all(regions), join_all(qps), proxy.close()).await;
    }
    assert_eq!(object_counts(&bus).await, baseline);
    let stale = stale_objects(&connection).await;
    assert!(
        stale.is_empty(),
        "served without an engine object: {stale:?}"
    );
}

/// Session, region and queue-pair objects still served (`GetManagedObjects`), with their
/// interfaces.
async fn stale_objects(connection: &zbus::Connection) -> Vec<String> {
    let objects = rdmad_tests::daemon::object_manager(connection)
        .await
        .get_managed_objects()
        .await
        .expect("GetManagedObjects");
    objects
        .iter()
        .filter(|(path, interfaces)| {
            !interfaces.is_empty()
                && [
                    rdmad_client::names::SESSION_PATH_PREFIX,
                    rdmad_client::names::REGION_PATH_PREFIX,
                    rdmad_client::names::QP_PATH_PREFIX,
                ]
                .iter()
                .any(|prefix| path.as_str().starts_with(&format!("{prefix}/")))
        })
        .map(|(path, interfaces)| format!("{path} {:?}", interfaces.keys().collect::<Vec<_>>()))
        .collect()
}
