//! Turning a client's submission into a work request the device may run. The entry has
//! already been copied out of shared memory and decoded; here every local SGE is checked
//! against the regions the session may use — owned or attached read-write for anything the
//! device writes, read-only attachments only as a source — and translated to
//! `(daemon address, lkey)`.

use std::sync::Arc;

use rdmad_client::ring::{Opcode, Status, Submission};

use crate::engine::ids::DomainId;
use crate::engine::RegionId;
use crate::provider::{Access, MemoryRegion, RecvWr, SendOp, SendWr, Sge, Sges};

/// A region as a session may use it on the data path.
#[derive(Debug, Clone)]
pub struct RegionRight {
    /// Its registration in the daemon's protection domain: what queue pairs in that
    /// domain use.
    pub mr: Arc<dyn MemoryRegion>,
    /// Owned, or attached read-write.
    pub writable: bool,
    /// Its registrations in the session's own domains: what queue pairs in those domains
    /// use, each request inside one of them.
    pub in_domains: Vec<(DomainId, Arc<dyn MemoryRegion>)>,
}

/// What a session's QPs may touch, by region id (ids the daemon hands out, so a fast
/// hash that a client cannot steer is enough).
pub type RegionRights = rustc_hash::FxHashMap<RegionId, RegionRight>;

/// The registrations a request uses, kept inline for as many SGEs as a ring entry holds.
pub type Pins = smallvec::SmallVec<[Arc<dyn MemoryRegion>; 4]>;

/// A checked request on its own, with the registrations it uses ([`check`]).
#[cfg(test)]
#[derive(Debug)]
pub struct Checked {
    pub work: Work,
    pub pins: Pins,
}

#[cfg(test)]
#[derive(Debug)]
pub enum Work {
    Send(SendWr),
    Recv(RecvWr),
}

/// [`check_into`] for one request on its own.
#[cfg(test)]
pub fn check(
    s: &Submission,
    rights: &RegionRights,
    max_sge: u32,
    domain: Option<DomainId>,
    wr_id: u64,
) -> Result<Checked, Refusal> {
    let (mut sends, mut recvs) = (Vec::new(), Vec::new());
    let pins = check_into(s, rights, max_sge, domain, wr_id, (&mut sends, &mut recvs))?;
    let work = match (sends.pop(), recvs.pop()) {
        (Some(send), None) => Work::Send(send),
        (None, Some(recv)) => Work::Recv(recv),
        other => panic!("check_into staged {other:?}"),
    };
    Ok(Checked { work, pins })
}

/// Why a request was refused: the completion status and a detail code (the SGE index for
/// region errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub status: Status,
    pub detail: u32,
}

/// Refuses a request longer than `max_message`, the port's largest message, before the
/// device sees it (`LocalLengthError`, as the device itself would answer).
pub fn check_length(s: &Submission, max_message: u64) -> Result<(), Refusal> {
    let len: u64 = s.sges.iter().map(|sge| u64::from(sge.length)).sum();
    if len > max_message {
        return Err(Refusal {
            status: Status::LocalLengthError,
            detail: 0,
        });
    }
    Ok(())
}

/// The detail of an `InvalidEntry` refusal for a request with more SGEs than its queue pair
/// takes (its `max_sge` option): the ring format allows four, the QP may take fewer, and
/// the device would refuse the whole batch the request is posted in.
pub const TOO_MANY_SGES: u32 = 2;

