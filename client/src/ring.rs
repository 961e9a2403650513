//! The shared-memory rings of a queue pair: the layout both sides agree on, and the
//! encoding of entries. A QP's ring memory is one memfd holding a header, a submission
//! ring (client → daemon) and a completion ring (daemon → client): single producer, single
//! consumer, free-running `u32` head and tail indices published with release stores and
//! read with acquire loads, in the manner of io_uring. Work requests name memory as
//! `(region id, offset, length)`, never as pointers.
//!
//! Everything in this memory is untrusted by the side reading it: the daemon copies an
//! entry out before decoding it ([`Submission::decode`] checks every field), keeps its own
//! copy of the indices, and treats an impossible tail as a protocol error.

/// `"RDQ1"`.
pub const MAGIC: u32 = 0x5244_5131;
/// 2: the client's `CQ_FLAGS` word ([`CQ_NEED_WAKEUP`]); a version-1 client would never be
/// woken.
pub const VERSION: u32 = 2;

/// Scatter/gather elements per work request.
pub const MAX_SGE: usize = 4;

/// Bytes per submission entry and per completion entry.
pub const SQE_SIZE: usize = 192;
pub const CQE_SIZE: usize = 32;

/// Offsets of the header fields. Each index lives on its own 64-byte cache line.
pub mod header {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 4;
    pub const SQ_ENTRIES: usize = 8;
    pub const CQ_ENTRIES: usize = 12;
    pub const SQ_OFFSET: usize = 16;
    pub const CQ_OFFSET: usize = 20;
    /// Next submission the daemon will consume (written by the daemon).
    pub const SQ_HEAD: usize = 64;
    /// Next free submission slot (written by the client).
    pub const SQ_TAIL: usize = 128;
    /// [`super::SQ_NEED_WAKEUP`] (written by the daemon).
    pub const SQ_FLAGS: usize = 192;
    /// Next completion the client will consume (written by the client).
    pub const CQ_HEAD: usize = 256;
    /// Next free completion slot (written by the daemon).
    pub const CQ_TAIL: usize = 320;
    /// Completions the daemon holds back because the completion ring is full (daemon).
    pub const CQ_OVERFLOW: usize = 384;
    /// [`super::CQ_NEED_WAKEUP`] (written by the client).
    pub const CQ_FLAGS: usize = 448;
    pub const SIZE: usize = 512;
}

/// Set by the daemon when its worker sleeps: the client must write a byte to the doorbell
/// pipe after publishing submissions (otherwise the busy worker will see them anyway).
pub const SQ_NEED_WAKEUP: u32 = 1;

/// Set by the daemon while it holds completions back because the completion ring is full
/// (it then also stops taking submissions): the client writes the doorbell after it makes
/// room, or the daemon looks again only after a while.
pub const CQ_WAITING: u32 = 2;

/// Set by the client in `CQ_FLAGS` before it sleeps on the completion channel: the daemon
/// writes the channel after publishing completions only while it is set (a spinning
/// client sees them anyway, and costs the daemon no system call).
pub const CQ_NEED_WAKEUP: u32 = 1;

/// Where everything lies in a ring memfd with the given depths (powers of two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub sq_entries: u32,
    pub cq_entries: u32,
}

impl Layout {
    /// The layout for `sq_entries` submissions and `cq_entries` completions, each rounded
    /// up to a power of two; `None` if a depth is 0 or too large (more than 65536).
    pub fn new(sq_entries: u32, cq_entries: u32) -> Option<Layout> {
        let round = |n: u32| (1..=65536).contains(&n).then(|| n.next_power_of_two());
        Some(Layout {
            sq_entries: round(sq_entries)?,
            cq_entries: round(cq_entries)?,
        })
    }

    pub fn sq_offset(&self) -> usize {
        header::SIZE
    }

    pub fn cq_offset(&self) -> usize {
        (self.sq_offset() + self.sq_entries as usize * SQE_SIZE).next_multiple_of(64)
    }

    /// Bytes of the whole memfd, a multiple of the page size.
    pub fn size(&self) -> usize {
        (self.cq_offset() + self.cq_entries as usize * CQE_SIZE).next_multiple_of(4096)
    }

    /// Offset of submission slot `index` (any free-running index).
    pub fn sqe(&self, index: u32) -> usize {
        self.sq_offset() + (index & (self.sq_entries - 1)) as usize * SQE_SIZE
    }

    /// Offset of completion slot `index` (any free-running index).
    pub fn cqe(&self, index: u32) -> usize {
        self.cq_offset() + (index & (self.cq_entries - 1)) as usize * CQE_SIZE
    }

