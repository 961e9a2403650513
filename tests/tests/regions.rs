//! Sessions, regions, access keys and quotas over D-Bus, with clients of several uids.
//! Every test runs twice from one body: on the loopback device, and as `rxe_*` on Soft-RoCE
//! in the VM tier (`--provider verbs`).

use futures_util::StreamExt;
use rdmad_client::proxy::ManagerProxy;
use rdmad_tests::client::{named, Client};
use rdmad_tests::daemon::{object_counts, start_on, start_with_env};
use rdmad_tests::NOBODY;
use serde_json::Value;

rdmad::on_both_providers!(async
    allocate_map_write_read_free / rxe_allocate_map_write_read_free,
    kept_descriptor_never_sees_the_next_owner / rxe_kept_descriptor_never_sees_the_next_owner,
    read_only_and_read_write_attachments / rxe_read_only_and_read_write_attachments,
    revoked_expired_and_freed_keys_stop_new_attaches
        / rxe_revoked_expired_and_freed_keys_stop_new_attaches,
    quota_refusal_names_limit_use_and_key / rxe_quota_refusal_names_limit_use_and_key,
    concurrent_requests_from_one_uid_never_overshoot
        / rxe_concurrent_requests_from_one_uid_never_overshoot,
    an_allocation_right_after_a_free_gets_its_room
        / rxe_an_allocation_right_after_a_free_gets_its_room,
    a_release_ending_while_an_allocation_is_refused_still_gives_its_room
        / rxe_a_release_ending_while_an_allocation_is_refused_still_gives_its_room,
    sigkill_releases_everything_within_a_second / rxe_sigkill_releases_everything_within_a_second,
    authorization_matrix / rxe_authorization_matrix,
    rdmactl_shows_and_controls_sessions_regions_and_keys
        / rxe_rdmactl_shows_and_controls_sessions_regions_and_keys,
);

mod bodies {
    use super::*;

    /// A second unprivileged user, present on every Debian system (`daemon`); the bus only
    /// accepts uids that have a passwd entry.
    const OTHER: u32 = 1;

    /// Pools without warm regions, so provider counts are exact at every moment.
    const COLD: &str = "[[pool]]\nname = \"cold\"\ncapacity = \"64MiB\"\n\
                    size_classes = [\"4KiB\", \"64KiB\", \"1MiB\"]\n";

    pub async fn allocate_map_write_read_free(provider: &str) {
        let (bus, _d) = start_on(provider, COLD).await;
        let mut alice = Client::start(&bus, Some(NOBODY));
        alice.ok("open");
        let region = alice.ok("alloc cold 100");
        assert_eq!(region[1], 4096, "rounded up to the size class");
        assert!(region[0]
            .as_str()
            .unwrap()
            .starts_with("/org/rdmad1/region/"));
        alice.ok("write 0 4000 hello");
        assert_eq!(alice.ok("read 0 4000 5"), "hello");
        let info = alice.ok("info 0");
        assert_eq!(
            (
                info["pool"].as_str(),
                info["size"].as_u64(),
                info["requested"].as_u64()
            ),
            (Some("cold"), Some(4096), Some(100))
        );
        let pools = alice.ok("pools");
        let cold = named(&pools, "cold");
        assert_eq!(
            (cold["used"].as_u64(), cold["regions"].as_u64()),
            (Some(4096), Some(1))
        );
        assert_eq!(object_counts(&bus).await["mrs"], 1);

        alice.ok("free 0");
        let gone = alice.err("info 0", "org.freedesktop.DBus.Error.UnknownObject");
        assert!(gone.contains("/org/rdmad1/region/"), "{gone}");
        assert_eq!(object_counts(&bus).await["mrs"], 0);
        // The client's mapping outlives the region, but not its pages: they went back at
        // the free, and the mapping reads zeros.
        assert_eq!(alice.ok("read 0 4000 5"), "\0".repeat(5));

        let big = alice.err("alloc cold 2000000", "org.rdmad1.Error.InvalidArgument");
        assert_eq!(
            big,
            "pool \"cold\" has no size for 2000000 bytes: the largest region it serves is 1MiB"
        );
        let unknown = alice.err("alloc nope 4096", "org.rdmad1.Error.NoSuchObject");
        assert_eq!(unknown, "pool \"nope\" (pools: cold) does not exist");
    }

