//! Plain data that crosses the provider boundary.

use std::fmt;
use std::net::Ipv6Addr;
use std::sync::Arc;

use super::{MemoryRegion, MemoryWindow};

/// Access rights of a registration, window or QP; the bit values are libibverbs'
/// `ibv_access_flags`, so the verbs provider passes them through unchanged.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    pub const NONE: Access = Access(0);
    pub const LOCAL_WRITE: Access = Access(1);
    pub const REMOTE_WRITE: Access = Access(1 << 1);
    pub const REMOTE_READ: Access = Access(1 << 2);
    pub const REMOTE_ATOMIC: Access = Access(1 << 3);
    pub const MW_BIND: Access = Access(1 << 4);
    const ALL: u32 = 0x1f;
    const NAMES: [(Access, &'static str); 5] = [
        (Access::LOCAL_WRITE, "local_write"),
        (Access::REMOTE_WRITE, "remote_write"),
        (Access::REMOTE_READ, "remote_read"),
        (Access::REMOTE_ATOMIC, "remote_atomic"),
        (Access::MW_BIND, "mw_bind"),
    ];

    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Both sets of rights (`|` in a `const`).
    pub const fn union(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }

    /// Flags from raw bits; `None` if a bit rdmad does not know is set.
    pub fn from_bits(bits: u32) -> Option<Access> {
        (bits & !Self::ALL == 0).then_some(Access(bits))
    }

    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// The rule every verbs device applies: remote write and remote atomic access need
    /// local write (`ibv_reg_mr` fails with EINVAL otherwise).
    pub fn check_consistent(self) -> Result<(), String> {
        let needs_local_write =
            self.contains(Access::REMOTE_WRITE) || self.contains(Access::REMOTE_ATOMIC);
        if needs_local_write && !self.contains(Access::LOCAL_WRITE) {
            return Err(format!(
                "access {self:?} asks for remote write or atomic access without local_write"
            ));
        }
        Ok(())
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Self::NAMES
            .iter()
            .filter(|(flag, _)| self.contains(*flag))
            .map(|(_, name)| *name)
            .collect();
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join("|"))
        }
    }
}

/// The part of a memory a registration covers — `len` bytes from `offset` — and the
/// address the device knows its first byte by (the iova: the daemon's own address of it
/// for the daemon's regions, the client's address of it for a client's registration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub offset: usize,
    pub len: usize,
    pub iova: u64,
}

impl Span {
    /// All of `memory`, at the daemon's address of it.
    pub fn whole(memory: &crate::memory::SharedMemory) -> Span {
        Span {
            offset: 0,
            len: memory.len(),
            iova: memory.addr(),
        }
    }

    /// Refuses a span that is empty, reaches past `memory_len`, or whose addresses would
    /// wrap, as a device refuses such a registration.
    pub fn check(&self, memory_len: usize) -> Result<(), String> {
        let inside = self
            .offset
            .checked_add(self.len)
            .is_some_and(|end| end <= memory_len);
        if self.len == 0 || !inside {
            return Err(format!(
                "{} bytes from offset {} do not lie inside the memory ({memory_len} bytes)",
                self.len, self.offset
            ));
        }
        if self.iova.checked_add(self.len as u64).is_none() {
            return Err(format!(
                "iova {:#x} + {} bytes wraps around the address space",
                self.iova, self.len
            ));
        }
        Ok(())
    }

    /// Whether `[offset, offset + len)` of the memory lies inside the span.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        let (start, end) = (self.offset as u64, (self.offset + self.len) as u64);
        offset >= start && offset.checked_add(len).is_some_and(|e| e <= end)
    }
}

/// Atomic operation support.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicSupport {
    None,
    /// Atomic with respect to other atomics of this device.
    Hca,
    /// Atomic with respect to the CPU too.
    Global,
}

impl AtomicSupport {
    pub fn as_str(self) -> &'static str {
        match self {
            AtomicSupport::None => "none",
            AtomicSupport::Hca => "hca",
            AtomicSupport::Global => "global",
        }
    }
}

/// Memory-window type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MwType {
    Type1,
    Type2,
}

/// Identity and limits of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttributes {
    pub node_guid: u64,
    pub firmware_version: String,
    pub port_count: u8,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_pd: u32,
    pub max_mr_size: u64,
    pub max_mw: u32,
    pub max_qp_rd_atom: u32,
    pub atomics: AtomicSupport,
    pub mw_type1: bool,
    pub mw_type2a: bool,
    pub mw_type2b: bool,
}

impl DeviceAttributes {
    /// The node GUID the way `ibv_devinfo` prints it: `0011:2233:4455:6677`.
    pub fn node_guid_string(&self) -> String {
        let b = self.node_guid.to_be_bytes();
        format!(
            "{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]
        )
    }

    pub fn memory_window_types(&self) -> Vec<String> {
        [
            (self.mw_type1, "type1"),
            (self.mw_type2a, "type2a"),
            (self.mw_type2b, "type2b"),
        ]
        .into_iter()
        .filter(|(supported, _)| *supported)
        .map(|(_, name)| name.to_owned())
        .collect()
    }
}

/// Logical port state (`ibv_port_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    Nop,
    Down,
    Init,
    Armed,
    Active,
    ActiveDefer,
}

