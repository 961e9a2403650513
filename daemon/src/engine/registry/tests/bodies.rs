//! The bodies of the tests run on both providers (see `on_both_providers!`).

use super::*;

pub fn the_client_descriptor_and_the_registration_share_bytes(provider: ProviderChoice) {
    let (engine, config) = engine_on(provider, POOL);
    let alice = caller(1000, ":1.1");
    let s = engine
        .registry
        .open_session(&alice.owner(), &limits(&config, &alice))
        .unwrap();
    let pool = Arc::clone(engine.pool("p").unwrap());
    let h = engine
        .registry
        .allocate(
            &alice.owner(),
            &limits(&config, &alice),
            &pools(&engine, &alice),
            s,
            &pool,
            100,
        )
        .unwrap();
    assert_eq!(h.size, 4096);
    pwrite(&h.fd, b"from the client", 10).unwrap();
    let mr = engine.registry.region_mr(h.region).unwrap();
    let mut seen = [0u8; 15];
    mr.memory().read_at(10, &mut seen).unwrap();
    assert_eq!(
        &seen, b"from the client",
        "the device's view is the client's bytes"
    );
    mr.memory().write_at(0, b"from the device").unwrap();
    let mut buf = [0u8; 15];
    pread(&h.fd, &mut buf, 0).unwrap();
    assert_eq!(&buf, b"from the device");
}

pub fn memory_once_exposed_is_never_handed_to_another_owner(provider: ProviderChoice) {
    let (engine, config) = engine_on(provider, POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let alice = caller(1000, ":1.1");
    let bob = caller(1001, ":1.2");
    let sa = engine
        .registry
        .open_session(&alice.owner(), &limits(&config, &alice))
        .unwrap();
    let sb = engine
        .registry
        .open_session(&bob.owner(), &limits(&config, &bob))
        .unwrap();
    let kept = engine
        .registry
        .allocate(
            &alice.owner(),
            &limits(&config, &alice),
            &pools(&engine, &alice),
            sa,
            &pool,
            4096,
        )
        .unwrap();
    pwrite(&kept.fd, b"alice's secret", 0).unwrap();
    let kept_inode = nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&kept.fd))
        .unwrap()
        .st_ino;
    engine.free(&alice.owner(), kept.region).unwrap();

    for _ in 0..20 {
        let h = engine
            .registry
            .allocate(
                &bob.owner(),
                &limits(&config, &bob),
                &pools(&engine, &bob),
                sb,
                &pool,
                4096,
            )
            .unwrap();
        assert_ne!(
            nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&h.fd))
                .unwrap()
                .st_ino,
            kept_inode
        );
        let mut buf = [0xffu8; 4096];
        pread(&h.fd, &mut buf, 0).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "new regions read as zero");
        pwrite(&h.fd, b"bob's data", 0).unwrap();
        // The freed region's pages went back at once; the kept fd reads zeros,
        // never the next owner's bytes.
        let mut old = [0xffu8; 14];
        pread(&kept.fd, &mut old, 0).unwrap();
        assert_eq!(old, [0u8; 14], "the kept fd never sees the next owner");
        engine.free(&bob.owner(), h.region).unwrap();
    }
}