/// Checks and translates `s`, for a queue pair that takes at most `max_sge` SGEs per
/// request and lives in the session's domain `domain` (or the daemon's, `None`), and
/// stages the request at the end of the batch of sends or of receives (built there, not
/// moved there: a request is over a hundred bytes). `wr_id` is the daemon's own id for
/// the request (the client's stays in the daemon's bookkeeping). Returns the registrations
/// the request uses, which must stay alive until it completes; a refused request stages
/// nothing.
pub fn check_into(
    s: &Submission,
    rights: &RegionRights,
    max_sge: u32,
    domain: Option<DomainId>,
    wr_id: u64,
    (sends, recvs): (&mut Vec<SendWr>, &mut Vec<RecvWr>),
) -> Result<Pins, Refusal> {
    if s.sges.len() > max_sge as usize {
        return Err(Refusal {
            status: Status::InvalidEntry,
            detail: TOO_MANY_SGES,
        });
    }
    let device_writes = matches!(
        s.opcode,
        Opcode::Read | Opcode::FetchAdd | Opcode::CompareSwap | Opcode::Recv
    );
    let mut sges = Sges::new();
    let mut pins = Pins::new();
    for (i, sge) in s.sges.iter().enumerate() {
        let denied = Refusal {
            status: Status::RegionAccessDenied,
            detail: i as u32,
        };
        let right = rights.get(&RegionId(sge.region)).ok_or(denied)?;
        if device_writes && !right.writable {
            return Err(denied);
        }
        let length = u64::from(sge.length);
        let mr = match domain {
            None => Some(&right.mr),
            // The registration in the queue pair's domain that holds the range, with the
            // local write right if the device writes.
            Some(d) => right
                .in_domains
                .iter()
                .find(|(id, mr)| {
                    *id == d
                        && mr.span().covers(sge.offset, length)
                        && (!device_writes || mr.access().contains(Access::LOCAL_WRITE))
                })
                .map(|(_, mr)| mr),
        }
        .ok_or(denied)?;
        let span = mr.span();
        if !span.covers(sge.offset, length) {
            return Err(denied);
        }
        sges.push(Sge {
            addr: mr.addr() + (sge.offset - span.offset as u64),
            length: sge.length,
            lkey: mr.lkey(),
        });
        pins.push(Arc::clone(mr));
    }
    let op = match s.opcode {
        Opcode::Recv => {
            recvs.push(RecvWr { wr_id, sges });
            return Ok(pins);
        }
        Opcode::Send => SendOp::Send { imm: s.imm },
        Opcode::Write => SendOp::Write {
            remote_addr: s.remote_addr,
            rkey: s.rkey,
            imm: s.imm,
        },
        Opcode::Read => SendOp::Read {
            remote_addr: s.remote_addr,
            rkey: s.rkey,
        },
        Opcode::FetchAdd => SendOp::FetchAdd {
            remote_addr: s.remote_addr,
            rkey: s.rkey,
            add: s.compare_add,
        },
        Opcode::CompareSwap => SendOp::CompareSwap {
            remote_addr: s.remote_addr,
            rkey: s.rkey,
            compare: s.compare_add,
            swap: s.swap,
        },
    };
    sends.push(SendWr {
        wr_id,
        op,
        sges,
        // Every request is signaled to the device: the daemon must see each one complete
        // to release what it pins; the client's `signaled` only decides whether the
        // client hears of it.
        signaled: true,
        inline: false,
    });
    Ok(pins)
}

