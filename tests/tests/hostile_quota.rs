//! One tenant must never starve another of what a quota shares out: memory windows
//! (`exports`) and pool memory (`registered_bytes`).
//!
//! - A user who binds every export its quota allows is refused the next one with
//!   `QuotaExceeded` naming the limit, the use and the key, while another user still
//!   exports; the operator sees the use in `GetQuota` and `rdmactl quota -j`. A second
//!   export of one region through one QP is a window of its own, with its own rkey.
//! - Under the shipped configuration, a user who allocates until refused is refused by its
//!   quota, not by an exhausted pool, and another user still allocates.
//! - A quota one user could fill a whole pool with is logged as a warning at start and at
//!   reload.

use rdmad_tests::client::{named, Client};
use rdmad_tests::daemon::{rdmactl_ok, start_on, wait_for_sessions};
use rdmad_tests::{repo_root, NOBODY};
use serde_json::Value;

rdmad::on_both_providers!(async
    exports_past_the_quota_are_refused_and_another_user_still_exports
        / rxe_exports_past_the_quota_are_refused_and_another_user_still_exports,
    regions_freed_under_receives_still_count_until_the_receives_go
        / rxe_regions_freed_under_receives_still_count_until_the_receives_go,
);

/// A second unprivileged user, present on every Debian system (`daemon`).
const OTHER: u32 = 1;

/// `(used, limit, source)` of one quota line, from `GetQuota` or `rdmactl quota -j`.
fn use_of(entry: &Value) -> (u64, u64, String) {
    (
        entry["used"].as_u64().unwrap(),
        entry["limit"].as_u64().unwrap(),
        entry["source"].as_str().unwrap().to_owned(),
    )
}

/// The shipped `/etc/rdmad/rdmad.toml`.
fn shipped_config() -> String {
    std::fs::read_to_string(repo_root().join("config/rdmad.toml")).expect("config/rdmad.toml")
}

mod bodies {
    use super::*;

    const LIMIT: u64 = 3;

    pub async fn exports_past_the_quota_are_refused_and_another_user_still_exports(provider: &str) {
        let (bus, _d) = start_on(provider, &format!("[quota.default]\nexports = {LIMIT}\n")).await;
        let mut tenant = Client::start(&bus, Some(NOBODY));
        let mut other = Client::start(&bus, Some(OTHER));
        let mut admin = Client::start(&bus, None);
        let device = admin.ok("devices")[0]["name"].as_str().unwrap().to_owned();
        for c in [&mut tenant, &mut other] {
            c.ok("open");
            c.ok("alloc default 4096");
            c.ok(&format!("qp {device} 16 16"));
        }
        let (et, eo) = (tenant.ok("endpoint 0"), other.ok("endpoint 0"));
        tenant.ok(&format!("connect 0 {eo}"));
        other.ok(&format!("connect 0 {et}"));

        // The same region through the same QP, up to the limit: a window each.
        let exports: Vec<Value> = (0..LIMIT).map(|_| tenant.ok("export 0 0 rw")).collect();
        let rkeys: std::collections::BTreeSet<u64> =
            exports.iter().map(|e| e[1].as_u64().unwrap()).collect();
        let ids: std::collections::BTreeSet<u64> =
            exports.iter().map(|e| e[3].as_u64().unwrap()).collect();
        assert_eq!(rkeys.len() as u64, LIMIT, "an rkey per export: {exports:?}");
        assert_eq!(ids.len() as u64, LIMIT, "an id per export: {exports:?}");

        let refused = tenant.err("export 0 0 rw", "org.rdmad1.Error.QuotaExceeded");
        assert_eq!(
            refused,
            format!(
                "quota exceeded: exports (memory windows) of user nobody (uid {NOBODY}): \
                 {LIMIT} in use, 1 more requested, limit {LIMIT} (set by quota.default.exports); \
                 raise quota.user.nobody.exports to allow more"
            )
        );

        // Another user exports as if the first did not exist.
        let theirs = other.ok("export 0 0 rw");

        // The operator sees both users' use and where the limit comes from.
        let expected = |used| (used, LIMIT, "quota.default.exports".to_owned());
        let quota = admin.ok(&format!("quota {NOBODY}"));
        assert_eq!(use_of(named(&quota, "exports")), expected(LIMIT));
        let quota = admin.ok(&format!("quota {OTHER}"));
        assert_eq!(use_of(named(&quota, "exports")), expected(1));
        let json: Value =
            serde_json::from_str(&rdmactl_ok(&bus, None, &["-j", "quota", "nobody"])).unwrap();
        let line = json
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["quota"] == "exports")
            .unwrap_or_else(|| panic!("no exports in {json}"));
        assert_eq!(use_of(line), expected(LIMIT), "{json}");
        // And the tenant its own.
        let own = tenant.ok(&format!("quota {NOBODY}"));
        assert_eq!(use_of(named(&own, "exports")), expected(LIMIT));

