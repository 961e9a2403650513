//! Types that travel on the bus. Each is a D-Bus struct (field order is the wire order) and
//! serializes to JSON with the same field names `rdmactl -j` prints.

use serde::{Deserialize, Serialize};
use zbus::zvariant::{OwnedObjectPath, OwnedValue, Type, Value};

/// One entry of `Manager.ListDevices`: `(name, provider, object path)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct DeviceSummary {
    pub name: String,
    /// `verbs` (a kernel RDMA device) or `loopback` (rdmad's in-process device).
    pub provider: String,
    pub path: OwnedObjectPath,
}

/// State of one port of a device, signature `(yssuuqs)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct PortInfo {
    /// Port number, from 1.
    pub port: u8,
    /// Logical state as verbs names it: `down`, `init`, `armed`, `active`, `active_defer`.
    pub state: String,
    /// Physical state: `polling`, `disabled`, `link_up`, … (`unknown` when not reported).
    pub physical_state: String,
    /// Active path MTU in bytes (256 … 4096).
    pub active_mtu: u32,
    /// Largest path MTU the port supports, in bytes.
    pub max_mtu: u32,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// `infiniband` or `ethernet`.
    pub link_layer: String,
}

/// One populated entry of a port's GID table, signature `(yuss)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct GidEntry {
    pub port: u8,
    pub index: u32,
    /// The GID in IPv6 notation, e.g. `::ffff:10.0.2.15`.
    pub gid: String,
    /// `IB`, `RoCE v1` or `RoCE v2`.
    pub gid_type: String,
}

/// What the device can do, signature `(uuuuuuutuusas)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct Capabilities {
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
    /// Atomic operations: `none`, `hca` (atomic with respect to this device) or `global`.
    pub atomics: String,
    /// Supported memory-window types: any of `type1`, `type2a`, `type2b`.
    pub memory_windows: Vec<String>,
}

/// A registration or window the device refused to destroy, still kept and retried by
/// rdmad (`Device.LingeringObjects`), signature `(sustsu)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct LingeringObject {
    /// `mr` or `mw`.
    pub kind: String,
    /// The lkey of a registration, the rkey of a window.
    pub key: u32,
    /// Bytes registered (0 for a window).
    pub length: u64,
    /// The device's last answer.
    pub error: String,
    /// When the device first refused, in microseconds since the Unix epoch.
    pub since_usec: u64,
    /// How many times it refused.
    pub attempts: u32,
}

/// A session, as `Manager.ListSessions` and `Session.GetInfo` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct SessionInfo {
    pub id: u64,
    pub path: OwnedObjectPath,
    pub uid: u32,
    pub user: String,
    /// The unique bus name of the connection that owns it.
    pub bus_name: String,
    /// 0 when the bus did not report it.
    pub pid: u32,
    /// Microseconds since the Unix epoch.
    pub created_usec: u64,
    pub regions: u32,
    pub attachments: u32,
    pub registered_bytes: u64,
}

/// An access key, as its region shows it (never the token itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct KeyInfo {
    pub id: u64,
    pub region: u64,
    /// `ro` or `rw`.
    pub access: String,
    /// Microseconds since the Unix epoch; 0: never.
    pub expires_usec: u64,
}

/// A region, as `Manager.ListRegions` and `Region.GetInfo` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct RegionInfo {
    pub id: u64,
    pub path: OwnedObjectPath,
    /// The owning session.
    pub session: OwnedObjectPath,
    pub owner_uid: u32,
    pub pool: String,
    pub device: String,
    /// Bytes (the request rounded up to the pool's size class).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    pub keys: Vec<KeyInfo>,
    /// Sessions that attached it.
    pub attachments: u32,
}

/// A pool, as `Manager.ListPools` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct PoolInfo {
    pub name: String,
    pub path: OwnedObjectPath,
    pub device: String,
    pub capacity: u64,
    pub used: u64,
    pub free: u64,
    pub regions: u64,
    pub warm_regions: u64,
    pub warm_bytes: u64,
    /// Region sizes; empty for a pool with a granularity.
    pub size_classes: Vec<u64>,
    /// 0 for a pool with size classes.
    pub granularity: u64,
    pub hugepages: bool,
}

/// One limit of `Manager.GetQuota`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct QuotaEntry {
    /// `sessions`, `regions`, `registered_bytes`, `keys`, `qps` or `exports`.
    pub name: String,
    pub limit: u64,
    pub used: u64,
    /// The configuration key that sets the limit.
    pub source: String,
}

/// What a peer needs to connect to a queue pair (`QueuePair.Endpoint`), and what
/// `QueuePair.Connect` takes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct Endpoint {
    /// The GID in IPv6 notation (RoCE v2 IPv4-mapped where there is one).
    pub gid: String,
    pub gid_index: u32,
    pub qp_num: u32,
    /// Starting packet sequence number (24 bits).
    pub psn: u32,
    /// Active path MTU in bytes.
    pub mtu: u32,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
}

/// A queue pair, as `Manager.ListQueuePairs` and `QueuePair.GetInfo` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct QueuePairInfo {
    pub id: u64,
    pub path: OwnedObjectPath,
    pub session: OwnedObjectPath,
    pub owner_uid: u32,
    pub device: String,
    /// `reset`, `init`, `rtr`, `rts`, `sqd`, `sqe` or `error`.
    pub state: String,
    pub qp_num: u32,
    pub send_depth: u32,
    pub recv_depth: u32,
    /// The peer's `gid/qpn`, empty until connected.
    pub peer: String,
    /// Client requests posted to the device, completed, failed on the device, and
    /// refused by rdmad before reaching it.
    pub posted: u64,
    pub completed: u64,
    pub failed: u64,
    pub refused: u64,
}

/// What `Session.CreateQueuePair` returns besides the object and the descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Type, Value, OwnedValue)]
pub struct RingInfo {
    /// Bytes of the ring memfd.
    pub size: u64,
    pub sq_entries: u32,
    pub cq_entries: u32,
}
