use super::*;
use crate::config::{Config, ProviderChoice};
use crate::engine::{Engine, ExportHandout, RemoteRights};
use crate::policy::Caller;
use nix::sys::uio::{pread, pwrite};
use std::path::PathBuf;
use std::time::Duration;

/// One body, two tests: `NAME` on loopback, `rxe_NAME` on rxe0 (VM tier).
macro_rules! on_both_providers {
    ($($name:ident / $rxe:ident),* $(,)?) => {$(
        #[test]
        fn $rxe() {
            bodies::$name(ProviderChoice::Verbs)
        }
        #[test]
        fn $name() {
            bodies::$name(ProviderChoice::Loopback)
        }
    )*};
}

on_both_providers!(
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
            std::thread::spawn(move || engine.registry.close_sessions_of(":1.1"))
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
        .registry
        .close_session(&carol.owner(), scope(&config, &carol), owner)
        .unwrap();
    assert_eq!(removed.regions, vec![region]);
}

/// Two queue pairs of `session` on loopback0, connected to each other.
fn connected_pair(engine: &Engine, owner: &Caller, session: SessionId) -> [QpId; 2] {
    use crate::engine::qp::QpOptions;
    use crate::provider::RemoteEndpoint;
    let device = &engine.devices()[0].device;
    let qps = [0, 1].map(|_| {
        engine
            .create_qp(
                &owner.owner(),
                &limits(&engine.config(), owner),
                session,
                "loopback0",
                QpOptions::default(),
            )
            .unwrap()
            .id
    });
    for (me, peer) in [(qps[0], qps[1]), (qps[1], qps[0])] {
        let peer = engine.registry.own_qp(&owner.owner(), peer).unwrap();
        let remote = RemoteEndpoint {
            gid: peer.local.gid,
            qp_num: peer.local.qp_num,
            psn: peer.local.psn,
            lid: peer.local.lid,
        };
        let record = engine.registry.own_qp(&owner.owner(), me).unwrap();
        record.connect(device.as_ref(), remote).unwrap();
    }
    qps
}

