use super::*;
use crate::config::{Config, ProviderChoice};
use crate::engine::{Engine, ExportHandout, RemoteRights};
use crate::policy::Caller;
use nix::sys::uio::{pread, pwrite};
use std::path::PathBuf;
use std::time::Duration;

mod bodies;
mod domains;
mod exports;
mod rights;
mod windows;

crate::on_both_providers!(
    the_client_descriptor_and_the_registration_share_bytes
        / rxe_the_client_descriptor_and_the_registration_share_bytes,
    memory_once_exposed_is_never_handed_to_another_owner
        / rxe_memory_once_exposed_is_never_handed_to_another_owner,
    concurrent_requests_never_overshoot_a_quota / rxe_concurrent_requests_never_overshoot_a_quota,
    closing_a_session_releases_everything_it_held
        / rxe_closing_a_session_releases_everything_it_held,
    read_only_keys_give_read_only_descriptors / rxe_read_only_keys_give_read_only_descriptors,
    expired_keys_do_not_attach / rxe_expired_keys_do_not_attach,
    other_connections_cannot_use_a_session / rxe_other_connections_cannot_use_a_session,
    pool_acl_is_enforced / rxe_pool_acl_is_enforced,
);

fn engine_on(provider: ProviderChoice, text: &str) -> Engine {
    let config = Config::parse(std::path::Path::new("t.toml"), text).unwrap();
    Engine::start(config, PathBuf::from("/dev/null"), Some(provider)).unwrap()
}

const REMOTE_WRITE: RemoteRights = RemoteRights {
    read: false,
    write: true,
    atomic: false,
};
const REMOTE_READ: RemoteRights = RemoteRights {
    read: true,
    write: false,
    atomic: false,
};

/// A bus caller as the policy layer gets it (the engine itself never sees one).
fn caller(uid: u32, bus: &str) -> Caller {
    Caller {
        bus_name: bus.to_owned(),
        uid,
        gids: vec![uid],
        pid: None,
    }
}

/// A test caller and what the policy layer makes of it under the configuration `engine`
/// has in force when it is made: the owner, limits, scope and pool access the engine
/// takes, with the calls the tests make on its behalf. Those whose refusal some test
/// checks return the `Result`; the others unwrap.
struct Tenant<'e> {
    engine: &'e Engine,
    caller: Caller,
    owner: Owner,
    limits: Limits,
    scope: Scope,
    pools: PoolAccess,
}

impl<'e> Tenant<'e> {
    fn new(engine: &'e Engine, caller: Caller) -> Self {
        let config = engine.config();
        Tenant {
            engine,
            owner: caller.owner(),
            limits: crate::policy::limits(&caller, &config),
            scope: crate::policy::scope(&caller, &config),
            pools: crate::policy::pool_access(&caller, &engine.pool_configs()),
            caller,
        }
    }

    fn open_session(&self) -> SessionId {
        self.engine
            .registry
            .open_session(&self.owner, &self.limits)
            .unwrap()
    }

    fn allocate(
        &self,
        session: SessionId,
        pool: &Arc<Pool>,
        size: u64,
    ) -> Result<Handout, EngineError> {
        self.engine
            .registry
            .allocate(&self.owner, &self.limits, &self.pools, session, pool, size)
    }

    fn share(
        &self,
        region: RegionId,
        mode: AttachMode,
        lifetime: Option<Duration>,
    ) -> Result<(String, KeyId), EngineError> {
        self.engine
            .registry
            .share(&self.owner, &self.limits, region, mode, lifetime)
    }

    fn attach(&self, session: SessionId, token: &str) -> Result<Handout, EngineError> {
        self.engine
            .registry
            .attach(&self.owner, &self.pools, session, token)
    }

    fn revoke(&self, key: KeyId) -> Result<(), EngineError> {
        self.engine.registry.revoke(&self.owner, self.scope, key)
    }

    fn session(&self, id: SessionId) -> Result<SessionInfo, EngineError> {
        self.engine.registry.session(&self.owner, self.scope, id)
    }

    fn sessions(&self) -> Vec<SessionInfo> {
        self.engine.registry.sessions(&self.owner, self.scope)
    }

