use super::*;
use crate::config::{Config, ProviderChoice};
use crate::engine::{Engine, ExportHandout, RemoteRights};
use crate::policy::Caller;
use nix::sys::uio::{pread, pwrite};
use std::path::PathBuf;
use std::time::Duration;

mod bodies;
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

fn engine_on(provider: ProviderChoice, text: &str) -> (Engine, Config) {
    let config = Config::parse(std::path::Path::new("t.toml"), text).unwrap();
    let engine = Engine::start(config.clone(), PathBuf::from("/dev/null"), Some(provider)).unwrap();
    (engine, config)
}

/// What the policy layer makes of `who` under `config`: its limits, scope and pool access.
fn limits(config: &Config, who: &Caller) -> Limits {
    crate::policy::limits(who, config)
}

fn scope(config: &Config, who: &Caller) -> Scope {
    crate::policy::scope(who, config)
}

fn pools(engine: &Engine, who: &Caller) -> PoolAccess {
    crate::policy::pool_access(who, &engine.pool_configs())
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

/// A session whose connection left counts as a session until everything it held is
/// released, so that an observer who sees the count drop (`ObjectCounts`, tests waiting
/// for a killed client's session to go) also sees its queue pairs and memory released.
#[test]
fn a_closing_session_counts_until_its_objects_are_released() {
    use crate::engine::qp::QpOptions;
    let (engine, config) = engine_on(ProviderChoice::Loopback, COLD_POOL);
    let engine = Arc::new(engine);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let device = Arc::clone(&engine.devices()[0].device);
    let baseline = device.object_counts();
    for round in 0..100 {
        let alice = caller(1000, ":1.1");
        let s = engine
            .registry
            .open_session(&alice.owner(), &limits(&config, &alice))
            .unwrap();
        engine
            .create_qp(
                &alice.owner(),
                &limits(&config, &alice),
                s,
                "loopback0",
                QpOptions::default(),
            )
            .unwrap();
        engine
            .registry
            .allocate(
                &alice.owner(),
                &limits(&config, &alice),
                &pools(&engine, &alice),
                s,
                &pool,
                4096,
            )
            .unwrap();
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
    let (engine, config) = engine_on(
        ProviderChoice::Loopback,
        "[daemon]\nadmin_group = \"root\"\n\n[[pool]]\nname = \"acl\"\n\
         capacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\nusers = [\"root\"]\n\
         groups = [\"root\"]\n",
    );
    let pool = Arc::clone(engine.pool("acl").unwrap());
    let root = caller(0, ":1.0");
    // Not root, but in the administrators' group (and the pool's).
    let carol = Caller {
        gids: vec![0],
        ..caller(1002, ":1.3")
    };
    let owner = engine
        .registry
        .open_session(&root.owner(), &limits(&config, &root))
        .unwrap();
    let region = engine
        .registry
        .allocate(
            &root.owner(),
            &limits(&config, &root),
            &pools(&engine, &root),
            owner,
            &pool,
            4096,
        )
        .unwrap()
        .region;
    let (token, key) = engine
        .registry
        .share(
            &root.owner(),
            &limits(&config, &root),
            region,
            AttachMode::ReadOnly,
            None,
        )
        .unwrap();
    let attacher = engine
        .registry
        .open_session(&carol.owner(), &limits(&config, &carol))
        .unwrap();
    let handout = engine
        .registry
        .attach(&carol.owner(), &pools(&engine, &carol), attacher, &token)
        .unwrap();
    assert_eq!(handout.region, region, "the pool's group lets carol attach");
    assert_eq!(
        engine
            .registry
            .session(&carol.owner(), scope(&config, &carol), owner)
            .unwrap()
            .uid,
        0,
        "an administrator reads another user's session"
    );
    engine
        .registry
        .quota(&crate::policy::limits_of(&carol, &config, 0).unwrap());
    engine
        .registry
        .revoke(&carol.owner(), scope(&config, &carol), key)
        .unwrap();
    let removed = engine
        .close_session(&carol.owner(), scope(&config, &carol), owner)
        .unwrap();
    assert_eq!(removed.regions, vec![region]);
}

const POOL: &str = "[[pool]]\nname = \"p\"\ncapacity = \"64MiB\"\n\
                    size_classes = [\"4KiB\", \"1MiB\"]\nwarm = 2\n";

/// Without warm regions nothing happens in the background, so counts are exact.
const COLD_POOL: &str = "[[pool]]\nname = \"p\"\ncapacity = \"64MiB\"\n\
                         size_classes = [\"4KiB\", \"1MiB\"]\n";