/// Exports are charged to their owner's `exports` quota, one per window: a second
/// export of the same region through the same QP is a window of its own. Releasing,
/// freeing the region, destroying the QP and closing the session each give the use
/// back, and another user's exports are not affected.
#[test]
fn exports_are_a_quota_given_back_by_every_release() {
    let (engine, config) = engine_on(
        ProviderChoice::Loopback,
        &format!("{COLD_POOL}[quota.default]\nexports = 2\n"),
    );
    let pool = Arc::clone(engine.pool("p").unwrap());
    let device = Arc::clone(&engine.devices()[0].device);
    let exports = |uid| engine.registry.usage(uid).get(QuotaKind::Exports);
    let alice = caller(1000, ":1.1");
    let bob = caller(1001, ":1.2");
    let s = engine
        .registry
        .open_session(&alice.owner(), &limits(&config, &alice))
        .unwrap();
    let qps = connected_pair(&engine, &alice, s);
    let region = || {
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
            .unwrap()
            .region
    };
    let r = region();
    let mws = device.object_counts().mws;

    let (first, _, rkey1, _) = engine
        .export_remote(
            &alice.owner(),
            &limits(&config, &alice),
            r,
            qps[0],
            REMOTE_WRITE,
        )
        .map(ExportHandout::parts)
        .unwrap();
    let (second, _, rkey2, _) = engine
        .export_remote(
            &alice.owner(),
            &limits(&config, &alice),
            r,
            qps[0],
            REMOTE_WRITE,
        )
        .map(ExportHandout::parts)
        .unwrap();
    assert_ne!(first, second, "a second export is an export of its own");
    assert_ne!(rkey1, rkey2, "with a window and an rkey of its own");
    assert_eq!(device.object_counts().mws, mws + 2);
    assert_eq!(exports(1000), 2);
    let refused = engine
        .export_remote(
            &alice.owner(),
            &limits(&config, &alice),
            r,
            qps[1],
            REMOTE_READ,
        )
        .map(ExportHandout::parts)
        .unwrap_err();
    assert!(matches!(refused, EngineError::Quota(_)), "{refused}");
    assert!(
        refused
            .to_string()
            .starts_with("quota exceeded: exports (memory windows) of user"),
        "{refused}"
    );
    assert!(
        refused
            .to_string()
            .contains("2 in use, 1 more requested, limit 2 (set by quota.default.exports)"),
        "{refused}"
    );
    assert_eq!(exports(1000), 2, "a refusal charges nothing");
    assert_eq!(
        device.object_counts().mws,
        mws + 2,
        "nor binds a window before the check"
    );

    // Another user exports as before.
    let sb = engine
        .registry
        .open_session(&bob.owner(), &limits(&config, &bob))
        .unwrap();
    let bob_qps = connected_pair(&engine, &bob, sb);
    let rb = engine
        .registry
        .allocate(
            &bob.owner(),
            &limits(&config, &bob),
            &pools(&engine, &bob),
            sb,
            &pool,
            4096,
        )
        .unwrap()
        .region;
    engine
        .export_remote(
            &bob.owner(),
            &limits(&config, &bob),
            rb,
            bob_qps[0],
            REMOTE_WRITE,
        )
        .map(ExportHandout::parts)
        .unwrap();
    assert_eq!(exports(1001), 1);

    // ReleaseExport gives one back.
    engine.release_export(&alice.owner(), r, first).unwrap();
    assert_eq!(exports(1000), 1);
    // Freeing the region gives back what was exported over it.
    engine
        .export_remote(
            &alice.owner(),
            &limits(&config, &alice),
            r,
            qps[1],
            REMOTE_READ,
        )
        .map(ExportHandout::parts)
        .unwrap();
    assert_eq!(exports(1000), 2);
    engine.registry.free(&alice.owner(), r).unwrap();
    assert_eq!(exports(1000), 0);
    // Destroying the QP gives back what was exported through it; the region stays.
    let r = region();
    let (through_destroyed, ..) = engine
        .export_remote(
            &alice.owner(),
            &limits(&config, &alice),
            r,
            qps[0],
            REMOTE_WRITE,
        )
        .map(ExportHandout::parts)
        .unwrap();
    engine
        .export_remote(
            &alice.owner(),
            &limits(&config, &alice),
            r,
            qps[1],
            REMOTE_WRITE,
        )
        .map(ExportHandout::parts)
        .unwrap();
    engine.registry.destroy_qp(&alice.owner(), qps[0]).unwrap();
    assert_eq!(exports(1000), 1);
    assert!(
        matches!(
            engine.release_export(&alice.owner(), r, through_destroyed),
            Err(EngineError::NoSuchObject(_))
        ),
        "an export of a destroyed QP is gone"
    );
    assert_eq!(exports(1000), 1, "and gives nothing back twice");
    // Closing the session gives back the rest.
    engine.registry.close_sessions_of(":1.1");
    assert_eq!(exports(1000), 0);
    assert!(engine.registry.usage(1000).is_zero());
    assert_eq!(exports(1001), 1, "bob's export is untouched");
    engine.registry.close_sessions_of(":1.2");
    assert_eq!(device.object_counts().mws, mws);
}