    /// The header fields the daemon writes once, at creation.
    pub fn header_words(&self) -> [(usize, u32); 6] {
        [
            (header::MAGIC, MAGIC),
            (header::VERSION, VERSION),
            (header::SQ_ENTRIES, self.sq_entries),
            (header::CQ_ENTRIES, self.cq_entries),
            (header::SQ_OFFSET, self.sq_offset() as u32),
            (header::CQ_OFFSET, self.cq_offset() as u32),
        ]
    }
}

/// What a submission asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opcode {
    Send,
    Write,
    Read,
    FetchAdd,
    CompareSwap,
    Recv,
}

impl Opcode {
    fn code(self) -> u8 {
        match self {
            Opcode::Send => 1,
            Opcode::Write => 2,
            Opcode::Read => 3,
            Opcode::FetchAdd => 4,
            Opcode::CompareSwap => 5,
            Opcode::Recv => 6,
        }
    }

    fn from_code(code: u8) -> Option<Opcode> {
        Some(match code {
            1 => Opcode::Send,
            2 => Opcode::Write,
            3 => Opcode::Read,
            4 => Opcode::FetchAdd,
            5 => Opcode::CompareSwap,
            6 => Opcode::Recv,
            _ => return None,
        })
    }
}

/// Memory of a work request: `length` bytes at `offset` of a region the session owns or
/// attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegionSge {
    pub region: u64,
    pub offset: u64,
    pub length: u32,
}

/// A decoded submission entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submission {
    pub opcode: Opcode,
    pub wr_id: u64,
    /// Ask for a completion (the daemon tracks every request either way).
    pub signaled: bool,
    pub imm: Option<u32>,
    /// Peer memory for WRITE, READ and atomics.
    pub remote_addr: u64,
    pub rkey: u32,
    /// Fetch-and-add: the addend; compare-and-swap: the compare value.
    pub compare_add: u64,
    pub swap: u64,
    pub sges: RegionSges,
}

/// A submission's SGEs: at most [`MAX_SGE`] fit an entry, all kept inline (decoding an
/// entry allocates nothing). Build one with `smallvec::smallvec![…]` or `.into()` from a
/// `Vec`.
pub type RegionSges = smallvec::SmallVec<[RegionSge; MAX_SGE]>;

const FLAG_SIGNALED: u8 = 1;
const FLAG_IMM: u8 = 2;