    /// A freed region's fd, kept by its first owner, never shows the next owner's data (nor
    /// its own once the free's release is done: the pages went back), and every new region
    /// reads as zero.
    pub async fn kept_descriptor_never_sees_the_next_owner(provider: &str) {
        let (bus, _d) = start_on(provider, &format!("{COLD}[[pool]]\nname = \"warm\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\nwarm = 4\n")).await;
        let mut alice = Client::start(&bus, Some(NOBODY));
        let mut bob = Client::start(&bus, Some(OTHER));
        alice.ok("open");
        bob.ok("open");
        for pool in ["cold", "warm"] {
            alice.ok(&format!("alloc {pool} 4096"));
        }
        alice.ok("write 0 0 alice-secret-cold");
        alice.ok("write 1 0 alice-secret-warm");
        alice.ok("free 0");
        alice.ok("free 1");
        // Free answers before the release; once it is done (reading the quota waits for
        // it), the pages are gone. Before, the kept mappings may still show alice's own
        // bytes, never anyone else's.
        let quota = alice.ok("quota 65534");
        assert_eq!(named(&quota, "regions")["used"], 0, "{quota}");
        for n in 0..16 {
            let pool = if n % 2 == 0 { "cold" } else { "warm" };
            bob.ok(&format!("alloc {pool} 4096"));
            assert_eq!(
                bob.ok(&format!("read {n} 0 17")),
                "\0".repeat(17),
                "new regions read as zero"
            );
            bob.ok(&format!("write {n} 0 bob-data-{n:02}-xxxxx"));
            assert_eq!(alice.ok("read 0 0 17"), "\0".repeat(17));
            assert_eq!(alice.ok("read 1 0 17"), "\0".repeat(17));
        }
    }

    pub async fn read_only_and_read_write_attachments(provider: &str) {
        let (bus, _d) = start_on(provider, COLD).await;
        let mut owner = Client::start(&bus, Some(NOBODY));
        let mut reader = Client::start(&bus, Some(OTHER));
        owner.ok("open");
        reader.ok("open");
        owner.ok("alloc cold 4096");
        owner.ok("write 0 0 shared-bytes");

        let ro = owner.ok("share 0 ro");
        let token = ro[0].as_str().unwrap();
        assert!(token.starts_with("rdk1_") && token.len() == 69, "{token}");
        let attached = reader.ok(&format!("attach {token}"));
        assert_eq!(attached[2], "ro");
        assert_eq!(reader.ok("read 0 0 12"), "shared-bytes");
        let refused = reader.ok("maprw 0");
        assert!(
            refused["io_error"]
                .as_str()
                .unwrap()
                .contains("Permission denied"),
            "{refused}"
        );
        // Nor can the reader reopen its descriptor read-write through /proc.
        let reopened = reader.ok("reopenrw 0");
        assert!(
            reopened["io_error"]
                .as_str()
                .unwrap()
                .contains("Permission denied"),
            "{reopened}"
        );

        let rw = owner.ok("share 0 rw");
        let mut writer = Client::start(&bus, Some(OTHER));
        writer.ok("open");
        assert_eq!(
            writer.ok(&format!("attach {}", rw[0].as_str().unwrap()))[2],
            "rw"
        );
        writer.ok("write 0 0 WRITTEN");
        assert_eq!(owner.ok("read 0 0 7"), "WRITTEN");
        assert_eq!(reader.ok("read 0 0 7"), "WRITTEN");
        assert_eq!(owner.ok("info 0")["attachments"], 2);

        // Attaching again, or attaching one's own region, is refused.
        reader.err(
            &format!("attach {token}"),
            "org.rdmad1.Error.InvalidArgument",
        );
        owner.err(
            &format!("attach {token}"),
            "org.rdmad1.Error.InvalidArgument",
        );
        reader.err("attach rdk1_nonsense", "org.rdmad1.Error.InvalidArgument");
    }

    pub async fn revoked_expired_and_freed_keys_stop_new_attaches(provider: &str) {
        let (bus, _d) = start_on(provider, COLD).await;
        let mut owner = Client::start(&bus, Some(NOBODY));
        let mut other = Client::start(&bus, Some(OTHER));
        owner.ok("open");
        other.ok("open");
        owner.ok("alloc cold 4096");

        let revoked = owner.ok("share 0 ro");
        owner.ok(&format!("revoke 0 {}", revoked[1]));
        other.err(
            &format!("attach {}", revoked[0].as_str().unwrap()),
            "org.rdmad1.Error.NotAuthorized",
        );

        let expired = owner.ok("share 0 ro 0");
        other.err(
            &format!("attach {}", expired[0].as_str().unwrap()),
            "org.rdmad1.Error.NotAuthorized",
        );

        let live = owner.ok("share 0 rw 3600");
        let info = owner.ok("info 0");
        assert_eq!(info["keys"].as_array().unwrap().len(), 1, "{info}");
        assert!(info["keys"][0]["expires_usec"].as_u64().unwrap() > 0);
        other.ok(&format!("attach {}", live[0].as_str().unwrap()));
        // Freeing ends attachments and kills the key.
        owner.ok("free 0");
        let mut third = Client::start(&bus, Some(OTHER));
        third.ok("open");
        third.err(
            &format!("attach {}", live[0].as_str().unwrap()),
            "org.rdmad1.Error.NotAuthorized",
        );
        assert_eq!(object_counts(&bus).await["keys"], 0);
    }

