//! Exports: charged to their owner's quota, given back by every release.

use super::*;

/// Two queue pairs of `session` (`who`'s) on loopback0, connected to each other.
fn connected_pair(who: &Tenant, session: SessionId) -> [QpId; 2] {
    use crate::provider::RemoteEndpoint;
    let device = &who.engine.devices()[0].device;
    let qps = [0, 1].map(|_| who.create_qp(session));
    for (me, peer) in [(qps[0], qps[1]), (qps[1], qps[0])] {
        let peer = who.engine.registry.own_qp(&who.owner, peer).unwrap();
        let remote = RemoteEndpoint {
            gid: peer.local.gid,
            qp_num: peer.local.qp_num,
            psn: peer.local.psn,
            lid: peer.local.lid,
        };
        let record = who.engine.registry.own_qp(&who.owner, me).unwrap();
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
    let engine = engine_on(
        ProviderChoice::Loopback,
        &format!("{COLD_POOL}[quota.default]\nexports = 2\n"),
    );
    let pool = Arc::clone(engine.pool("p").unwrap());
    let device = Arc::clone(&engine.devices()[0].device);
    let exports = |uid| engine.registry.usage(uid).get(QuotaKind::Exports);
    let alice = Tenant::new(&engine, caller(1000, ":1.1"));
    let bob = Tenant::new(&engine, caller(1001, ":1.2"));
    let s = alice.open_session();
    let qps = connected_pair(&alice, s);
    let region = || alice.allocate(s, &pool, 4096).unwrap().region;
    let r = region();
    let mws = device.object_counts().mws;

    let (first, _, rkey1, _) = alice.export(r, qps[0], REMOTE_WRITE).unwrap();
    let (second, _, rkey2, _) = alice.export(r, qps[0], REMOTE_WRITE).unwrap();
    assert_ne!(first, second, "a second export is an export of its own");
    assert_ne!(rkey1, rkey2, "with a window and an rkey of its own");
    assert_eq!(device.object_counts().mws, mws + 2);
    assert_eq!(exports(1000), 2);
    let refused = alice.export(r, qps[1], REMOTE_READ).unwrap_err();
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
    let sb = bob.open_session();
    let bob_qps = connected_pair(&bob, sb);
    let rb = bob.allocate(sb, &pool, 4096).unwrap().region;
    bob.export(rb, bob_qps[0], REMOTE_WRITE).unwrap();
    assert_eq!(exports(1001), 1);

    // ReleaseExport gives one back.
    engine.release_export(&alice.owner, r, first).unwrap();
    assert_eq!(exports(1000), 1);
    // Freeing the region gives back what was exported over it.
    alice.export(r, qps[1], REMOTE_READ).unwrap();
    assert_eq!(exports(1000), 2);
    alice.free(r).unwrap();
    assert_eq!(exports(1000), 0);
    // Destroying the QP gives back what was exported through it; the region stays.
    let r = region();
    let (through_destroyed, ..) = alice.export(r, qps[0], REMOTE_WRITE).unwrap();
    alice.export(r, qps[1], REMOTE_WRITE).unwrap();
    engine.destroy_qp(&alice.owner, qps[0]).unwrap();
    assert_eq!(exports(1000), 1);
    assert!(
        matches!(
            engine.release_export(&alice.owner, r, through_destroyed),
            Err(EngineError::NoSuchObject(_))
        ),
        "an export of a destroyed QP is gone"
    );
    assert_eq!(exports(1000), 1, "and gives nothing back twice");
    // Closing the session gives back the rest.
    engine.close_sessions_of(":1.1");
    assert_eq!(exports(1000), 0);
    assert!(engine.registry.usage(1000).is_zero());
    assert_eq!(exports(1001), 1, "bob's export is untouched");
    engine.close_sessions_of(":1.2");
    assert_eq!(device.object_counts().mws, mws);
}

/// A window taken out of its queue pair (by `ReleaseExport`, or with a freed region)
/// keeps that queue pair alive until the window is dropped, even if the queue pair is
/// destroyed meanwhile: a QP destroyed with a type-2 window still bound blocks rxe for
/// ~50 s. Found by rdmad-fuzz-dbus (`Free` or `ReleaseExport` racing `Destroy`: the
/// loopback device's warning about it).
#[test]
fn windows_taken_out_keep_their_queue_pair_until_dropped() {
    let engine = engine_on(ProviderChoice::Loopback, COLD_POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let device = Arc::clone(&engine.devices()[0].device);
    let alice = Tenant::new(&engine, caller(1000, ":1.1"));
    let s = alice.open_session();
    let qps = connected_pair(&alice, s);
    let qps_alive = || device.object_counts().qps;
    assert_eq!(qps_alive(), 2);

    // ReleaseExport: the window is handed out, the QP destroyed before it is dropped.
    let region = alice.allocate(s, &pool, 4096).unwrap().region;
    let (export, ..) = alice.export(region, qps[0], REMOTE_WRITE).unwrap();
    let (_, taken) = engine
        .registry
        .remove_export(&alice.owner, region, export)
        .unwrap();
    engine.destroy_qp(&alice.owner, qps[0]).unwrap();
    assert_eq!(
        qps_alive(),
        2,
        "the QP outlives the window bound through it"
    );
    drop(taken);
    assert_eq!(qps_alive(), 1);

    // A freed region: its windows go with the garbage, the QP destroyed meanwhile.
    alice.export(region, qps[1], REMOTE_READ).unwrap();
    let garbage = Registry::remove_region(&mut engine.registry.lock(), region).unwrap();
    engine.destroy_qp(&alice.owner, qps[1]).unwrap();
    assert_eq!(
        qps_alive(),
        1,
        "the QP outlives the window bound through it"
    );
    engine.release(Teardown {
        removed: Removed::default(),
        garbage,
        releasing: Releasing {
            registry: &engine.registry,
            sessions: 0,
        },
    });
    assert_eq!(qps_alive(), 0);
    assert_eq!(device.object_counts().mws, 0);
}