        // Every window works on its own: releasing one leaves the others' rkeys working,
        // and gives one export back.
        let first = &exports[0];
        tenant.ok(&format!("unexport 0 {}", first[3]));
        let quota = admin.ok(&format!("quota {NOBODY}"));
        assert_eq!(use_of(named(&quota, "exports")), expected(LIMIT - 1));
        let second = &exports[1];
        other.ok(&format!("post 0 write 0 0 8 1 {} {}", second[0], second[1]));
        let done = other.ok("wait 0");
        assert_eq!(done["status"], "Success", "{done}");
        tenant.ok("export 0 0 rw");
        tenant.err("export 0 0 rw", "org.rdmad1.Error.QuotaExceeded");
        other.ok(&format!("post 0 write 0 0 8 2 {} {}", first[0], first[1]));
        let done = other.ok("wait 0");
        assert_eq!(done["status"], "RemoteAccessError", "{done}");

        // The tenant's session ends: its exports are given back, the other user's stay.
        tenant.kill();
        wait_for_sessions(&bus, 1).await;
        let quota = admin.ok(&format!("quota {NOBODY}"));
        assert_eq!(use_of(named(&quota, "exports")), expected(0));
        let quota = admin.ok(&format!("quota {OTHER}"));
        assert_eq!(use_of(named(&quota, "exports")), expected(1));
        other.ok(&format!("unexport 0 {}", theirs[3]));
    }

    /// A user who posts receives into its regions on a QP no message will ever come to, and
    /// frees the regions, still holds their memory: the receives pin it. It counts against
    /// the user's quota until the receives go (with their QP), so freeing and allocating
    /// again cannot take the user past its quota; another user allocates as before, and
    /// the operator sees the use.
    pub async fn regions_freed_under_receives_still_count_until_the_receives_go(provider: &str) {
        const REGIONS: u64 = 3;
        let (bus, _d) =
            start_on(provider, &format!("[quota.default]\nregions = {REGIONS}\n")).await;
        let mut tenant = Client::start(&bus, Some(NOBODY));
        let mut other = Client::start(&bus, Some(OTHER));
        let mut admin = Client::start(&bus, None);
        let device = admin.ok("devices")[0]["name"].as_str().unwrap().to_owned();
        tenant.ok("open");
        other.ok("open");
        for _ in 0..REGIONS {
            tenant.ok("alloc default 4096");
        }
        for _ in 0..2 {
            tenant.ok(&format!("qp {device} 16 16"));
        }
        let (e0, e1) = (tenant.ok("endpoint 0"), tenant.ok("endpoint 1"));
        tenant.ok(&format!("connect 0 {e1}"));
        tenant.ok(&format!("connect 1 {e0}"));
        for r in 0..REGIONS {
            tenant.ok(&format!("post 0 recv {r} 0 64 {r}"));
        }
        for r in 0..REGIONS {
            tenant.ok(&format!("free {r}"));
        }
        let regions_used =
            |admin: &mut Client| use_of(named(&admin.ok(&format!("quota {NOBODY}")), "regions")).0;
        assert_eq!(regions_used(&mut admin), REGIONS, "the receives hold them");
        let refused = tenant.err("alloc default 4096", "org.rdmad1.Error.QuotaExceeded");
        assert!(
            refused.contains(&format!(
                "{REGIONS} in use, 1 more requested, limit {REGIONS}"
            )),
            "{refused}"
        );
        other.ok("alloc default 4096");

        // The QP goes, and its receives with it: the memory is given back.
        tenant.ok("destroy 0");
        assert_eq!(regions_used(&mut admin), 0);
        for _ in 0..REGIONS {
            tenant.ok("alloc default 4096");
        }

        // The same when the tenant dies with receives posted into freed regions.
        tenant.ok(&format!("post 1 recv {REGIONS} 0 64 9"));
        tenant.ok(&format!("free {REGIONS}"));
        assert_eq!(regions_used(&mut admin), REGIONS);
        tenant.kill();
        wait_for_sessions(&bus, 1).await;
        assert_eq!(regions_used(&mut admin), 0);
    }
}