    pub async fn quota_refusal_names_limit_use_and_key(provider: &str) {
        let (bus, _d) = start_on(
            provider,
            &format!("{COLD}[quota.default]\nregions = 2\nsessions = 1\n"),
        )
        .await;
        let mut alice = Client::start(&bus, Some(NOBODY));
        alice.ok("open");
        let second = alice.err("open", "org.rdmad1.Error.QuotaExceeded");
        assert!(second.contains("open sessions of user nobody (uid 65534): 1 in use, 1 more requested, limit 1 (set by quota.default.sessions)"), "{second}");
        alice.ok("alloc cold 4096");
        alice.ok("alloc cold 4096");
        let third = alice.err("alloc cold 4096", "org.rdmad1.Error.QuotaExceeded");
        assert_eq!(
        third,
        "quota exceeded: regions of user nobody (uid 65534): 2 in use, 1 more requested, limit 2 \
         (set by quota.default.regions); raise quota.user.nobody.regions to allow more"
    );
        let quota = alice.ok("quota 65534");
        let regions = named(&quota, "regions");
        assert_eq!(
            (regions["limit"].as_u64(), regions["used"].as_u64()),
            (Some(2), Some(2))
        );
        assert_eq!(regions["source"], "quota.default.regions");
    }

    /// `Free` answers before the region's memory is released, yet the room it frees is
    /// there for the next call: at a quota of one region, in a pool with room for one,
    /// touched 16 MiB regions (slow to release) are allocated and freed back to back, and
    /// every allocation succeeds. Afterwards the quota and the pool show one region.
    pub async fn an_allocation_right_after_a_free_gets_its_room(provider: &str) {
        let (bus, _d) = start_on(
            provider,
            "[[pool]]\nname = \"one\"\ncapacity = \"16MiB\"\nsize_classes = [\"16MiB\"]\n\
             [quota.default]\nregions = 1\nregistered_bytes = \"16MiB\"\n",
        )
        .await;
        let mut alice = Client::start(&bus, Some(NOBODY));
        alice.ok("open");
        let cycles = if provider == "verbs" { 6 } else { 20 };
        for n in 0..cycles {
            alice.ok(&format!("alloc one {}", 16 << 20));
            alice.ok(&format!("touch {n} 7"));
            alice.ok(&format!("free {n}"));
        }
        alice.ok(&format!("alloc one {}", 16 << 20));
        let quota = alice.ok("quota 65534");
        let used = |name: &str| named(&quota, name)["used"].as_u64();
        assert_eq!(
            (used("regions"), used("registered_bytes")),
            (Some(1), Some(16 << 20)),
            "{quota}"
        );
        let pools = alice.ok("pools");
        let one = &pools.as_array().unwrap()[0];
        assert_eq!(
            (one["used"].as_u64(), one["regions"].as_u64()),
            (Some(16 << 20), Some(1))
        );
    }

    /// The race behind the test above, made certain: the release of a freed region ends
    /// after the next allocation was refused for the room it holds, but before that
    /// allocation looks at the releases under way (`RDMAD_TEST_SLOW_RELEASE_MS`). The
    /// allocation still gets the room, and the quota then shows one region.
    pub async fn a_release_ending_while_an_allocation_is_refused_still_gives_its_room(
        provider: &str,
    ) {
        let (bus, d) = start_with_env(
            provider,
            &format!("{COLD}[quota.default]\nregions = 1\n"),
            vec![("RDMAD_TEST_SLOW_RELEASE_MS", "300".to_owned())],
        )
        .await;
        let mut alice = Client::start(&bus, Some(NOBODY));
        alice.ok("open");
        alice.ok("alloc cold 4096");
        alice.ok("free 0");
        alice.ok("alloc cold 4096");
        // The refusal happened, and the release ended during its wait.
        d.wait_for_log("test hook: a refused allocation waits", 1)
            .await;
        let quota = alice.ok("quota 65534");
        assert_eq!(
            named(&quota, "regions")["used"].as_u64(),
            Some(1),
            "{quota}"
        );
    }

