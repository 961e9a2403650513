//! Registrations in sessions' own protection domains: what a verbs program's `ibv_reg_mr`
//! becomes. Their rkeys work before any queue pair is connected, only through the
//! session's queue pairs in the same domain, and die with the registration.

use std::time::Duration;

use rdmad_client::queue_pair::QueuePairRing;
use rdmad_client::ring::{Completion, Opcode, RegionSge, Status, Submission};

use super::*;
use crate::engine::datapath::tests::ring_of;
use crate::engine::qp::QpOptions;
use crate::provider::{Access, RemoteEndpoint, Span};

crate::on_both_providers!(
    a_domain_registration_is_reached_only_through_its_domain
        / rxe_a_domain_registration_is_reached_only_through_its_domain,
);

/// A queue pair of `who`'s `session` on the engine's device, in `domain` if one is given,
/// and its ring.
fn qp_in(who: &Tenant, session: SessionId, domain: Option<u32>) -> (QpId, QueuePairRing) {
    let device = who.engine.devices()[0].device.name().to_owned();
    let id = who
        .engine
        .create_qp(
            &who.owner,
            &who.limits,
            session,
            &device,
            QpOptions {
                domain,
                ..QpOptions::default()
            },
        )
        .unwrap()
        .id;
    let ring = ring_of(&who.engine.registry.own_qp(&who.owner, id).unwrap());
    (id, ring)
}

/// Connects `a` (of `x`) and `b` (of `y`) to each other.
fn connect(x: &Tenant, a: QpId, y: &Tenant, b: QpId) {
    let device = &x.engine.devices()[0].device;
    let qa = x.engine.registry.own_qp(&x.owner, a).unwrap();
    let qb = y.engine.registry.own_qp(&y.owner, b).unwrap();
    for (me, peer) in [(&qa, &qb), (&qb, &qa)] {
        let remote = RemoteEndpoint {
            gid: peer.local.gid,
            qp_num: peer.local.qp_num,
            psn: peer.local.psn,
            lid: peer.local.lid,
        };
        me.connect(device.as_ref(), remote).unwrap();
    }
}

fn completion(ring: &mut QueuePairRing) -> Completion {
    ring.wait(Duration::from_secs(60))
        .unwrap()
        .expect("a completion within 60 s")
}

fn write(from: (u64, u64, u32), remote_addr: u64, rkey: u32) -> Submission {
    let (region, offset, length) = from;
    let mut s = Submission::new(
        Opcode::Write,
        1,
        RegionSge {
            region,
            offset,
            length,
        },
    );
    s.remote_addr = remote_addr;
    s.rkey = rkey;
    s
}

fn register(
    who: &Tenant,
    region: RegionId,
    domain: u32,
    span: Span,
    access: Access,
) -> Result<RegistrationHandout, EngineError> {
    who.engine
        .register(&who.owner, &who.limits, region, domain, span, access)
}

mod bodies {
    use super::*;

