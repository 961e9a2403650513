//! The bodies of the tests run on both providers (see `on_both_providers!`).

use super::*;

pub fn the_client_descriptor_and_the_registration_share_bytes(provider: ProviderChoice) {
    let engine = engine_on(provider, POOL);
    let alice = Tenant::new(&engine, caller(1000, ":1.1"));
    let s = alice.open_session();
    let pool = Arc::clone(engine.pool("p").unwrap());
    let h = alice.allocate(s, &pool, 100).unwrap();
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
    let engine = engine_on(provider, POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let [(alice, sa), (bob, sb)] = alice_and_bob(&engine);
    let kept = alice.allocate(sa, &pool, 4096).unwrap();
    pwrite(&kept.fd, b"alice's secret", 0).unwrap();
    let kept_inode = nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&kept.fd))
        .unwrap()
        .st_ino;
    alice.free(kept.region).unwrap();

    for _ in 0..20 {
        let h = bob.allocate(sb, &pool, 4096).unwrap();
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
        bob.free(h.region).unwrap();
    }
}

pub fn concurrent_requests_never_overshoot_a_quota(provider: ProviderChoice) {
    let engine = Arc::new(engine_on(
        provider,
        &format!("{POOL}[quota.default]\nregions = 10\n"),
    ));
    let alice = Tenant::new(&engine, caller(1000, ":1.1"));
    let s = alice.open_session();
    let pool = Arc::clone(engine.pool("p").unwrap());
    let results: Vec<bool> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..64)
            .map(|_| {
                let (alice, pool) = (&alice, &pool);
                scope.spawn(move || alice.allocate(s, pool, 4096).is_ok())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results.iter().filter(|ok| **ok).count(), 10);
    assert_eq!(engine.registry.usage(1000).get(QuotaKind::Regions), 10);
    let err = alice.allocate(s, &pool, 4096).unwrap_err();
    assert!(matches!(err, EngineError::Quota(_)), "{err}");
}

pub fn closing_a_session_releases_everything_it_held(provider: ProviderChoice) {
    let engine = engine_on(provider, COLD_POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let device = Arc::clone(&engine.devices()[0].device);
    let alice = Tenant::new(&engine, caller(1000, ":1.1"));
    let bob = Tenant::new(&engine, caller(1001, ":1.2"));
    let sb = bob.open_session();
    let before = (pool.stats().used, engine.registry.counts());
    let mrs_before = device.object_counts().mrs;

    let sa = alice.open_session();
    let a = alice.allocate(sa, &pool, 1 << 20).unwrap();
    alice.allocate(sa, &pool, 100).unwrap();
    let (token, _) = alice.share(a.region, AttachMode::ReadWrite, None).unwrap();
    bob.attach(sb, &token).unwrap();

    let removed = engine.close_sessions_of(":1.1");
    assert_eq!(removed.sessions, vec![sa]);
    assert_eq!(removed.regions.len(), 2);
    assert_eq!((pool.stats().used, engine.registry.counts()), before);
    assert!(engine.registry.usage(1000).is_zero());
    assert!(bob.session(sb).unwrap().attachments.is_empty());
    assert_eq!(
        device.object_counts().mrs,
        mrs_before,
        "every region deregistered"
    );
    assert!(bob.attach(sb, &token).is_err(), "keys die with the region");
}

pub fn read_only_keys_give_read_only_descriptors(provider: ProviderChoice) {
    let engine = engine_on(provider, POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let [(alice, sa), (bob, sb)] = alice_and_bob(&engine);
    let a = alice.allocate(sa, &pool, 4096).unwrap();
    let (token, key) = alice.share(a.region, AttachMode::ReadOnly, None).unwrap();
    let h = bob.attach(sb, &token).unwrap();
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
        bob.share(a.region, AttachMode::ReadWrite, None),
        Err(EngineError::NotAuthorized(_))
    ));
    assert!(matches!(
        bob.free(a.region),
        Err(EngineError::NotAuthorized(_))
    ));
    assert!(matches!(
        bob.revoke(key),
        Err(EngineError::NotAuthorized(_))
    ));

    alice.revoke(key).unwrap();
    let carol = Tenant::new(&engine, caller(1002, ":1.3"));
    let carol_session = carol.open_session();
    assert!(matches!(
        carol.attach(carol_session, &token),
        Err(EngineError::NotAuthorized(_))
    ));
    let rights = engine.registry.session_rights(sb).unwrap();
    assert!(
        !rights[&a.region].writable,
        "a read-only attachment is only a source"
    );
    assert!(engine.registry.session_rights(sa).unwrap()[&a.region].writable);
    // The live attachment stays after revocation.
    assert_eq!(bob.session(sb).unwrap().attachments.len(), 1);
}

pub fn expired_keys_do_not_attach(provider: ProviderChoice) {
    let engine = engine_on(provider, POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let [(alice, sa), (bob, sb)] = alice_and_bob(&engine);
    let a = alice.allocate(sa, &pool, 4096).unwrap();
    let (token, _) = alice
        .share(a.region, AttachMode::ReadWrite, Some(Duration::ZERO))
        .unwrap();
    assert!(matches!(
        bob.attach(sb, &token),
        Err(EngineError::NotAuthorized(_))
    ));
    assert_eq!(
        engine.registry.usage(1000).get(QuotaKind::Keys),
        0,
        "expired keys are purged"
    );
}

pub fn other_connections_cannot_use_a_session(provider: ProviderChoice) {
    let engine = engine_on(provider, POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let alice = Tenant::new(&engine, caller(1000, ":1.1"));
    let alice_elsewhere = Tenant::new(&engine, caller(1000, ":1.9"));
    let mallory = Tenant::new(&engine, caller(1666, ":1.6"));
    let s = alice.open_session();
    for intruder in [&alice_elsewhere, &mallory] {
        assert!(matches!(
            intruder.allocate(s, &pool, 4096),
            Err(EngineError::NotAuthorized(_))
        ));
    }
    assert!(matches!(
        mallory.close_session(s),
        Err(EngineError::NotAuthorized(_))
    ));
    assert!(mallory.sessions().is_empty());
    assert_eq!(
        Tenant::new(&engine, caller(0, ":1.0")).sessions().len(),
        1,
        "admins see all"
    );
    assert!(matches!(
        crate::policy::limits_of(&mallory.caller, &engine.config(), 1000),
        Err(crate::policy::PolicyError::OthersQuota)
    ));
    alice_elsewhere.close_session(s).unwrap();
}

pub fn pool_acl_is_enforced(provider: ProviderChoice) {
    let engine = engine_on(provider,
    "[[pool]]\nname = \"rootonly\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\nusers = [\"root\"]\n",
);
    let pool = Arc::clone(engine.pool("rootonly").unwrap());
    let nobody = Tenant::new(&engine, caller(65534, ":1.5"));
    let s = nobody.open_session();
    let err = nobody.allocate(s, &pool, 4096).unwrap_err();
    assert_eq!(
        err.to_string(),
        "user nobody may not use pool \"rootonly\" (allowed users: root; groups: none)"
    );
    assert!(engine.registry.usage(65534).get(QuotaKind::Regions) == 0);
    let root = Tenant::new(&engine, caller(0, ":1.0"));
    let s = root.open_session();
    root.allocate(s, &pool, 4096).unwrap();
}
