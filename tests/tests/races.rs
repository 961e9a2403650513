//! Races: client processes whose requests reach the daemon at the same time.
//!
//! - Many clients of one uid racing for the last units of every quota (sessions, regions,
//!   registered bytes, keys, QPs, exports) get exactly the limit between them; everyone else gets
//!   `QuotaExceeded`, and `GetQuota` shows the use at the limit, never beyond.
//! - Free, attach, revoke and export racing on one region, in a random order each round:
//!   whatever wins, afterwards no key attaches, no rkey reaches the memory, every
//!   attachment has ended, and every object count (on rxe0 the kernel's verbs objects
//!   too) is back to its baseline.
//!
//! The two run one after the other, so that each can compare the kernel's objects.
//!
//! `RDMAD_RACE_SEED` replays a run (the seed is printed).

rdmad::on_both_providers!(async
    racing_for_the_last_units_of_every_quota_never_overshoots
        / rxe_racing_for_the_last_units_of_every_quota_never_overshoots,
    free_attach_revoke_and_export_racing_on_one_region
        / rxe_free_attach_revoke_and_export_racing_on_one_region,
);

mod bodies {
    use std::collections::HashMap;

    use rdmad_tests::bus::PrivateBus;
    use rdmad_tests::client::{named, Client};
    use rdmad_tests::daemon::{object_counts, start_on, wait_for_sessions};
    use rdmad_tests::rng::Rng;
    use rdmad_tests::{kernel_verbs_objects, NOBODY};
    use serde_json::Value;

    const OTHER: u32 = 1;
    /// What a call on a region that is gone gets: the bus's answer once the object is
    /// withdrawn, the daemon's if the call raced with the withdrawal.
    const GONE: [&str; 2] = [
        "org.freedesktop.DBus.Error.UnknownObject",
        "org.rdmad1.Error.NoSuchObject",
    ];

    /// The daemon's objects and (on rxe0) the kernel's verbs objects, to come back to.
    struct Baseline {
        counts: HashMap<String, u64>,
        kernel: Option<String>,
    }

    impl Baseline {
        async fn take(bus: &PrivateBus, provider: &str) -> Baseline {
            Baseline {
                counts: object_counts(bus).await,
                kernel: kernel_verbs_objects(provider),
            }
        }

        /// Waits until no session is left, then asserts that both are as they were.
        async fn assert_back(&self, bus: &PrivateBus, provider: &str, what: &str) {
            let after = wait_for_sessions(bus, 0).await;
            assert_eq!(after, self.counts, "{what}: objects");
            assert_eq!(
                kernel_verbs_objects(provider),
                self.kernel,
                "{what}: the kernel's verbs objects"
            );
        }
    }

    fn is_gone(answer: &Value) -> bool {
        GONE.iter().any(|g| answer["error"] == *g)
    }
    const POOL: &str = "[[pool]]\nname = \"default\"\ncapacity = \"64MiB\"\n\
                        size_classes = [\"4KiB\", \"64KiB\"]\n";

    fn seed() -> u64 {
        let seed = std::env::var("RDMAD_RACE_SEED")
            .map(|v| v.parse().expect("RDMAD_RACE_SEED: a number"))
            .unwrap_or_else(|_| Rng::seed_from_clock());
        println!("RDMAD_RACE_SEED={seed}");
        seed
    }

    fn quota_use(c: &mut Client, name: &str) -> (u64, u64) {
        let quota = c.ok(&format!("quota {NOBODY}"));
        let entry = named(&quota, name);
        (
            entry["used"].as_u64().unwrap(),
            entry["limit"].as_u64().unwrap(),
        )
    }

