//! A submission entry as a hostile client could write it into its ring: decoded, then
//! checked against the regions of a session, exactly as the data-path worker does after
//! copying the slot out of shared memory.
//!
//! The input is one submission slot (192 bytes) followed by one completion slot, then one
//! byte whose low bit puts the queue pair in the session's domain 5 (whose registrations
//! cover parts of region 2) rather than the daemon's. Invariants checked for every input,
//! beyond "no panic":
//! - a decoded entry encodes back to an entry that decodes to the same submission;
//! - every accepted scatter/gather element lies inside a region the session may use, with
//!   that region's lkey (or, for a queue pair in a domain, inside one of that domain's
//!   registrations of the region, with its lkey and address), and memory the device
//!   writes is never a read-only attachment nor a registration without local write;
//! - no accepted request has more SGEs than its queue pair takes.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use rdmad::engine::testing::{check_into, DomainId, RegionRight, RegionRights};
use rdmad::engine::RegionId;
use rdmad::memory::SharedMemory;
use rdmad::provider::loopback::LoopbackDevice;
use rdmad::provider::{Access, Device, MemoryRegion, ProtectionDomain, Span};
use rdmad_client::ring::{Completion, Opcode, Submission, CQE_SIZE, SQE_SIZE};

struct Session {
    _pd: Arc<dyn ProtectionDomain>,
    rights: RegionRights,
}

const DOMAIN: DomainId = DomainId(5);

/// Three regions of different sizes: ids 1 and 2 writable, 3 a read-only attachment.
/// Region 2 has two registrations in domain 5: 8 KiB from offset 4096 (local write) and
/// 100 bytes from offset 20000 (no local write), under addresses of the client's.
fn session() -> &'static Session {
    static SESSION: OnceLock<Session> = OnceLock::new();
    SESSION.get_or_init(|| {
        let pd = LoopbackDevice::new("fuzz0").alloc_pd().unwrap();
        let mut rights = RegionRights::default();
        for (id, len, writable) in [(1u64, 4096, true), (2, 65536, true), (3, 8192, false)] {
            let memory = Arc::new(SharedMemory::create(c"fuzz", len).unwrap());
            let mr = pd
                .register(Arc::clone(&memory), Access::LOCAL_WRITE)
                .unwrap();
            let in_domains = if id == 2 {
                [
                    (4096, 8192, 0x7f00_0000_1000, Access::LOCAL_WRITE),
                    (20000, 100, 0x10, Access::REMOTE_READ),
                ]
                .into_iter()
                .map(|(offset, len, iova, access)| {
                    let span = Span { offset, len, iova };
                    let mr = pd.register_span(Arc::clone(&memory), span, access).unwrap();
                    (DOMAIN, mr)
                })
                .collect()
            } else {
                Vec::new()
            };
            rights.insert(
                RegionId(id),
                RegionRight {
                    mr,
                    writable,
                    in_domains,
                },
            );
        }
        Session { _pd: pd, rights }
    })
}

fn inside(mr: &Arc<dyn MemoryRegion>, addr: u64, length: u32) -> bool {
    addr >= mr.addr() && addr + u64::from(length) <= mr.addr() + mr.len() as u64
}

fuzz_target!(|data: &[u8]| {
    let mut sqe = [0u8; SQE_SIZE];
    let n = data.len().min(SQE_SIZE);
    sqe[..n].copy_from_slice(&data[..n]);
    if let Some(rest) = data.get(SQE_SIZE..) {
        let mut cqe = [0u8; CQE_SIZE];
        let m = rest.len().min(CQE_SIZE);
        cqe[..m].copy_from_slice(&rest[..m]);
        if let Some(c) = Completion::decode(&cqe) {
            assert_eq!(Completion::decode(&c.encode()), Some(c));
        }
    }

    let Ok(sub) = Submission::decode(&sqe) else {
        return;
    };
    assert_eq!(Submission::decode(&sub.encode()).as_ref(), Ok(&sub));

    let session = session();
    let device_writes = matches!(
        sub.opcode,
        Opcode::Read | Opcode::FetchAdd | Opcode::CompareSwap | Opcode::Recv
    );
    // A queue pair that takes fewer SGEs than the ring format allows, so both sides of
    // the limit are reached.
    let max_sge = 3;
    let domain = data
        .get(SQE_SIZE + CQE_SIZE)
        .is_some_and(|b| b & 1 == 1)
        .then_some(DOMAIN);
    let (mut sends, mut recvs) = (Vec::new(), Vec::new());
    let checked = check_into(
        &sub,
        &session.rights,
        max_sge,
        domain,
        7,
        (&mut sends, &mut recvs),
    );
    let Ok(pins) = checked else {
        assert!(
            sends.is_empty() && recvs.is_empty(),
            "a refused request was staged"
        );
        return;
    };
    assert!(sub.sges.len() <= max_sge as usize, "{sub:?}");
    let sges = match (&sends[..], &recvs[..]) {
        ([w], []) => {
            assert_ne!(sub.opcode, Opcode::Recv);
            &w.sges
        }
        ([], [w]) => {
            assert_eq!(sub.opcode, Opcode::Recv);
            &w.sges
        }
        _ => panic!("not exactly one request staged: {sub:?}"),
    };
    assert_eq!(sges.len(), sub.sges.len());
    assert_eq!(pins.len(), sub.sges.len());
    for (sge, asked) in sges.iter().zip(&sub.sges) {
        let right = &session.rights[&RegionId(asked.region)];
        assert!(right.writable || !device_writes, "{sub:?}");
        let mr = match domain {
            None => &right.mr,
            Some(d) => {
                let (id, mr) = right
                    .in_domains
                    .iter()
                    .find(|(_, mr)| mr.lkey() == sge.lkey)
                    .unwrap_or_else(|| panic!("not a registration of the region: {sub:?}"));
                assert_eq!(*id, d);
                assert!(
                    !device_writes || mr.access().contains(Access::LOCAL_WRITE),
                    "{sub:?}"
                );
                // The address names the same byte of the region as the request did.
                assert_eq!(
                    sge.addr - mr.addr() + mr.span().offset as u64,
                    asked.offset,
                    "{sub:?}"
                );
                mr
            }
        };
        assert!(inside(mr, sge.addr, sge.length), "{sub:?}");
        assert_eq!(sge.lkey, mr.lkey());
    }
});