/// With the shipped configuration (one pool, the built-in quotas), a user who allocates
/// the largest regions until refused is refused by `registered_bytes`, not by the pool;
/// another user still allocates, and the pool still has room. On loopback only: it maps
/// a quarter of a GiB.
#[tokio::test(flavor = "multi_thread")]
async fn under_the_shipped_config_one_user_cannot_exhaust_the_pool() {
    let (bus, daemon) = start_on("loopback", &shipped_config()).await;
    let log = daemon.wait_for_log("ready:", 1).await;
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains(" WARN ")).collect();
    assert!(
        warnings.is_empty(),
        "the shipped configuration warns: {warnings:?}"
    );

    let mut greedy = Client::start(&bus, Some(NOBODY));
    greedy.ok("open");
    let largest = greedy.ok("pools")[0]["size_classes"]
        .as_array()
        .and_then(|classes| classes.last()?.as_u64())
        .expect("the pool's size classes");
    let mut granted = 0u64;
    let refusal = loop {
        let answer = greedy.call(&format!("alloc default {largest}"));
        if answer.get("ok").is_none() {
            break answer;
        }
        granted += 1;
        assert!(granted < 1024, "never refused");
    };
    assert_eq!(
        refusal["error"], "org.rdmad1.Error.QuotaExceeded",
        "{refusal}"
    );
    let quota = greedy.ok(&format!("quota {NOBODY}"));
    let (used, limit, source) = use_of(named(&quota, "registered_bytes"));
    assert_eq!(used, granted * largest);
    assert!(used <= limit && used + largest > limit, "{quota}");
    assert_eq!(source, "the built-in default");
    let message = refusal["message"].as_str().unwrap();
    assert!(
        message.contains(&format!(
            "registered bytes of user nobody (uid {NOBODY}): {used} in use, {largest} more \
             requested, limit {limit} (set by the built-in default)"
        )),
        "{message}"
    );

    let pool = &greedy.ok("pools")[0];
    assert!(
        pool["capacity"].as_u64().unwrap() - pool["used"].as_u64().unwrap() >= largest,
        "one user left room in the pool: {pool}"
    );
    let mut next = Client::start(&bus, Some(OTHER));
    next.ok("open");
    let small = next.ok("alloc default 4096");
    assert_eq!(small[1], 4096);
    next.ok(&format!("alloc default {largest}"));
}

/// A `registered_bytes` quota that is not below the capacity of any pool its users may
/// use is logged at warn level, naming the table, the key, the value and the pools'
/// capacities: at start, and at every reload that still has one; a reload without one
/// logs none.
#[tokio::test(flavor = "multi_thread")]
async fn a_quota_larger_than_every_pool_is_warned_of_at_start_and_at_reload() {
    const POOLS: &str = "[[pool]]\nname = \"small\"\ncapacity = \"64MiB\"\n\
                         size_classes = [\"4KiB\"]\n\n\
                         [[pool]]\nname = \"big\"\ncapacity = \"256MiB\"\n\
                         size_classes = [\"4KiB\"]\n\n";
    let (bus, daemon) = start_on(
        "loopback",
        &format!("{POOLS}[quota.default]\nregistered_bytes = \"1GiB\"\n"),
    )
    .await;
    let log = daemon.wait_for_log("ready:", 1).await;
    let warnings = |log: &str| -> Vec<String> {
        log.lines()
            .filter(|l| l.contains(" WARN "))
            .map(str::to_owned)
            .collect()
    };
    let at_start = warnings(&log);
    assert_eq!(at_start.len(), 1, "{at_start:?}");
    assert!(
        at_start[0].contains(
            "quota.default.registered_bytes = 1GiB is not below the capacity of any pool it \
             applies to (small: 64MiB, big: 256MiB)"
        ),
        "{}",
        at_start[0]
    );

    // A reload that makes one user's own table too large, the default now fine.
    let mut admin = Client::start(&bus, None);
    daemon.write_config(&format!(
        "{POOLS}[quota.default]\nregistered_bytes = \"32MiB\"\n\
         [quota.user.nobody]\nregistered_bytes = \"256MiB\"\n"
    ));
    admin.ok("reload");
    let log = daemon.wait_for_log("configuration reloaded", 1).await;
    let now = warnings(&log);
    assert_eq!(now.len(), 2, "{now:?}");
    assert!(
        now[1].contains(
            "quota.user.nobody.registered_bytes = 256MiB is not below the capacity of any \
             pool it applies to (small: 64MiB, big: 256MiB)"
        ),
        "{}",
        now[1]
    );

    // A reload with quotas below the pools: no warning.
    daemon.write_config(&format!(
        "{POOLS}[quota.default]\nregistered_bytes = \"32MiB\"\n\
         [quota.user.nobody]\nregistered_bytes = \"128MiB\"\n"
    ));
    admin.ok("reload");
    let log = daemon.wait_for_log("configuration reloaded", 2).await;
    assert_eq!(warnings(&log), now, "no new warning");
}
