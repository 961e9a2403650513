//! A submission entry as a hostile client could write it into its ring: decoded, then
//! checked against the regions of a session, exactly as the data-path worker does after
//! copying the slot out of shared memory.
//!
//! The input is one submission slot (192 bytes) followed by one completion slot. Invariants
//! checked for every input, beyond "no panic":
//! - a decoded entry encodes back to an entry that decodes to the same submission;
//! - every accepted scatter/gather element lies inside a region the session may use, with
//!   that region's lkey, and memory the device writes is never a read-only attachment;
//! - no accepted request has more SGEs than its queue pair takes.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use rdmad::engine::testing::{check, RegionRight, RegionRights, Work};
use rdmad::engine::RegionId;
use rdmad::memory::SharedMemory;
use rdmad::provider::loopback::LoopbackDevice;
use rdmad::provider::{Access, Device, MemoryRegion, ProtectionDomain};
use rdmad_client::ring::{Completion, Opcode, Submission, CQE_SIZE, SQE_SIZE};

struct Session {
    _pd: Arc<dyn ProtectionDomain>,
    rights: RegionRights,
}

/// Three regions of different sizes: ids 1 and 2 writable, 3 a read-only attachment.
fn session() -> &'static Session {
    static SESSION: OnceLock<Session> = OnceLock::new();
    SESSION.get_or_init(|| {
        let pd = LoopbackDevice::new("fuzz0").alloc_pd().unwrap();
        let mut rights = RegionRights::new();
        for (id, len, writable) in [(1u64, 4096, true), (2, 65536, true), (3, 8192, false)] {
            let memory = Arc::new(SharedMemory::create(c"fuzz", len).unwrap());
            let mr = pd.register(memory, Access::LOCAL_WRITE).unwrap();
            rights.insert(RegionId(id), RegionRight { mr, writable });
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
    let Ok(checked) = check(&sub, &session.rights, max_sge, 7) else {
        return;
    };
    assert!(sub.sges.len() <= max_sge as usize, "{sub:?}");
    let sges = match &checked.work {
        Work::Send(w) => {
            assert_ne!(sub.opcode, Opcode::Recv);
            &w.sges
        }
        Work::Recv(w) => {
            assert_eq!(sub.opcode, Opcode::Recv);
            &w.sges
        }
    };
    assert_eq!(sges.len(), sub.sges.len());
    assert_eq!(checked.pins.len(), sub.sges.len());
    for (sge, asked) in sges.iter().zip(&sub.sges) {
        let right = &session.rights[&RegionId(asked.region)];
        assert!(inside(&right.mr, sge.addr, sge.length), "{sub:?}");
        assert_eq!(sge.lkey, right.mr.lkey());
        assert!(right.writable || !device_writes, "{sub:?}");
    }
});