    /// Alice registers part of a region in her domain 1 under an address of her own, with
    /// remote write. Bob, whose queue pair is connected to Alice's queue pair in domain 1,
    /// writes there through the rkey, and the bytes land at the registration's offset; the
    /// same rkey through Bob's queue pair connected to Alice's other queue pair (the
    /// daemon's domain) reaches nothing. Alice's domain-1 queue pair reads into the
    /// registration, and not outside it. A second registration past the quota is refused;
    /// after `Deregister` the rkey reaches nothing; closing the sessions leaves no device
    /// object behind (the domain's protection domain included).
    pub fn a_domain_registration_is_reached_only_through_its_domain(provider: ProviderChoice) {
        let engine = engine_on(
            provider,
            &format!("{COLD_POOL}[quota.default]\nregistrations = 1\n"),
        );
        let pool = Arc::clone(engine.pool("p").unwrap());
        let device = Arc::clone(&engine.devices()[0].device);
        let baseline = device.object_counts();
        let [(alice, sa), (bob, sb)] = alice_and_bob(&engine);

        let region = alice.allocate(sa, &pool, 4096).unwrap().region;
        const IOVA: u64 = 0x5000_0400;
        let span = Span {
            offset: 1024,
            len: 2048,
            iova: IOVA,
        };
        let reg = register(
            &alice,
            region,
            1,
            span,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
        let refused = register(&alice, region, 1, span, Access::LOCAL_WRITE).unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("registrations in protection domains of its own of user")
                && refused.to_string().contains("limit 1"),
            "{refused}"
        );
        let refused = register(&bob, region, 1, span, Access::LOCAL_WRITE).unwrap_err();
        assert!(
            matches!(refused, EngineError::NotAuthorized(_)),
            "{refused}"
        );

        let (a1, mut ring_a1) = qp_in(&alice, sa, Some(1));
        let (a0, _ring_a0) = qp_in(&alice, sa, None);
        let (b1, mut ring_b1) = qp_in(&bob, sb, None);
        let (b0, mut ring_b0) = qp_in(&bob, sb, None);
        connect(&alice, a1, &bob, b1);
        connect(&alice, a0, &bob, b0);

        let bob_region = bob.allocate(sb, &pool, 4096).unwrap();
        let bob_mr = engine.registry.region_mr(bob_region.region).unwrap();
        bob_mr.memory().write_at(0, b"from bob").unwrap();
        let alice_mr = engine.registry.region_mr(region).unwrap();
        let read = |offset: usize, len: usize| -> Vec<u8> {
            let mut buf = vec![0u8; len];
            alice_mr.memory().read_at(offset, &mut buf).unwrap();
            buf
        };

        // Through the domain's queue pair: lands at the registration's offset.
        let from = (bob_region.region.0, 0, 8);
        ring_b1
            .submit(&write(from, IOVA + 16, reg.rkey))
            .unwrap()
            .unwrap();
        assert_eq!(completion(&mut ring_b1).status, Status::Success);
        assert_eq!(read(1024 + 16, 8), b"from bob");

        // Through a queue pair of the daemon's domain: nothing.
        ring_b0
            .submit(&write(from, IOVA + 32, reg.rkey))
            .unwrap()
            .unwrap();
        assert_eq!(completion(&mut ring_b0).status, Status::RemoteAccessError);
        assert_eq!(read(1024 + 32, 8), [0u8; 8]);

        // Alice's domain-1 queue pair reads Bob's export into the registration; a read
        // into the region outside it is refused before the device.
        let export = bob
            .export(bob_region.region, b1, REMOTE_READ)
            .expect("export through Bob's queue pair");
        for (wr_id, offset, status) in [
            (7, 1024 + 100, Status::Success),
            (8, 0, Status::RegionAccessDenied),
        ] {
            let mut s = Submission::new(
                Opcode::Read,
                wr_id,
                RegionSge {
                    region: region.0,
                    offset,
                    length: 8,
                },
            );
            s.remote_addr = export.1;
            s.rkey = export.2;
            ring_a1.submit(&s).unwrap().unwrap();
            let c = completion(&mut ring_a1);
            assert_eq!((c.wr_id, c.status), (wr_id, status));
        }
        assert_eq!(read(1024 + 100, 8), b"from bob");
        assert_eq!(read(0, 8), [0u8; 8]);

        // Deregistered: the rkey reaches nothing, and the quota is given back.
        engine
            .deregister(&alice.owner, region, reg.registration)
            .unwrap();
        bob_mr.memory().write_at(0, b"too late").unwrap();
        ring_b1
            .submit(&write(from, IOVA + 48, reg.rkey))
            .unwrap()
            .unwrap();
        assert_eq!(completion(&mut ring_b1).status, Status::RemoteAccessError);
        assert_eq!(read(1024 + 48, 8), [0u8; 8]);
        assert_eq!(engine.registry.usage(1000).get(QuotaKind::Registrations), 0);
        let again = register(&alice, region, 1, span, Access::LOCAL_WRITE).unwrap();
        let refused = engine
            .deregister(&bob.owner, region, again.registration)
            .unwrap_err();
        assert!(
            matches!(refused, EngineError::NotAuthorized(_)),
            "{refused}"
        );

        // Freeing the region takes its registrations; closing the session, those of the
        // regions it still holds, and its domains.
        alice.free(region).unwrap();
        let registrations = || engine.registry.usage(1000).get(QuotaKind::Registrations);
        assert_eq!(registrations(), 0);
        let kept = alice.allocate(sa, &pool, 4096).unwrap().region;
        register(&alice, kept, 2, span, Access::LOCAL_WRITE).unwrap();
        assert_eq!(registrations(), 1);
        drop((ring_a1, ring_b1, ring_b0, alice_mr, bob_mr));
        alice.close_session(sa).unwrap();
        bob.close_session(sb).unwrap();
        engine.settled();
        assert_eq!(registrations(), 0);
        assert_eq!(device.object_counts(), baseline);
    }
}
