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