impl PortState {
    pub fn as_str(self) -> &'static str {
        match self {
            PortState::Nop => "nop",
            PortState::Down => "down",
            PortState::Init => "init",
            PortState::Armed => "armed",
            PortState::Active => "active",
            PortState::ActiveDefer => "active_defer",
        }
    }
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    Infiniband,
    Ethernet,
}

impl LinkLayer {
    pub fn as_str(self) -> &'static str {
        match self {
            LinkLayer::Infiniband => "infiniband",
            LinkLayer::Ethernet => "ethernet",
        }
    }
}

/// Live attributes of a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAttributes {
    pub port: u8,
    pub state: PortState,
    /// `ibv_port_attr.phys_state` decoded (`link_up`, `polling`, …).
    pub physical_state: &'static str,
    pub active_mtu: u32,
    pub max_mtu: u32,
    pub lid: u16,
    pub link_layer: LinkLayer,
    pub gid_table_len: u32,
    /// The largest message the port carries (`max_msg_sz`).
    pub max_msg_sz: u64,
}

/// Bytes of an `ibv_mtu` value (1 = 256 … 5 = 4096); 0 if unknown.
pub fn mtu_bytes(ibv_mtu: u32) -> u32 {
    match ibv_mtu {
        1..=5 => 128 << ibv_mtu,
        _ => 0,
    }
}

/// GID type as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    Ib,
    RoceV1,
    RoceV2,
}

impl GidType {
    pub fn as_str(self) -> &'static str {
        match self {
            GidType::Ib => "IB",
            GidType::RoceV1 => "RoCE v1",
            GidType::RoceV2 => "RoCE v2",
        }
    }
}

/// One populated GID table entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    pub index: u32,
    pub gid: Ipv6Addr,
    pub gid_type: GidType,
}

impl GidEntry {
    /// True for `::ffff:a.b.c.d`, the GID RoCE v2 routes over IPv4.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.gid.to_ipv4_mapped().is_some()
    }
}

/// What creating a QP needs.
#[derive(Debug, Clone)]
pub struct QpInit {
    pub send_cq: Arc<dyn super::CompletionQueue>,
    pub recv_cq: Arc<dyn super::CompletionQueue>,
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// QP state (`ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Sqd,
    Sqe,
    Error,
}

/// What a peer tells us about its QP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteEndpoint {
    pub gid: Ipv6Addr,
    pub qp_num: u32,
    pub psn: u32,
    pub lid: u16,
}

/// INIT → RTR parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RtrAttributes {
    pub port: u8,
    pub sgid_index: u32,
    pub path_mtu: u32,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
}

/// RTR → RTS parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RtsAttributes {
    pub psn: u32,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub max_rd_atomic: u8,
}

/// A scatter/gather element already translated to a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The operation of a send-queue work request.
#[derive(Debug, Clone)]
pub enum SendOp {
    Send {
        imm: Option<u32>,
    },
    Write {
        remote_addr: u64,
        rkey: u32,
        imm: Option<u32>,
    },
    Read {
        remote_addr: u64,
        rkey: u32,
    },
    FetchAdd {
        remote_addr: u64,
        rkey: u32,
        add: u64,
    },
    CompareSwap {
        remote_addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    },
    /// Binds a type-2 window over `[addr, addr + len)` of `mr`.
    BindMw {
        mw: Arc<dyn MemoryWindow>,
        mr: Arc<dyn MemoryRegion>,
        addr: u64,
        len: u64,
        access: Access,
    },
    /// Invalidates the window (or MR) known by `rkey`.
    LocalInvalidate {
        rkey: u32,
    },
}

/// A work request's scatter/gather list: up to four SGEs are kept inline (as many as a
/// ring entry carries), so a request on the data path allocates nothing.
pub type Sges = smallvec::SmallVec<[Sge; 4]>;

#[derive(Debug, Clone)]
pub struct SendWr {
    pub wr_id: u64,
    pub op: SendOp,
    pub sges: Sges,
    pub signaled: bool,
    /// Hand the device the bytes with the request (`IBV_SEND_INLINE`) rather than their
    /// address: for SENDs and WRITEs up to the QP's `max_inline_data`.
    pub inline: bool,
}

impl SendWr {
    /// The length of the message its SGEs gather.
    pub fn message_len(&self) -> u64 {
        self.sges.iter().map(|sge| u64::from(sge.length)).sum()
    }
}

#[derive(Debug, Clone)]
pub struct RecvWr {
    pub wr_id: u64,
    pub sges: Sges,
}

/// Completion status (`ibv_wc_status`, the subset rdmad reports by name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    Success,
    LocalLengthError,
    LocalProtectionError,
    WrFlushError,
    MemoryWindowBindError,
    RemoteInvalidRequestError,
    RemoteAccessError,
    RemoteOperationError,
    RetryExceeded,
    RnrRetryExceeded,
    /// Any other status, with the provider's code.
    Other(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOpcode {
    Send,
    RdmaWrite,
    RdmaRead,
    CompareSwap,
    FetchAdd,
    BindMw,
    LocalInvalidate,
    Recv,
    RecvRdmaWithImm,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkCompletion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub byte_len: u32,
    pub imm: Option<u32>,
    pub qp_num: u32,
}