/// Why a submission entry was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    UnknownOpcode(u8),
    UnknownFlags(u8),
    TooManySges(u8),
    /// Immediate data on an operation that carries none (READ, atomics, RECV).
    ImmediateNotAllowed,
    /// Atomics act on exactly one 8-byte local SGE.
    BadAtomic,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::UnknownOpcode(c) => write!(f, "unknown opcode {c}"),
            DecodeError::UnknownFlags(c) => write!(f, "unknown flags {c:#x}"),
            DecodeError::TooManySges(n) => write!(f, "{n} SGEs (at most {MAX_SGE})"),
            DecodeError::ImmediateNotAllowed => {
                f.write_str("immediate data on an operation without it")
            }
            DecodeError::BadAtomic => f.write_str("atomics take exactly one 8-byte SGE"),
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Submission {
    /// A signaled request on one SGE, without immediate data or remote target; set
    /// `remote_addr`/`rkey` (and `compare_add`/`swap`) for remote operations.
    pub fn new(opcode: Opcode, wr_id: u64, sge: RegionSge) -> Submission {
        Submission {
            opcode,
            wr_id,
            signaled: true,
            imm: None,
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
            sges: smallvec::smallvec![sge],
        }
    }

    /// The entry's bytes (little-endian fields):
    /// `opcode u8 | flags u8 | num_sge u8 | 0 u8 | imm u32 | wr_id u64 | remote_addr u64 |
    /// rkey u32 | 0 u32 | compare_add u64 | swap u64 | 4 × (region u64, offset u64,
    /// length u32, 0 u32)`.
    pub fn encode(&self) -> [u8; SQE_SIZE] {
        let mut b = [0u8; SQE_SIZE];
        b[0] = self.opcode.code();
        let mut flags = 0;
        if self.signaled {
            flags |= FLAG_SIGNALED;
        }
        if self.imm.is_some() {
            flags |= FLAG_IMM;
        }
        b[1] = flags;
        b[2] = u8::try_from(self.sges.len()).unwrap_or(u8::MAX);
        b[4..8].copy_from_slice(&self.imm.unwrap_or(0).to_le_bytes());
        b[8..16].copy_from_slice(&self.wr_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.remote_addr.to_le_bytes());
        b[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        b[32..40].copy_from_slice(&self.compare_add.to_le_bytes());
        b[40..48].copy_from_slice(&self.swap.to_le_bytes());
        for (i, sge) in self.sges.iter().take(MAX_SGE).enumerate() {
            let at = 48 + i * 24;
            b[at..at + 8].copy_from_slice(&sge.region.to_le_bytes());
            b[at + 8..at + 16].copy_from_slice(&sge.offset.to_le_bytes());
            b[at + 16..at + 20].copy_from_slice(&sge.length.to_le_bytes());
        }
        b
    }

    /// Decodes an entry already copied out of shared memory, checking everything that can
    /// be checked without knowing the session. The wr_id is returned with the error so the
    /// failure can be reported against it.
    pub fn decode(b: &[u8; SQE_SIZE]) -> Result<Submission, (u64, DecodeError)> {
        let wr_id = u64_at(b, 8);
        let fail = |e| Err((wr_id, e));
        let Some(opcode) = Opcode::from_code(b[0]) else {
            return fail(DecodeError::UnknownOpcode(b[0]));
        };
        let flags = b[1];
        if flags & !(FLAG_SIGNALED | FLAG_IMM) != 0 {
            return fail(DecodeError::UnknownFlags(flags));
        }
        let num_sge = b[2];
        if usize::from(num_sge) > MAX_SGE {
            return fail(DecodeError::TooManySges(num_sge));
        }
        let imm = (flags & FLAG_IMM != 0).then(|| u32_at(b, 4));
        if imm.is_some() && !matches!(opcode, Opcode::Send | Opcode::Write) {
            return fail(DecodeError::ImmediateNotAllowed);
        }
        let sges: RegionSges = (0..usize::from(num_sge))
            .map(|i| {
                let at = 48 + i * 24;
                RegionSge {
                    region: u64_at(b, at),
                    offset: u64_at(b, at + 8),
                    length: u32_at(b, at + 16),
                }
            })
            .collect();
        if matches!(opcode, Opcode::FetchAdd | Opcode::CompareSwap)
            && (sges.len() != 1 || sges[0].length != 8)
        {
            return fail(DecodeError::BadAtomic);
        }
        Ok(Submission {
            opcode,
            wr_id,
            signaled: flags & FLAG_SIGNALED != 0,
            imm,
            remote_addr: u64_at(b, 16),
            rkey: u32_at(b, 24),
            compare_add: u64_at(b, 32),
            swap: u64_at(b, 40),
            sges,
        })
    }
}

/// Completion status as the client sees it: the device's, or rdmad's own refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Success,
    LocalLengthError,
    LocalProtectionError,
    WrFlushError,
    RemoteInvalidRequestError,
    RemoteAccessError,
    RemoteOperationError,
    RetryExceeded,
    RnrRetryExceeded,
    /// Another device status.
    DeviceError,
    /// rdmad refused the entry: malformed (see the detail code).
    InvalidEntry,
    /// rdmad refused the entry: an SGE names a region the session may not use this way,
    /// or lies outside it.
    RegionAccessDenied,
    /// rdmad refused the entry: more requests outstanding than the QP's depth.
    QueueFull,
}

impl Status {
    pub fn code(self) -> u32 {
        match self {
            Status::Success => 0,
            Status::LocalLengthError => 1,
            Status::LocalProtectionError => 4,
            Status::WrFlushError => 5,
            Status::RemoteInvalidRequestError => 9,
            Status::RemoteAccessError => 10,
            Status::RemoteOperationError => 11,
            Status::RetryExceeded => 12,
            Status::RnrRetryExceeded => 13,
            Status::DeviceError => 99,
            Status::InvalidEntry => 100,
            Status::RegionAccessDenied => 101,
            Status::QueueFull => 102,
        }
    }

    pub fn from_code(code: u32) -> Status {
        match code {
            0 => Status::Success,
            1 => Status::LocalLengthError,
            4 => Status::LocalProtectionError,
            5 => Status::WrFlushError,
            9 => Status::RemoteInvalidRequestError,
            10 => Status::RemoteAccessError,
            11 => Status::RemoteOperationError,
            12 => Status::RetryExceeded,
            13 => Status::RnrRetryExceeded,
            100 => Status::InvalidEntry,
            101 => Status::RegionAccessDenied,
            102 => Status::QueueFull,
            _ => Status::DeviceError,
        }
    }
}

/// A completion entry: `wr_id u64 | status u32 | opcode u32 | byte_len u32 | imm u32 |
/// flags u32 (1: imm valid) | detail u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub status: Status,
    /// The submission's opcode; for received data `Recv`.
    pub opcode: Opcode,
    pub byte_len: u32,
    pub imm: Option<u32>,
    /// More about an rdmad refusal (e.g. which SGE).
    pub detail: u32,
}