    /// 64 requests racing for 10 regions: exactly 10 succeed.
    pub async fn concurrent_requests_from_one_uid_never_overshoot(provider: &str) {
        let (bus, _d) = start_on(provider, &format!("{COLD}[quota.default]\nregions = 10\n")).await;
        let connection = bus.connect().await;
        let manager = ManagerProxy::new(&connection).await.unwrap();
        let session = manager.open_session(Default::default()).await.unwrap();
        let proxy = rdmad_client::proxy::SessionProxy::builder(&connection)
            .path(session)
            .unwrap()
            .build()
            .await
            .unwrap();
        let calls = (0..64).map(|_| proxy.allocate_region("cold", 4096, Default::default()));
        let results = futures_util::future::join_all(calls).await;
        let ok = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(ok, 10);
        for r in results.iter().filter_map(|r| r.as_ref().err()) {
            assert!(matches!(r, rdmad_client::Error::QuotaExceeded(_)), "{r:?}");
        }
        assert_eq!(manager.n_regions().await.unwrap(), 10);
    }

    /// A client killed with SIGKILL loses everything within a second; counts return to the
    /// baseline.
    pub async fn sigkill_releases_everything_within_a_second(provider: &str) {
        let (bus, _d) = start_on(provider, COLD).await;
        let baseline = object_counts(&bus).await;
        let connection = bus.connect().await;
        let objects = rdmad_tests::daemon::object_manager(&connection).await;
        let mut removed = objects.receive_interfaces_removed().await.unwrap();

        let mut victim = Client::start(&bus, Some(NOBODY));
        let mut peer = Client::start(&bus, Some(OTHER));
        let session = victim.ok("open");
        peer.ok("open");
        victim.ok("alloc cold 4096");
        victim.ok("alloc cold 1048576");
        let key = victim.ok("share 0 rw");
        peer.ok(&format!("attach {}", key[0].as_str().unwrap()));
        assert_eq!(object_counts(&bus).await["mrs"], baseline["mrs"] + 2);

        victim.kill();
        let deadline = std::time::Duration::from_secs(1);
        let gone = tokio::time::timeout(deadline, async {
            while let Some(signal) = removed.next().await {
                if signal.args().unwrap().object_path().as_str() == session.as_str().unwrap() {
                    return;
                }
            }
        })
        .await;
        assert!(
            gone.is_ok(),
            "the session object was not removed within {deadline:?}"
        );
        let after = object_counts(&bus).await;
        for kind in ["regions", "keys", "mrs", "pds", "mws", "cqs", "qps"] {
            assert_eq!(
                after[kind], baseline[kind],
                "{kind}: {after:?} vs {baseline:?}"
            );
        }
        assert_eq!(
            after["sessions"],
            baseline["sessions"] + 1,
            "only the peer's session is left"
        );
        assert_eq!(peer.ok("sessions")[0]["attachments"], 0);
    }

