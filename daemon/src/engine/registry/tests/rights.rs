//! The data-path rights snapshot a queue pair holds follows every change to its session's
//! rights, made under the registry's lock.

use super::*;

/// What a queue pair's worker would validate its next batch against: (region, writable).
fn seen(engine: &Engine, owner: &Caller, qp: QpId) -> Vec<(RegionId, bool)> {
    let record = engine.registry.own_qp(&owner.owner(), qp).unwrap();
    let mut rights: Vec<(RegionId, bool)> = record
        .rights
        .load()
        .iter()
        .map(|(id, r)| (*id, r.writable))
        .collect();
    rights.sort_unstable();
    rights
}

#[test]
fn a_queue_pair_sees_every_change_to_its_sessions_rights() {
    use crate::engine::qp::QpOptions;
    let (engine, config) = engine_on(ProviderChoice::Loopback, COLD_POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let alice = caller(1000, ":1.1");
    let bob = caller(1001, ":1.2");
    let open = |who: &Caller| {
        engine
            .registry
            .open_session(&who.owner(), &limits(&config, who))
            .unwrap()
    };
    let (sa, sb) = (open(&alice), open(&bob));
    let qp_of = |who: &Caller, s| {
        engine
            .create_qp(
                &who.owner(),
                &limits(&config, who),
                s,
                "loopback0",
                QpOptions::default(),
            )
            .unwrap()
            .id
    };
    let (qa, qb) = (qp_of(&alice, sa), qp_of(&bob, sb));
    let alloc = || {
        engine
            .registry
            .allocate(
                &alice.owner(),
                &limits(&config, &alice),
                &pools(&engine, &alice),
                sa,
                &pool,
                4096,
            )
            .unwrap()
            .region
    };
    let (r1, r2) = (alloc(), alloc());
    assert_eq!(seen(&engine, &alice, qa), [(r1, true), (r2, true)]);
    assert_eq!(seen(&engine, &bob, qb), []);

    let share = |region, mode| {
        engine
            .registry
            .share(&alice.owner(), &limits(&config, &alice), region, mode, None)
            .unwrap()
    };
    let (ro, ro_key) = share(r1, AttachMode::ReadOnly);
    let (rw, _) = share(r2, AttachMode::ReadWrite);
    for token in [&ro, &rw] {
        engine
            .registry
            .attach(&bob.owner(), &pools(&engine, &bob), sb, token)
            .unwrap();
    }
    assert_eq!(seen(&engine, &bob, qb), [(r1, false), (r2, true)]);

    // A revoked key leaves the live attachment.
    engine
        .registry
        .revoke(&alice.owner(), scope(&config, &alice), ro_key)
        .unwrap();
    assert_eq!(seen(&engine, &bob, qb), [(r1, false), (r2, true)]);

    engine.registry.detach(&bob.owner(), r1).unwrap();
    assert_eq!(seen(&engine, &bob, qb), [(r2, true)]);

    // Freed by its owner while attached elsewhere: gone for both.
    engine.free(&alice.owner(), r2).unwrap();
    assert_eq!(seen(&engine, &bob, qb), []);
    assert_eq!(seen(&engine, &alice, qa), [(r1, true)]);

    // A closed session's queue pairs touch nothing, even if someone still holds one.
    let held = engine.registry.own_qp(&alice.owner(), qa).unwrap();
    engine
        .close_session(&alice.owner(), scope(&config, &alice), sa)
        .unwrap();
    assert!(held.rights.load().is_empty());
}