impl Completion {
    pub fn encode(&self) -> [u8; CQE_SIZE] {
        let mut b = [0u8; CQE_SIZE];
        b[0..8].copy_from_slice(&self.wr_id.to_le_bytes());
        b[8..12].copy_from_slice(&self.status.code().to_le_bytes());
        b[12..16].copy_from_slice(&u32::from(self.opcode.code()).to_le_bytes());
        b[16..20].copy_from_slice(&self.byte_len.to_le_bytes());
        b[20..24].copy_from_slice(&self.imm.unwrap_or(0).to_le_bytes());
        b[24..28].copy_from_slice(&u32::from(self.imm.is_some()).to_le_bytes());
        b[28..32].copy_from_slice(&self.detail.to_le_bytes());
        b
    }

    /// Decodes a completion the daemon wrote; `None` for an opcode it never writes.
    pub fn decode(b: &[u8; CQE_SIZE]) -> Option<Completion> {
        let opcode = Opcode::from_code(u8::try_from(u32_at(b, 12)).ok()?)?;
        Some(Completion {
            wr_id: u64_at(b, 0),
            status: Status::from_code(u32_at(b, 8)),
            opcode,
            byte_len: u32_at(b, 16),
            imm: (u32_at(b, 24) & 1 == 1).then(|| u32_at(b, 20)),
            detail: u32_at(b, 28),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_aligned_and_page_sized() {
        let l = Layout::new(100, 200).unwrap();
        assert_eq!((l.sq_entries, l.cq_entries), (128, 256));
        assert_eq!(l.cq_offset() % 64, 0);
        assert_eq!(l.size() % 4096, 0);
        assert!(l.size() >= l.cq_offset() + 256 * CQE_SIZE);
        assert_eq!(l.sqe(128), l.sqe(0), "indices wrap");
        assert_eq!(l.sqe(u32::MAX), l.sq_offset() + 127 * SQE_SIZE);
        assert!(Layout::new(0, 4).is_none() && Layout::new(4, 70000).is_none());
    }

    #[test]
    fn submissions_round_trip() {
        let s = Submission {
            opcode: Opcode::Write,
            wr_id: 0xdead_beef,
            signaled: true,
            imm: Some(7),
            remote_addr: 0x1234_5678_9abc,
            rkey: 0x55aa,
            compare_add: 0,
            swap: 0,
            sges: smallvec::smallvec![
                RegionSge {
                    region: 3,
                    offset: 4096,
                    length: 100,
                },
                RegionSge {
                    region: 9,
                    offset: 0,
                    length: 1,
                },
            ],
        };
        assert_eq!(Submission::decode(&s.encode()), Ok(s));
    }

    #[test]
    fn malformed_submissions_are_refused_with_their_wr_id() {
        let good = Submission {
            opcode: Opcode::FetchAdd,
            wr_id: 77,
            signaled: false,
            imm: None,
            remote_addr: 8,
            rkey: 1,
            compare_add: 1,
            swap: 0,
            sges: smallvec::smallvec![RegionSge {
                region: 1,
                offset: 0,
                length: 8,
            }],
        };
        let mut b = good.encode();
        b[0] = 42;
        assert_eq!(
            Submission::decode(&b),
            Err((77, DecodeError::UnknownOpcode(42)))
        );
        let mut b = good.encode();
        b[2] = 5;
        assert_eq!(
            Submission::decode(&b),
            Err((77, DecodeError::TooManySges(5)))
        );
        let mut b = good.encode();
        b[1] = 0x80;
        assert_eq!(
            Submission::decode(&b),
            Err((77, DecodeError::UnknownFlags(0x80)))
        );
        let mut bad = good.clone();
        bad.sges[0].length = 4;
        assert_eq!(
            Submission::decode(&bad.encode()),
            Err((77, DecodeError::BadAtomic))
        );
        let mut bad = good.clone();
        bad.imm = Some(1);
        assert_eq!(
            Submission::decode(&bad.encode()),
            Err((77, DecodeError::ImmediateNotAllowed))
        );
        // Every byte pattern decodes or fails cleanly.
        for fill in [0u8, 0xff, 0x01, 0x80] {
            let _ = Submission::decode(&[fill; SQE_SIZE]);
        }
    }

    #[test]
    fn completions_round_trip() {
        let c = Completion {
            wr_id: 5,
            status: Status::RegionAccessDenied,
            opcode: Opcode::Recv,
            byte_len: 12,
            imm: Some(0),
            detail: 2,
        };
        assert_eq!(Completion::decode(&c.encode()), Some(c));
    }
}
