//! The data-path rights snapshot a queue pair holds follows every change to its session's
//! rights, made under the registry's lock.

use super::*;

/// What a queue pair's worker would validate its next batch against: (region, writable).
fn seen(who: &Tenant, qp: QpId) -> Vec<(RegionId, bool)> {
    let record = who.engine.registry.own_qp(&who.owner, qp).unwrap();
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
    let engine = engine_on(ProviderChoice::Loopback, COLD_POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let [(alice, sa), (bob, sb)] = alice_and_bob(&engine);
    let (qa, qb) = (alice.create_qp(sa), bob.create_qp(sb));
    let alloc = || alice.allocate(sa, &pool, 4096).unwrap().region;
    let (r1, r2) = (alloc(), alloc());
    assert_eq!(seen(&alice, qa), [(r1, true), (r2, true)]);
    assert_eq!(seen(&bob, qb), []);

    let share = |region, mode| alice.share(region, mode, None).unwrap();
    let (ro, ro_key) = share(r1, AttachMode::ReadOnly);
    let (rw, _) = share(r2, AttachMode::ReadWrite);
    for token in [&ro, &rw] {
        bob.attach(sb, token).unwrap();
    }
    assert_eq!(seen(&bob, qb), [(r1, false), (r2, true)]);

    // A revoked key leaves the live attachment.
    alice.revoke(ro_key).unwrap();
    assert_eq!(seen(&bob, qb), [(r1, false), (r2, true)]);

    engine.registry.detach(&bob.owner, r1).unwrap();
    assert_eq!(seen(&bob, qb), [(r2, true)]);

    // Freed by its owner while attached elsewhere: gone for both.
    alice.free(r2).unwrap();
    assert_eq!(seen(&bob, qb), []);
    assert_eq!(seen(&alice, qa), [(r1, true)]);

    // A closed session's queue pairs touch nothing, even if someone still holds one.
    let held = engine.registry.own_qp(&alice.owner, qa).unwrap();
    alice.close_session(sa).unwrap();
    assert!(held.rights.load().is_empty());
}