    fn close_session(&self, id: SessionId) -> Result<Removed, EngineError> {
        self.engine.close_session(&self.owner, self.scope, id)
    }

    /// Frees `region` and waits for its release behind the return, as every reader of
    /// counts does.
    fn free(&self, region: RegionId) -> Result<Removed, EngineError> {
        let removed = self.engine.free(&self.owner, region);
        self.engine.settled();
        removed
    }

    /// A queue pair of `session` on loopback0, with the default options.
    fn create_qp(&self, session: SessionId) -> QpId {
        use crate::engine::qp::QpOptions;
        self.engine
            .create_qp(
                &self.owner,
                &self.limits,
                session,
                "loopback0",
                QpOptions::default(),
            )
            .unwrap()
            .id
    }

    /// Exports `region` through `qp` with `rights`: (export, addr, rkey, len).
    fn export(
        &self,
        region: RegionId,
        qp: QpId,
        rights: RemoteRights,
    ) -> Result<(ExportId, u64, u32, u64), EngineError> {
        self.engine
            .export_remote(&self.owner, &self.limits, region, qp, rights)
            .map(ExportHandout::parts)
    }
}

/// Alice (uid 1000) and Bob (uid 1001), each with a session of their own, Alice's opened
/// first.
fn alice_and_bob(engine: &Engine) -> [(Tenant<'_>, SessionId); 2] {
    [caller(1000, ":1.1"), caller(1001, ":1.2")].map(|who| {
        let who = Tenant::new(engine, who);
        let session = who.open_session();
        (who, session)
    })
}

/// A session whose connection left counts as a session until everything it held is
/// released, so that an observer who sees the count drop (`ObjectCounts`, tests waiting
/// for a killed client's session to go) also sees its queue pairs and memory released.
#[test]
fn a_closing_session_counts_until_its_objects_are_released() {
    let engine = Arc::new(engine_on(ProviderChoice::Loopback, COLD_POOL));
    let pool = Arc::clone(engine.pool("p").unwrap());
    let device = Arc::clone(&engine.devices()[0].device);
    let baseline = device.object_counts();
    for round in 0..100 {
        let alice = Tenant::new(&engine, caller(1000, ":1.1"));
        let s = alice.open_session();
        alice.create_qp(s);
        alice.allocate(s, &pool, 4096).unwrap();
        let closer = {
            let engine = Arc::clone(&engine);
            std::thread::spawn(move || engine.close_sessions_of(":1.1"))
        };
        while engine.registry.counts().0 != 0 {
            std::hint::spin_loop();
        }
        assert_eq!(device.object_counts(), baseline, "round {round}");
        assert_eq!(pool.stats().used, 0, "round {round}");
        closer.join().unwrap();
    }
}

/// Every registry call that needs a user or group lookup — pool access lists, the
/// administrators' group, another user's groups — makes it with the registry's lock
/// released: NSS may block on a directory server, and under the lock one slow lookup
/// would stall every tenant. Debug builds fail any lookup made under the lock
/// (`policy::lookups`), so each call here would panic if one still did.
#[test]
fn user_and_group_lookups_never_run_under_the_registry_lock() {
    let engine = engine_on(
        ProviderChoice::Loopback,
        "[daemon]\nadmin_group = \"root\"\n\n[[pool]]\nname = \"acl\"\n\
         capacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\nusers = [\"root\"]\n\
         groups = [\"root\"]\n",
    );
    let pool = Arc::clone(engine.pool("acl").unwrap());
    let root = Tenant::new(&engine, caller(0, ":1.0"));
    // Not root, but in the administrators' group (and the pool's).
    let carol = Tenant::new(
        &engine,
        Caller {
            gids: vec![0],
            ..caller(1002, ":1.3")
        },
    );
    let owner = root.open_session();
    let region = root.allocate(owner, &pool, 4096).unwrap().region;
    let (token, key) = root.share(region, AttachMode::ReadOnly, None).unwrap();
    let attacher = carol.open_session();
    let handout = carol.attach(attacher, &token).unwrap();
    assert_eq!(handout.region, region, "the pool's group lets carol attach");
    assert_eq!(
        carol.session(owner).unwrap().uid,
        0,
        "an administrator reads another user's session"
    );
    engine
        .registry
        .quota(&crate::policy::limits_of(&carol.caller, &engine.config(), 0).unwrap());
    carol.revoke(key).unwrap();
    let removed = carol.close_session(owner).unwrap();
    assert_eq!(removed.regions, vec![region]);
}

const POOL: &str = "[[pool]]\nname = \"p\"\ncapacity = \"64MiB\"\n\
                    size_classes = [\"4KiB\", \"1MiB\"]\nwarm = 2\n";

/// Without warm regions nothing happens in the background, so counts are exact.
const COLD_POOL: &str = "[[pool]]\nname = \"p\"\ncapacity = \"64MiB\"\n\
                         size_classes = [\"4KiB\", \"1MiB\"]\n";

/// Closing a session whose regions many other sessions attached rebuilds each of those
/// sessions' rights once, not once per region (under the registry's lock, which every
/// client's calls take: a teardown of N regions attached into M sessions would otherwise
/// hold it for N × M rebuilds of up to N regions each); freeing one region rebuilds each
/// session that could reach it once. Afterwards none of them reaches the regions.
#[test]
fn a_teardown_rebuilds_each_sessions_rights_once() {
    const REGIONS: usize = 20;
    const ATTACHERS: usize = 4;
    let engine = engine_on(ProviderChoice::Loopback, POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let alice = Tenant::new(&engine, caller(1000, ":1.1"));
    let owner = alice.open_session();
    let attachers: Vec<SessionId> = (0..ATTACHERS).map(|_| alice.open_session()).collect();
    let regions: Vec<RegionId> = (0..REGIONS)
        .map(|_| {
            let region = alice.allocate(owner, &pool, 4096).unwrap().region;
            let (token, _) = alice.share(region, AttachMode::ReadWrite, None).unwrap();
            for &session in &attachers {
                alice.attach(session, &token).unwrap();
            }
            region
        })
        .collect();
    let rebuilt = || {
        engine
            .registry
            .lock()
            .rights_rebuilt
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    for &session in &attachers {
        assert_eq!(
            engine.registry.session_rights(session).unwrap().len(),
            REGIONS
        );
    }

    let before = rebuilt();
    alice.free(regions[0]).unwrap();
    assert_eq!(
        rebuilt() - before,
        ATTACHERS + 1,
        "the attachers' and the owner's"
    );

    let before = rebuilt();
    alice.close_session(owner).unwrap();
    assert_eq!(
        rebuilt() - before,
        ATTACHERS,
        "once each, for {} regions",
        REGIONS - 1
    );
    for &session in &attachers {
        assert!(engine.registry.session_rights(session).unwrap().is_empty());
    }
}

/// A region freed (or whose session closed) while something still holds its registration —
/// a request in flight on a data path, here a clone of it; or of its registration in one of
/// the session's own domains — stays counted against its owner's quota and its pool, so
/// freeing under requests that never complete cannot take a user past its quota. Once let
/// go, the next reader that waits for releases (or allocation) finds the room given back.
#[test]
fn a_freed_region_a_request_still_holds_counts_until_it_is_let_go() {
    let engine = Arc::new(engine_on(
        ProviderChoice::Loopback,
        "[[pool]]\nname = \"p\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\n\
         [quota.default]\nregions = 2\n",
    ));
    let pool = Arc::clone(engine.pool("p").unwrap());
    let alice = Tenant::new(&engine, caller(1000, ":1.1"));
    let s = alice.open_session();
    let allocate = || engine.allocate(&alice.owner, &alice.limits, &alice.pools, s, "p", 4096);
    let mrs_before = engine.provider_counts().mrs;
    let first = allocate().unwrap();
    let held = engine.registry.region_mr(first.region).unwrap();
    alice.free(first.region).unwrap();
    assert_eq!(pool.stats().used, 4096, "its memory is still there");
    assert_eq!(engine.provider_counts().mrs, mrs_before + 1);
    assert_eq!(engine.releaser.kept(), 1);
    let second = allocate().unwrap();
    let refused = allocate().unwrap_err();
    assert!(matches!(refused, EngineError::Quota(_)), "{refused}");

    // The same when its session closes.
    let held_too = engine.registry.region_mr(second.region).unwrap();
    alice.close_session(s).unwrap();
    engine.settled();
    assert_eq!(pool.stats().used, 2 * 4096);
    let t = alice.open_session();
    let refused = engine
        .allocate(&alice.owner, &alice.limits, &alice.pools, t, "p", 4096)
        .unwrap_err();
    assert!(matches!(refused, EngineError::Quota(_)), "{refused}");

    drop(held);
    engine.settled();
    assert_eq!(pool.stats().used, 4096, "the first is gone");
    drop(held_too);
    let third = engine
        .allocate(&alice.owner, &alice.limits, &alice.pools, t, "p", 4096)
        .expect("the room the second held, given back before the allocation gives up");
    engine.settled();
    assert_eq!(pool.stats().used, 4096, "the third alone");
    assert_eq!(engine.provider_counts().mrs, mrs_before + 1);
    assert!(engine.registry.region_mr(third.region).is_some());

    // A request of a QP in the session's own domain holds the region's registration there,
    // which holds the same memory: the same.
    engine
        .register(
            &alice.owner,
            &alice.limits,
            third.region,
            1,
            crate::provider::Span {
                offset: 0,
                len: 4096,
                iova: 0x1000,
            },
            crate::provider::Access::LOCAL_WRITE,
        )
        .unwrap();
    let in_domain = {
        let s = engine.registry.lock();
        let mut registrations = Registry::registrations_of(&s, third.region);
        assert_eq!(registrations.len(), 1);
        registrations.remove(0).1
    };
    alice.free(third.region).unwrap();
    assert_eq!(
        pool.stats().used,
        4096,
        "held through its domain registration"
    );
    assert_eq!(engine.releaser.kept(), 1);
    drop(in_domain);
    engine.settled();
    assert_eq!(pool.stats().used, 0);
    assert_eq!(engine.releaser.kept(), 0);
    assert_eq!(engine.provider_counts().mrs, mrs_before);
}

/// `Free` returns while the region's registration is still being released (here the
/// release thread is held by a slow deregistration queued before it), and the quota and
/// the pool count the region until the release is done; an allocation that only this
/// not-yet-released memory refuses waits for it and succeeds, on both the quota and the
/// pool's capacity.
#[test]
fn free_returns_before_the_release_and_the_next_allocation_waits_for_it() {
    use crate::engine::releaser::{testing::slow_mr, Deferred};
    let engine = Arc::new(engine_on(
        ProviderChoice::Loopback,
        "[[pool]]\nname = \"p\"\ncapacity = \"1MiB\"\nsize_classes = [\"1MiB\"]\n\
         [quota.default]\nregions = 1\n",
    ));
    let pool = Arc::clone(engine.pool("p").unwrap());
    let alice = Tenant::new(&engine, caller(1000, ":1.1"));
    let s = alice.open_session();
    let allocate = |engine: &Engine| {
        engine.allocate(&alice.owner, &alice.limits, &alice.pools, s, "p", 1 << 20)
    };
    let first = allocate(&engine).unwrap();
    let (slow, go, dropped) = slow_mr();
    engine.releaser.release(Deferred {
        freed: vec![crate::engine::registry::Freed {
            mr: slow,
            domain_registrations: Vec::new(),
            settlement: None,
        }],
    });
    engine.free(&alice.owner, first.region).unwrap();
    assert!(engine.releases_pending());
    assert_eq!(pool.stats().used, 1 << 20, "counted until it is released");
    assert!(
        alice.session(s).unwrap().regions.is_empty(),
        "but out of the session at once"
    );

    let refused = alice.allocate(s, &pool, 1 << 20).unwrap_err();
    assert!(matches!(refused, EngineError::Quota(_)), "{refused}");

    std::thread::scope(|scope| {
        let second = scope.spawn(|| allocate(&engine));
        // It waits for the release (or, if it did not, has already answered).
        while engine.releaser.waiting() == 0 && !second.is_finished() {
            std::thread::yield_now();
        }
        go.send(()).unwrap();
        let second = second
            .join()
            .unwrap()
            .expect("the freed room is given to it");
        assert_ne!(second.region, first.region);
    });
    assert!(dropped.try_recv().is_ok());
    assert_eq!(pool.stats().used, 1 << 20, "one region, the second");
    assert!(!engine.releases_pending());
}