/// A window taken out of its queue pair (by `ReleaseExport`, or with a freed region)
/// keeps that queue pair alive until the window is dropped, even if the queue pair is
/// destroyed meanwhile: a QP destroyed with a type-2 window still bound blocks rxe for
/// ~50 s. Found by rdmad-fuzz-dbus (`Free` or `ReleaseExport` racing `Destroy`: the
/// loopback device's warning about it).
#[test]
fn windows_taken_out_keep_their_queue_pair_until_dropped() {
    let (engine, config) = engine_on(ProviderChoice::Loopback, COLD_POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let device = Arc::clone(&engine.devices()[0].device);
    let alice = caller(1000, ":1.1");
    let s = engine
        .registry
        .open_session(&alice.owner(), &limits(&config, &alice))
        .unwrap();
    let qps = connected_pair(&engine, &alice, s);
    let qps_alive = || device.object_counts().qps;
    assert_eq!(qps_alive(), 2);

    // ReleaseExport: the window is handed out, the QP destroyed before it is dropped.
    let region = engine
        .registry
        .allocate(
            &alice.owner(),
            &limits(&config, &alice),
            &pools(&engine, &alice),
            s,
            &pool,
            4096,
        )
        .unwrap()
        .region;
    let (export, ..) = engine
        .export_remote(
            &alice.owner(),
            &limits(&config, &alice),
            region,
            qps[0],
            REMOTE_WRITE,
        )
        .map(ExportHandout::parts)
        .unwrap();
    let (_, taken) = engine
        .registry
        .remove_export(&alice.owner(), region, export)
        .unwrap();
    engine.registry.destroy_qp(&alice.owner(), qps[0]).unwrap();
    assert_eq!(
        qps_alive(),
        2,
        "the QP outlives the window bound through it"
    );
    drop(taken);
    assert_eq!(qps_alive(), 1);

    // A freed region: its windows go with the garbage, the QP destroyed meanwhile.
    engine
        .export_remote(
            &alice.owner(),
            &limits(&config, &alice),
            region,
            qps[1],
            REMOTE_READ,
        )
        .map(ExportHandout::parts)
        .unwrap();
    let garbage = Registry::remove_region(&mut engine.registry.lock(), region).unwrap();
    engine.registry.destroy_qp(&alice.owner(), qps[1]).unwrap();
    assert_eq!(
        qps_alive(),
        1,
        "the QP outlives the window bound through it"
    );
    engine.registry.release(&[], garbage);
    assert_eq!(qps_alive(), 0);
    assert_eq!(device.object_counts().mws, 0);
}

/// A queue pair made on the device directly, served by no data-path worker, with a
/// registered buffer: the remote peer of a session's queue pair.
struct Peer {
    // Field order is drop order.
    qp: Arc<dyn crate::provider::QueuePair>,
    cq: Arc<dyn crate::provider::CompletionQueue>,
    mr: Arc<dyn MemoryRegion>,
}

impl Peer {
    /// Connects a new peer and `record` to each other.
    fn connect_to(entry: &DeviceEntry, record: &QueuePairRecord) -> Peer {
        use crate::memory::SharedMemory;
        use crate::provider::{Access, QpInit, RemoteEndpoint, RtrAttributes, RtsAttributes};
        let cq = entry.pd.create_cq(16).unwrap();
        let qp = entry
            .pd
            .create_qp(QpInit {
                send_cq: Arc::clone(&cq),
                recv_cq: Arc::clone(&cq),
                max_send_wr: 8,
                max_recv_wr: 8,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            })
            .unwrap();
        let memory = Arc::new(SharedMemory::create(c"peer", 4096).unwrap());
        let mr = entry.pd.register(memory, Access::LOCAL_WRITE).unwrap();
        let psn = 0x1234;
        record
            .connect(
                entry.device.as_ref(),
                RemoteEndpoint {
                    gid: record.local.gid,
                    qp_num: qp.qp_num(),
                    psn,
                    lid: record.local.lid,
                },
            )
            .unwrap();
        qp.to_init(record.local.port, Access::LOCAL_WRITE).unwrap();
        qp.to_rtr(
            &RemoteEndpoint {
                gid: record.local.gid,
                qp_num: record.local.qp_num,
                psn: record.local.psn,
                lid: record.local.lid,
            },
            &RtrAttributes {
                port: record.local.port,
                sgid_index: record.local.gid_index,
                path_mtu: record.local.mtu,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 12,
            },
        )
        .unwrap();
        qp.to_rts(&RtsAttributes {
            psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
        })
        .unwrap();
        Peer { qp, cq, mr }
    }

    /// RDMA WRITEs 8 bytes to `addr` through `rkey`; returns how the device answered.
    fn write(&self, addr: u64, rkey: u32) -> crate::provider::WcStatus {
        use crate::provider::{SendOp, SendWr, Sge};
        self.qp
            .post_send(&[SendWr {
                wr_id: 1,
                op: SendOp::Write {
                    remote_addr: addr,
                    rkey,
                    imm: None,
                },
                sges: vec![Sge {
                    addr: self.mr.addr(),
                    length: 8,
                    lkey: self.mr.lkey(),
                }],
                signaled: true,
            }])
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut wcs = Vec::new();
        while wcs.is_empty() {
            assert!(std::time::Instant::now() < deadline, "no completion");
            self.cq.poll(&mut wcs, 1).unwrap();
        }
        wcs[0].status
    }
}

/// On every path that ends an export's window — ReleaseExport, freeing the region,
/// destroying the queue pair, closing the session (its client died), closing every
/// session (shutdown) — the window is deallocated before the region's registration is
/// dropped, even while the queue pair it was bound through is still held elsewhere, as
/// by a data-path worker that did not let go of it in time. The peer's old rkey gets a
/// remote access error at once, the registration is really deregistered (nothing
/// lingers: the loopback device, like rxe, refuses to deregister an MR with a bound
/// window), and once the queue pair is let go of, nothing is left.
#[test]
fn windows_go_before_their_memory_on_every_path() {
    use crate::engine::qp::QpOptions;
    use crate::provider::WcStatus;
    let (engine, config) = engine_on(ProviderChoice::Loopback, COLD_POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let entry = &engine.devices()[0];
    let device = Arc::clone(&entry.device);
    let alice = caller(1000, ":1.1");
    let baseline = device.object_counts();
    for path in ["release", "free", "destroy", "close", "close all"] {
        let s = engine
            .registry
            .open_session(&alice.owner(), &limits(&config, &alice))
            .unwrap();
        let qp = engine
            .create_qp(
                &alice.owner(),
                &limits(&config, &alice),
                s,
                "loopback0",
                QpOptions::default(),
            )
            .unwrap()
            .id;
        let record = engine.registry.own_qp(&alice.owner(), qp).unwrap();
        let peer = Peer::connect_to(entry, &record);
        let region = engine
            .registry
            .allocate(
                &alice.owner(),
                &limits(&config, &alice),
                &pools(&engine, &alice),
                s,
                &pool,
                4096,
            )
            .unwrap()
            .region;
        let (export, addr, rkey, _) = engine
            .export_remote(
                &alice.owner(),
                &limits(&config, &alice),
                region,
                qp,
                REMOTE_WRITE,
            )
            .map(ExportHandout::parts)
            .unwrap();
        assert_eq!(peer.write(addr, rkey), WcStatus::Success, "{path}");
        let with_region = device.object_counts();
        match path {
            "release" => engine
                .release_export(&alice.owner(), region, export)
                .unwrap(),
            "free" => engine.registry.free(&alice.owner(), region).unwrap(),
            "destroy" => engine.registry.destroy_qp(&alice.owner(), qp).unwrap(),
            "close" => assert_eq!(engine.registry.close_sessions_of(":1.1").sessions, [s]),
            _ => assert_eq!(engine.registry.close_all().sessions, [s]),
        }
        let now = device.object_counts();
        assert_eq!(now.mws, baseline.mws, "{path}: the window is gone");
        assert!(
            engine.lingering().is_empty(),
            "{path}: {:?}",
            engine.lingering()
        );
        let region_gone = matches!(path, "free" | "close" | "close all");
        assert_eq!(
            now.mrs,
            with_region.mrs - u64::from(region_gone),
            "{path}: the region's registration is deregistered with it"
        );
        assert_eq!(
            now.qps, with_region.qps,
            "{path}: the queue pair is still held (by `record`, as by a slow worker)"
        );
        assert_eq!(
            peer.write(addr, rkey),
            WcStatus::RemoteAccessError,
            "{path}: the old rkey"
        );
        drop(record);
        drop(peer);
        engine.registry.close_sessions_of(":1.1");
        assert_eq!(device.object_counts(), baseline, "{path}: nothing is left");
    }
}

/// What a device refuses to destroy is not dropped on the floor: a registration whose
/// deregistration failed (here: a window still bound over it, which the registry never
/// lets happen by itself) is kept, counted, shown in the status line, and retried after
/// every teardown until the device accepts.
#[test]
fn a_refused_deregistration_lingers_and_is_retried() {
    use crate::engine::qp::QpOptions;
    use crate::provider::{ObjectKind, WcStatus};
    let (engine, config) = engine_on(ProviderChoice::Loopback, COLD_POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let entry = &engine.devices()[0];
    let device = Arc::clone(&entry.device);
    let alice = caller(1000, ":1.1");
    let baseline = device.object_counts();
    let s = engine
        .registry
        .open_session(&alice.owner(), &limits(&config, &alice))
        .unwrap();
    let qp = engine
        .create_qp(
            &alice.owner(),
            &limits(&config, &alice),
            s,
            "loopback0",
            QpOptions::default(),
        )
        .unwrap()
        .id;
    let record = engine.registry.own_qp(&alice.owner(), qp).unwrap();
    let peer = Peer::connect_to(entry, &record);
    let region = engine
        .registry
        .allocate(
            &alice.owner(),
            &limits(&config, &alice),
            &pools(&engine, &alice),
            s,
            &pool,
            4096,
        )
        .unwrap()
        .region;
    let (export, addr, rkey, _) = engine
        .export_remote(
            &alice.owner(),
            &limits(&config, &alice),
            region,
            qp,
            REMOTE_WRITE,
        )
        .map(ExportHandout::parts)
        .unwrap();
    // Keep the window, let go of the registration it is bound over, free the region.
    let (_, taken) = engine
        .registry
        .remove_export(&alice.owner(), region, export)
        .unwrap();
    let TakenWindow {
        window,
        bound_through,
        over,
    } = taken;
    drop(over);
    engine.registry.free(&alice.owner(), region).unwrap();
    let lingering = engine.lingering();
    assert_eq!(lingering.len(), 1, "{lingering:?}");
    let (name, l) = &lingering[0];
    assert_eq!(
        (name.as_str(), l.kind, l.len),
        ("loopback0", ObjectKind::Mr, 4096)
    );
    assert!(l.error.contains("ibv_dereg_mr"), "{}", l.error);
    assert_eq!(
        l.attempts, 2,
        "refused on the free, and by the retry after it"
    );
    assert!(
        engine
            .status_line()
            .contains("1 object the device refused to destroy"),
        "{}",
        engine.status_line()
    );
    assert_eq!(
        peer.write(addr, rkey),
        WcStatus::Success,
        "as on rxe, the window still works while the registration stays"
    );
    assert_eq!(engine.retry_lingering(), 1, "still refused");
    assert_eq!(engine.lingering()[0].1.attempts, 3);

    drop(window);
    drop(bound_through);
    drop(peer);
    drop(record);
    // The next teardown retries: the registration goes.
    engine.registry.close_sessions_of(":1.1");
    assert!(engine.lingering().is_empty());
    assert_eq!(device.object_counts(), baseline);
}

const POOL: &str = "[[pool]]\nname = \"p\"\ncapacity = \"64MiB\"\n\
                    size_classes = [\"4KiB\", \"1MiB\"]\nwarm = 2\n";

/// Without warm regions nothing happens in the background, so counts are exact.
const COLD_POOL: &str = "[[pool]]\nname = \"p\"\ncapacity = \"64MiB\"\n\
                         size_classes = [\"4KiB\", \"1MiB\"]\n";

mod bodies {
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
        engine.registry.free(&alice.owner(), kept.region).unwrap();

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
            engine.registry.free(&bob.owner(), h.region).unwrap();
        }
    }

    pub fn concurrent_requests_never_overshoot_a_quota(provider: ProviderChoice) {
        let (engine, config) =
            engine_on(provider, &format!("{POOL}[quota.default]\nregions = 10\n"));
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

        let removed = engine.registry.close_sessions_of(":1.1");
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
            engine.registry.free(&bob.owner(), a.region),
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
            engine
                .registry
                .close_session(&mallory.owner(), scope(&config, &mallory), s),
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
            .registry
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
}