/// Whether the device is handed `wr`'s bytes with the request: a SEND or WRITE of at most
/// `max_inline` bytes (the QP's `max_inline` option; 0 turns this off) and at least one.
pub fn goes_inline(wr: &SendWr, max_inline: u32) -> bool {
    let len = wr.message_len();
    matches!(wr.op, SendOp::Send { .. } | SendOp::Write { .. })
        && len > 0
        && len <= u64::from(max_inline)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::memory::SharedMemory;
    use crate::provider::loopback::LoopbackDevice;
    use crate::provider::{Access, Device};
    use rdmad_client::ring::RegionSge;

    /// Rights to two regions on a loopback device: 1 writable, 2 read-only, 8 KiB each;
    /// and their registrations, in that order.
    pub(in crate::engine::datapath) fn rights() -> (RegionRights, Vec<Arc<dyn MemoryRegion>>) {
        let dev = LoopbackDevice::new("lo-validate");
        let pd = dev.alloc_pd().unwrap();
        let mut rights = RegionRights::default();
        let mut mrs = Vec::new();
        for (id, writable) in [(1, true), (2, false)] {
            let mem = Arc::new(SharedMemory::create(c"v", 8192).unwrap());
            let mr = pd.register(mem, Access::LOCAL_WRITE).unwrap();
            mrs.push(Arc::clone(&mr));
            rights.insert(
                RegionId(id),
                RegionRight {
                    mr,
                    writable,
                    in_domains: Vec::new(),
                },
            );
        }
        (rights, mrs)
    }

    fn sub(opcode: Opcode, sges: &[(u64, u64, u32)]) -> Submission {
        Submission {
            opcode,
            wr_id: 5,
            signaled: false,
            imm: None,
            remote_addr: 0x1000,
            rkey: 9,
            compare_add: 1,
            swap: 2,
            sges: sges
                .iter()
                .map(|&(region, offset, length)| RegionSge {
                    region,
                    offset,
                    length,
                })
                .collect(),
        }
    }

    #[test]
    fn sges_translate_to_the_daemon_mapping_and_pin_their_region() {
        let (rights, mrs) = rights();
        let c = check(
            &sub(Opcode::Send, &[(1, 100, 8), (2, 8000, 192)]),
            &rights,
            4,
            None,
            42,
        )
        .unwrap();
        let Work::Send(wr) = c.work else { panic!() };
        assert_eq!(wr.wr_id, 42);
        assert!(wr.signaled, "the daemon always asks for completions");
        assert_eq!(
            wr.sges[0],
            Sge {
                addr: mrs[0].addr() + 100,
                length: 8,
                lkey: mrs[0].lkey()
            }
        );
        assert_eq!(wr.sges[1].lkey, mrs[1].lkey());
        assert_eq!(c.pins.len(), 2);
    }

    #[test]
    fn foreign_stale_or_out_of_bounds_regions_are_refused() {
        let (rights, _mrs) = rights();
        let denied = |detail| {
            Err(Refusal {
                status: Status::RegionAccessDenied,
                detail,
            })
        };
        for (s, detail) in [
            (sub(Opcode::Send, &[(1, 0, 8), (77, 0, 8)]), 1),
            (sub(Opcode::Send, &[(1, 8185, 8)]), 0),
            (sub(Opcode::Send, &[(1, u64::MAX, 8)]), 0),
            (sub(Opcode::Write, &[(1, 4096, 4097)]), 0),
        ] {
            assert_eq!(
                check(&s, &rights, 4, None, 1).map(|_| ()),
                denied(detail),
                "{s:?}"
            );
        }
    }

    #[test]
    fn read_only_attachments_are_only_sources() {
        let (rights, _mrs) = rights();
        assert!(check(&sub(Opcode::Send, &[(2, 0, 8)]), &rights, 4, None, 1).is_ok());
        assert!(check(&sub(Opcode::Write, &[(2, 0, 8)]), &rights, 4, None, 1).is_ok());
        for op in [
            Opcode::Recv,
            Opcode::Read,
            Opcode::FetchAdd,
            Opcode::CompareSwap,
        ] {
            let r = check(&sub(op, &[(2, 0, 8)]), &rights, 4, None, 1);
            assert_eq!(
                r.map(|_| ()).unwrap_err().status,
                Status::RegionAccessDenied,
                "{op:?}"
            );
            assert!(
                check(&sub(op, &[(1, 0, 8)]), &rights, 4, None, 1).is_ok(),
                "{op:?}"
            );
        }
    }

    /// A queue pair in one of its session's domains uses the registrations of that
    /// domain: an SGE inside one becomes the registration's address for that byte and its
    /// lkey; one inside none (or only in another domain's, or, for memory the device
    /// writes, only in one without local write) is refused.
    #[test]
    fn a_queue_pair_in_a_domain_uses_that_domains_registrations() {
        let (mut rights, mrs) = rights();
        let memory = Arc::clone(mrs[0].memory());
        let dev = LoopbackDevice::new("lo-validate-domains");
        let pd = dev.alloc_pd().unwrap();
        let span = |offset, len, iova| crate::provider::Span { offset, len, iova };
        let writable = pd
            .register_span(
                Arc::clone(&memory),
                span(4096, 2048, 0x9000),
                Access::LOCAL_WRITE,
            )
            .unwrap();
        let read_only = pd
            .register_span(memory, span(6144, 2048, 0x20000), Access::REMOTE_READ)
            .unwrap();
        rights.get_mut(&RegionId(1)).unwrap().in_domains = vec![
            (DomainId(7), Arc::clone(&writable)),
            (DomainId(7), Arc::clone(&read_only)),
        ];
        let c = check(
            &sub(Opcode::Recv, &[(1, 4100, 8)]),
            &rights,
            4,
            Some(DomainId(7)),
            1,
        )
        .unwrap();
        let Work::Recv(wr) = c.work else { panic!() };
        assert_eq!(
            wr.sges[0],
            Sge {
                addr: 0x9004,
                length: 8,
                lkey: writable.lkey()
            }
        );
        let c = check(
            &sub(Opcode::Send, &[(1, 6150, 8)]),
            &rights,
            4,
            Some(DomainId(7)),
            1,
        )
        .unwrap();
        let Work::Send(wr) = c.work else { panic!() };
        assert_eq!(
            (wr.sges[0].addr, wr.sges[0].lkey),
            (0x20006, read_only.lkey())
        );
        for (s, domain) in [
            (sub(Opcode::Send, &[(1, 100, 8)]), Some(DomainId(7))),
            (sub(Opcode::Send, &[(1, 6140, 8)]), Some(DomainId(7))),
            (sub(Opcode::Recv, &[(1, 6150, 8)]), Some(DomainId(7))),
            (sub(Opcode::Send, &[(1, 4100, 8)]), Some(DomainId(8))),
            (sub(Opcode::Send, &[(2, 0, 8)]), Some(DomainId(7))),
        ] {
            assert_eq!(
                check(&s, &rights, 4, domain, 1)
                    .map(|_| ())
                    .unwrap_err()
                    .status,
                Status::RegionAccessDenied,
                "{s:?} in {domain:?}"
            );
        }
    }

    /// A queue pair created with `max_sge` N takes requests of up to N SGEs; one with more
    /// is refused before the device sees it (the device would refuse the whole batch), on
    /// either queue, as `InvalidEntry` with the detail `TOO_MANY_SGES`.
    #[test]
    fn more_sges_than_the_queue_pairs_max_sge_are_refused() {
        let (rights, _mrs) = rights();
        let two = [(1, 0, 8), (1, 8, 8)];
        let three = [(1, 0, 8), (1, 8, 8), (1, 16, 8)];
        for op in [Opcode::Send, Opcode::Write, Opcode::Read, Opcode::Recv] {
            for max_sge in [2, 3, 4] {
                assert!(
                    check(&sub(op, &two), &rights, max_sge, None, 1).is_ok(),
                    "{op:?}"
                );
            }
            for max_sge in [1, 2] {
                assert_eq!(
                    check(&sub(op, &three), &rights, max_sge, None, 1).map(|_| ()),
                    Err(Refusal {
                        status: Status::InvalidEntry,
                        detail: TOO_MANY_SGES,
                    }),
                    "{op:?}, max_sge {max_sge}"
                );
            }
            assert!(
                check(&sub(op, &three), &rights, 3, None, 1).is_ok(),
                "{op:?}"
            );
        }
        assert!(
            check(&sub(Opcode::Send, &[]), &rights, 1, None, 1).is_ok(),
            "no SGE at all is a zero-length request"
        );
    }
}