pub fn concurrent_requests_never_overshoot_a_quota(provider: ProviderChoice) {
    let (engine, config) = engine_on(provider, &format!("{POOL}[quota.default]\nregions = 10\n"));
    let engine = Arc::new(engine);
    let alice = caller(1000, ":1.1");
    let s = engine
        .registry
        .open_session(&alice.owner(), &limits(&config, &alice))
        .unwrap();
    let pool = Arc::clone(engine.pool("p").unwrap());
    let results: Vec<bool> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..64)
            .map(|_| {
                let (engine, config, alice, pool) = (&engine, &config, &alice, &pool);
                scope.spawn(move || {
                    engine
                        .registry
                        .allocate(
                            &alice.owner(),
                            &limits(config, alice),
                            &pools(engine, alice),
                            s,
                            pool,
                            4096,
                        )
                        .is_ok()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results.iter().filter(|ok| **ok).count(), 10);
    assert_eq!(engine.registry.usage(1000).get(QuotaKind::Regions), 10);
    let err = engine
        .registry
        .allocate(
            &alice.owner(),
            &limits(&config, &alice),
            &pools(&engine, &alice),
            s,
            &pool,
            4096,
        )
        .unwrap_err();
    assert!(matches!(err, EngineError::Quota(_)), "{err}");
}

pub fn closing_a_session_releases_everything_it_held(provider: ProviderChoice) {
    let (engine, config) = engine_on(provider, COLD_POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let device = Arc::clone(&engine.devices()[0].device);
    let alice = caller(1000, ":1.1");
    let bob = caller(1001, ":1.2");
    let sb = engine
        .registry
        .open_session(&bob.owner(), &limits(&config, &bob))
        .unwrap();
    let before = (pool.stats().used, engine.registry.counts());
    let mrs_before = device.object_counts().mrs;

    let sa = engine
        .registry
        .open_session(&alice.owner(), &limits(&config, &alice))
        .unwrap();
    let a = engine
        .registry
        .allocate(
            &alice.owner(),
            &limits(&config, &alice),
            &pools(&engine, &alice),
            sa,
            &pool,
            1 << 20,
        )
        .unwrap();
    engine
        .registry
        .allocate(
            &alice.owner(),
            &limits(&config, &alice),
            &pools(&engine, &alice),
            sa,
            &pool,
            100,
        )
        .unwrap();
    let (token, _) = engine
        .registry
        .share(
            &alice.owner(),
            &limits(&config, &alice),
            a.region,
            AttachMode::ReadWrite,
            None,
        )
        .unwrap();
    engine
        .registry
        .attach(&bob.owner(), &pools(&engine, &bob), sb, &token)
        .unwrap();

    let removed = engine.close_sessions_of(":1.1");
    assert_eq!(removed.sessions, vec![sa]);
    assert_eq!(removed.regions.len(), 2);
    assert_eq!((pool.stats().used, engine.registry.counts()), before);
    assert!(engine.registry.usage(1000).is_zero());
    assert!(engine
        .registry
        .session(&bob.owner(), scope(&config, &bob), sb)
        .unwrap()
        .attachments
        .is_empty());
    assert_eq!(
        device.object_counts().mrs,
        mrs_before,
        "every region deregistered"
    );
    assert!(
        engine
            .registry
            .attach(&bob.owner(), &pools(&engine, &bob), sb, &token)
            .is_err(),
        "keys die with the region"
    );
}

pub fn read_only_keys_give_read_only_descriptors(provider: ProviderChoice) {
    let (engine, config) = engine_on(provider, POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let alice = caller(1000, ":1.1");
    let bob = caller(1001, ":1.2");
    let sa = engine
        .registry
        .open_session(&alice.owner(), &limits(&config, &alice))
        .unwrap();
    let sb = engine
        .registry
        .open_session(&bob.owner(), &limits(&config, &bob))
        .unwrap();
    let a = engine
        .registry
        .allocate(
            &alice.owner(),
            &limits(&config, &alice),
            &pools(&engine, &alice),
            sa,
            &pool,
            4096,
        )
        .unwrap();
    let (token, key) = engine
        .registry
        .share(
            &alice.owner(),
            &limits(&config, &alice),
            a.region,
            AttachMode::ReadOnly,
            None,
        )
        .unwrap();
    let h = engine
        .registry
        .attach(&bob.owner(), &pools(&engine, &bob), sb, &token)
        .unwrap();
    assert_eq!(h.access, AttachMode::ReadOnly);
    let flags = nix::fcntl::fcntl(
        std::os::fd::AsRawFd::as_raw_fd(&h.fd),
        nix::fcntl::FcntlArg::F_GETFL,
    )
    .unwrap();
    assert_eq!(flags & libc::O_ACCMODE, libc::O_RDONLY);
    assert!(
        pwrite(&h.fd, b"x", 0).is_err(),
        "writes through a read-only attachment fail"
    );

    // Bob cannot share, free or revoke what he only attached.
    assert!(matches!(
        engine.registry.share(
            &bob.owner(),
            &limits(&config, &bob),
            a.region,
            AttachMode::ReadWrite,
            None
        ),
        Err(EngineError::NotAuthorized(_))
    ));
    assert!(matches!(
        engine.free(&bob.owner(), a.region),
        Err(EngineError::NotAuthorized(_))
    ));
    assert!(matches!(
        engine
            .registry
            .revoke(&bob.owner(), scope(&config, &bob), key),
        Err(EngineError::NotAuthorized(_))
    ));

    engine
        .registry
        .revoke(&alice.owner(), scope(&config, &alice), key)
        .unwrap();
    let carol_session = engine
        .registry
        .open_session(
            &caller(1002, ":1.3").owner(),
            &limits(&config, &caller(1002, ":1.3")),
        )
        .unwrap();
    assert!(matches!(
        engine.registry.attach(
            &caller(1002, ":1.3").owner(),
            &pools(&engine, &caller(1002, ":1.3")),
            carol_session,
            &token
        ),
        Err(EngineError::NotAuthorized(_))
    ));
    let rights = engine.registry.session_rights(sb).unwrap();
    assert!(
        !rights[&a.region].writable,
        "a read-only attachment is only a source"
    );
    assert!(engine.registry.session_rights(sa).unwrap()[&a.region].writable);
    // The live attachment stays after revocation.
    assert_eq!(
        engine
            .registry
            .session(&bob.owner(), scope(&config, &bob), sb)
            .unwrap()
            .attachments
            .len(),
        1
    );
}

pub fn expired_keys_do_not_attach(provider: ProviderChoice) {
    let (engine, config) = engine_on(provider, POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let alice = caller(1000, ":1.1");
    let bob = caller(1001, ":1.2");
    let sa = engine
        .registry
        .open_session(&alice.owner(), &limits(&config, &alice))
        .unwrap();
    let sb = engine
        .registry
        .open_session(&bob.owner(), &limits(&config, &bob))
        .unwrap();
    let a = engine
        .registry
        .allocate(
            &alice.owner(),
            &limits(&config, &alice),
            &pools(&engine, &alice),
            sa,
            &pool,
            4096,
        )
        .unwrap();
    let (token, _) = engine
        .registry
        .share(
            &alice.owner(),
            &limits(&config, &alice),
            a.region,
            AttachMode::ReadWrite,
            Some(Duration::ZERO),
        )
        .unwrap();
    assert!(matches!(
        engine
            .registry
            .attach(&bob.owner(), &pools(&engine, &bob), sb, &token),
        Err(EngineError::NotAuthorized(_))
    ));
    assert_eq!(
        engine.registry.usage(1000).get(QuotaKind::Keys),
        0,
        "expired keys are purged"
    );
}

pub fn other_connections_cannot_use_a_session(provider: ProviderChoice) {
    let (engine, config) = engine_on(provider, POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let alice = caller(1000, ":1.1");
    let alice_elsewhere = caller(1000, ":1.9");
    let mallory = caller(1666, ":1.6");
    let s = engine
        .registry
        .open_session(&alice.owner(), &limits(&config, &alice))
        .unwrap();
    for intruder in [&alice_elsewhere, &mallory] {
        assert!(matches!(
            engine.registry.allocate(
                &intruder.owner(),
                &limits(&config, intruder),
                &pools(&engine, intruder),
                s,
                &pool,
                4096
            ),
            Err(EngineError::NotAuthorized(_))
        ));
    }
    assert!(matches!(
        engine.close_session(&mallory.owner(), scope(&config, &mallory), s),
        Err(EngineError::NotAuthorized(_))
    ));
    assert!(engine
        .registry
        .sessions(&mallory.owner(), scope(&config, &mallory))
        .is_empty());
    assert_eq!(
        engine
            .registry
            .sessions(
                &caller(0, ":1.0").owner(),
                scope(&config, &caller(0, ":1.0"))
            )
            .len(),
        1,
        "admins see all"
    );
    assert!(matches!(
        crate::policy::limits_of(&mallory, &config, 1000),
        Err(crate::policy::PolicyError::OthersQuota)
    ));
    engine
        .close_session(
            &alice_elsewhere.owner(),
            scope(&config, &alice_elsewhere),
            s,
        )
        .unwrap();
}

pub fn pool_acl_is_enforced(provider: ProviderChoice) {
    let (engine, config) = engine_on(provider,
    "[[pool]]\nname = \"rootonly\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\nusers = [\"root\"]\n",
);
    let pool = Arc::clone(engine.pool("rootonly").unwrap());
    let nobody = caller(65534, ":1.5");
    let s = engine
        .registry
        .open_session(&nobody.owner(), &limits(&config, &nobody))
        .unwrap();
    let err = engine
        .registry
        .allocate(
            &nobody.owner(),
            &limits(&config, &nobody),
            &pools(&engine, &nobody),
            s,
            &pool,
            4096,
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "user nobody may not use pool \"rootonly\" (allowed users: root; groups: none)"
    );
    assert!(engine.registry.usage(65534).get(QuotaKind::Regions) == 0);
    let root = caller(0, ":1.0");
    let s = engine
        .registry
        .open_session(&root.owner(), &limits(&config, &root))
        .unwrap();
    engine
        .registry
        .allocate(
            &root.owner(),
            &limits(&config, &root),
            &pools(&engine, &root),
            s,
            &pool,
            4096,
        )
        .unwrap();
}