    /// Every call on another user's objects is refused and changes nothing; administrators
    /// see and close everything.
    pub async fn authorization_matrix(provider: &str) {
        let (bus, _d) = start_on(provider, COLD).await;
        let mut owner = Client::start(&bus, Some(NOBODY));
        let mut intruder = Client::start(&bus, Some(OTHER));
        let mut same_user_elsewhere = Client::start(&bus, Some(NOBODY));
        let mut admin = Client::start(&bus, None);
        let session = owner.ok("open").as_str().unwrap().to_owned();
        let region = owner.ok("alloc cold 4096")[0].as_str().unwrap().to_owned();
        owner.ok("write 0 0 untouched");
        let key = owner.ok("share 0 ro")[1].clone();
        intruder.ok("open");

        let denied = "org.rdmad1.Error.NotAuthorized";
        for command in [
            format!("alloc-in {session} cold 4096"),
            format!("session-info {session}"),
            format!("close-session {session}"),
            format!("region-path {region} free"),
            format!("region-path {region} share"),
            format!("region-path {region} info"),
            format!("region-path {region} revoke {key}"),
            format!("region-path {region} detach"),
            format!("revoke-any {key}"),
            "quota 65534".to_owned(),
            "reload".to_owned(),
        ] {
            intruder.err(&command, denied);
        }
        // Another connection of the same user may look and close, but not use the session.
        same_user_elsewhere.err(&format!("alloc-in {session} cold 4096"), denied);
        same_user_elsewhere.err(&format!("region-path {region} free"), denied);
        same_user_elsewhere.ok(&format!("session-info {session}"));

        assert_eq!(
            intruder.ok("sessions").as_array().unwrap().len(),
            1,
            "only its own"
        );
        assert!(intruder.ok("regions").as_array().unwrap().is_empty());
        assert_eq!(owner.ok("read 0 0 9"), "untouched");
        assert_eq!(owner.ok("info 0")["keys"].as_array().unwrap().len(), 1);

        let all = admin.ok("sessions");
        assert_eq!(all.as_array().unwrap().len(), 2);
        assert!(all
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["uid"] == NOBODY && s["regions"] == 1));
        let names: Vec<Value> = admin
            .ok("quota 65534")
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q["name"].clone())
            .collect();
        assert_eq!(
            names,
            [
                "sessions",
                "regions",
                "registered_bytes",
                "keys",
                "qps",
                "exports",
                "registrations"
            ],
            "every limit, in the documented order"
        );
        admin.ok(&format!("close-session {session}"));
        owner.err("info 0", "org.freedesktop.DBus.Error.UnknownObject");
        let _: Value = admin.ok("regions");
    }

    /// `rdmactl pool|session|region|quota|key`, text and JSON, as the user and as root.
    pub async fn rdmactl_shows_and_controls_sessions_regions_and_keys(provider: &str) {
        use rdmad_tests::daemon::{rdmactl, rdmactl_ok};
        let (bus, _d) = start_on(provider, &format!("{COLD}[quota.default]\nregions = 7\n")).await;
        let mut alice = Client::start(&bus, Some(NOBODY));
        let session = alice.ok("open");
        let session_id: u64 = session
            .as_str()
            .unwrap()
            .rsplit('/')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        alice.ok("alloc cold 5000");
        let key = alice.ok("share 0 ro")[1].as_u64().unwrap();

        let json = |uid, args: &[&str]| -> Value {
            let mut full = vec!["-j"];
            full.extend_from_slice(args);
            serde_json::from_str(&rdmactl_ok(&bus, uid, &full)).unwrap()
        };
        let pools = json(Some(NOBODY), &["pool"]);
        assert_eq!(pools[0]["pool"], "cold");
        assert_eq!(pools[0]["used"], 65536);
        let device = pools[0]["device"].as_str().unwrap();
        let text = rdmactl_ok(&bus, Some(NOBODY), &["pool", "show"]);
        assert!(
            text.starts_with(&format!(
                "pool cold device {device} capacity 67108864 used 65536 "
            )),
            "{text}"
        );

        for uid in [Some(NOBODY), None] {
            let sessions = json(uid, &["session"]);
            assert_eq!(sessions[0]["session"], session_id);
            assert_eq!(sessions[0]["user"], "nobody");
            assert_eq!(sessions[0]["registered_bytes"], 65536);
            let regions = json(uid, &["region"]);
            assert_eq!(
                (
                    regions[0]["size"].as_u64(),
                    regions[0]["requested"].as_u64()
                ),
                (Some(65536), Some(5000))
            );
            assert_eq!(json(uid, &["key"])[0]["key"], key);
        }
        assert!(
            json(Some(1), &["session"]).as_array().unwrap().is_empty(),
            "other users see nothing"
        );

        let quota = json(Some(NOBODY), &["quota"]);
        let regions = quota
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["quota"] == "regions")
            .unwrap();
        assert_eq!(
            (regions["limit"].as_u64(), regions["used"].as_u64()),
            (Some(7), Some(1))
        );
        assert_eq!(
            json(None, &["quota", "nobody"]),
            quota,
            "root may read anyone's quota"
        );
        let refused = rdmactl(&bus, Some(1), &["quota", "nobody"]);
        assert_eq!(refused.status.code(), Some(1));
        assert_eq!(
            String::from_utf8_lossy(&refused.stderr),
            "rdmactl: only administrators may read another user's quota\n"
        );

        let refused = rdmactl(&bus, Some(1), &["key", "revoke", &key.to_string()]);
        assert_eq!(refused.status.code(), Some(1));
        assert_eq!(
            rdmactl_ok(&bus, None, &["key", "revoke", &key.to_string()]),
            format!("key {key} revoked\n")
        );
        assert!(json(None, &["key"]).as_array().unwrap().is_empty());

        let refused = rdmactl(
            &bus,
            Some(1),
            &["session", "close", &session_id.to_string()],
        );
        assert!(String::from_utf8_lossy(&refused.stderr).contains("belongs to another user"));
        assert_eq!(
            rdmactl_ok(&bus, None, &["session", "close", &session_id.to_string()]),
            format!("session {session_id} closed\n")
        );
        assert!(json(None, &["session"]).as_array().unwrap().is_empty());
        let missing = rdmactl(&bus, None, &["session", "close", "999"]);
        assert_eq!(
            String::from_utf8_lossy(&missing.stderr),
            "rdmactl: there is no session 999\n"
        );
    }
}