    pub async fn racing_for_the_last_units_of_every_quota_never_overshoots(provider: &str) {
        const CLIENTS: usize = 8;
        const LIMIT: u64 = 5;
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, daemon) = start_on(provider, POOL).await;
        let mut admin = Client::start(&bus, None);
        let device = admin.ok("devices")[0]["name"].as_str().unwrap().to_owned();
        let baseline = Baseline::take(&bus, provider).await;
        // (quota key, its limit, what each client does first, what it races with, how often)
        let alloc64 = "alloc default 65536".to_owned();
        let qp = format!("qp {device} 4 4");
        let phases: [(&str, String, &[&str], String, usize); 6] = [
            ("sessions", LIMIT.to_string(), &[], "open".into(), 2),
            (
                "regions",
                LIMIT.to_string(),
                &["open"],
                "alloc default 4096".into(),
                3,
            ),
            (
                "registered_bytes",
                format!("{}", LIMIT * 65536),
                &["open"],
                alloc64,
                3,
            ),
            (
                "keys",
                LIMIT.to_string(),
                &["open", "alloc default 4096"],
                "share 0 rw".into(),
                3,
            ),
            ("qps", LIMIT.to_string(), &["open"], qp.clone(), 2),
            // Every client exports one region through a QP connected to its other QP.
            (
                "exports",
                LIMIT.to_string(),
                &["open", "alloc default 4096", &qp, &qp],
                "export 0 0 rw".into(),
                3,
            ),
        ];
        for (quota, limit, prepare, race, times) in phases {
            daemon.write_config(&format!("{POOL}[quota.user.nobody]\n{quota} = {limit}\n"));
            admin.ok("reload");
            let mut clients: Vec<Client> = (0..CLIENTS)
                .map(|_| Client::start(&bus, Some(NOBODY)))
                .collect();
            // The sessions phase races for the sessions themselves; in the others every
            // client holds one (and, for keys, a region) before the race.
            for c in &mut clients {
                for command in prepare {
                    c.ok(command);
                }
                if quota == "exports" {
                    let (e0, e1) = (c.ok("endpoint 0"), c.ok("endpoint 1"));
                    c.ok(&format!("connect 0 {e1}"));
                    c.ok(&format!("connect 1 {e0}"));
                }
            }
            let (before, _) = quota_use(&mut admin, quota);
            for _ in 0..times {
                for c in &mut clients {
                    c.send(&race);
                }
            }
            let mut granted = 0;
            for c in &mut clients {
                for _ in 0..times {
                    let answer = c.answer();
                    match answer.get("error") {
                        None => granted += 1,
                        Some(e) => {
                            assert_eq!(e, "org.rdmad1.Error.QuotaExceeded", "{quota}: {answer}")
                        }
                    }
                }
            }
            let units = if quota == "registered_bytes" {
                65536
            } else {
                1
            };
            let (used, limit) = quota_use(&mut admin, quota);
            assert_eq!(limit, LIMIT * units, "{quota}");
            assert_eq!(used, limit, "{quota}: the use after the race");
            assert_eq!(
                before + granted * units,
                limit,
                "{quota}: {granted} granted"
            );
            for c in &mut clients {
                c.kill();
            }
            baseline
                .assert_back(&bus, provider, &format!("{quota}: after the clients died"))
                .await;
        }
    }

    /// The answers of every command written with `send`, in order.
    fn answers(c: &mut Client, n: usize) -> Vec<Value> {
        (0..n).map(|_| c.answer()).collect()
    }

    pub async fn free_attach_revoke_and_export_racing_on_one_region(provider: &str) {
        const ROUNDS: usize = 30;
        const ATTACHERS: usize = 4;
        let _alone = rdmad_tests::ALONE.lock().await;
        let mut rng = Rng::new(seed());
        let (bus, _daemon) = start_on(provider, POOL).await;
        let baseline = Baseline::take(&bus, provider).await;
        let mut admin = Client::start(&bus, None);
        let device = admin.ok("devices")[0]["name"].as_str().unwrap().to_owned();
        let dead_key = [
            "org.rdmad1.Error.NotAuthorized",
            "org.rdmad1.Error.NoSuchObject",
        ];
        let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
        for round in 0..ROUNDS {
            // The owner and a connected peer of another user.
            let mut owner = Client::start(&bus, Some(NOBODY));
            let mut peer = Client::start(&bus, Some(OTHER));
            for c in [&mut owner, &mut peer] {
                c.ok("open");
                c.ok("alloc default 4096");
                c.ok(&format!("qp {device} 8 8"));
            }
            let (eo, ep) = (owner.ok("endpoint 0"), peer.ok("endpoint 0"));
            owner.ok(&format!("connect 0 {ep}"));
            peer.ok(&format!("connect 0 {eo}"));
            let shared = owner.ok("share 0 rw");
            let (token, key) = (shared[0].as_str().unwrap().to_owned(), shared[1].clone());
            let mut attachers: Vec<Client> = (0..ATTACHERS)
                .map(|_| {
                    let mut c = Client::start(&bus, Some(OTHER));
                    c.ok("open");
                    c
                })
                .collect();

            // Everyone at once, in a random order; the owner exports and frees in a random
            // order of its own.
            let export_first = rng.below(2) == 0;
            let mut order: Vec<usize> = (0..ATTACHERS + 2).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i + 1));
            }
            for &who in &order {
                match who {
                    0 if export_first => {
                        owner.send("export 0 0 rw");
                        owner.send("free 0");
                    }
                    0 => {
                        owner.send("free 0");
                        owner.send("export 0 0 rw");
                    }
                    1 => admin.send(&format!("revoke-any {key}")),
                    n => {
                        attachers[n - 2].send(&format!("attach {token}"));
                    }
                }
            }
            let mut owned = answers(&mut owner, 2);
            if !export_first {
                owned.swap(0, 1);
            }
            let (export, freed) = (&owned[0], &owned[1]);
            assert!(
                freed.get("ok").is_some(),
                "round {round}: free answered {freed}"
            );
            let revoked = admin.answer();
            if let Some(e) = revoked.get("error") {
                assert_eq!(
                    e, "org.rdmad1.Error.NoSuchObject",
                    "round {round}: {revoked}"
                );
            }
            let mut attached = 0;
            for c in &mut attachers {
                let mut held = 0;
                for a in answers(c, 1) {
                    match a.get("error") {
                        None => held += 1,
                        Some(e) => assert!(dead_key.iter().any(|d| e == d), "round {round}: {a}"),
                    }
                }
                // The free ended every attachment made before it.
                for n in 0..held {
                    let info = c.call(&format!("info {n}"));
                    assert!(is_gone(&info), "round {round}: attachment {n}: {info}");
                }
                attached += held;
            }
            let exported = export.get("ok").is_some();
            *outcomes
                .entry(format!(
                    "export {} free, {attached} attaches, revoke {}",
                    if exported { "before" } else { "after" },
                    if revoked.get("ok").is_some() {
                        "won"
                    } else {
                        "lost"
                    }
                ))
                .or_default() += 1;

            // Afterwards the key attaches nothing and the rkey reaches nothing.
            let mut late = Client::start(&bus, Some(OTHER));
            late.ok("open");
            let refused = late.call(&format!("attach {token}"));
            assert!(
                dead_key.iter().any(|d| refused["error"] == *d),
                "round {round}: {refused}"
            );
            if exported {
                let (addr, rkey) = (&export["ok"][0], &export["ok"][1]);
                peer.ok(&format!("post 0 write 0 0 8 1 {addr} {rkey}"));
                let c = peer.ok("wait 0");
                assert_eq!(c["status"], "RemoteAccessError", "round {round}: {c}");
            } else {
                assert!(
                    is_gone(export),
                    "round {round}: export after free answered {export}"
                );
            }
            let counts = object_counts(&bus).await;
            assert_eq!(counts["keys"], 0, "round {round}: {counts:?}");
            assert_eq!(
                counts["mws"], baseline.counts["mws"],
                "round {round}: {counts:?}"
            );
            // The peer's region alone is left of the round's regions.
            assert_eq!(
                counts["regions"],
                baseline.counts["regions"] + 1,
                "round {round}: {counts:?}"
            );

            for c in attachers
                .iter_mut()
                .chain([&mut owner, &mut peer, &mut late])
            {
                c.kill();
            }
            baseline
                .assert_back(&bus, provider, &format!("round {round}: after the round"))
                .await;
        }
        println!("outcomes over {ROUNDS} rounds: {outcomes:?}");
    }
}
