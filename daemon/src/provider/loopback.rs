//! The loopback provider: an in-process RDMA device with verbs semantics, served where the
//! host has no RDMA device and used by the unit tests. Anything that works here and fails on
//! a real device (or the other way round) is a bug here.

use std::collections::HashMap;
use std::net::Ipv6Addr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use super::counters::{Counters, Tracked};
use super::{
    Access, AtomicSupport, Device, DeviceAttributes, GidEntry, GidType, LinkLayer, MemoryRegion,
    ObjectCounts, ObjectKind, PortAttributes, PortState, ProtectionDomain, ProviderError,
    ProviderKind, Result,
};
use crate::lock::lock;
use crate::memory::SharedMemory;

/// Name of the loopback device the daemon serves when there is no RDMA hardware.
pub const DEFAULT_NAME: &str = "loopback0";

/// Limits chosen to match a Soft-RoCE device, so quotas and tests behave alike.
const MAX_MR: u32 = 524_287;
const MAX_PD: u32 = 1_048_576;
const PORT_MTU: u32 = 4096;

/// A registration as the device's translation table sees it.
#[derive(Debug, Clone, Copy)]
struct Registration {
    addr: u64,
    len: u64,
    access: Access,
}

#[derive(Debug)]
struct Shared {
    name: String,
    counters: Arc<Counters>,
    /// lkey → registration: what the device would check a work request against.
    translations: Mutex<HashMap<u32, Registration>>,
    next_index: AtomicU32,
}

/// The loopback device.
#[derive(Debug, Clone)]
pub struct LoopbackDevice {
    shared: Arc<Shared>,
}

impl LoopbackDevice {
    pub fn new(name: &str) -> LoopbackDevice {
        LoopbackDevice {
            shared: Arc::new(Shared {
                name: name.to_owned(),
                counters: Arc::default(),
                translations: Mutex::default(),
                next_index: AtomicU32::new(1),
            }),
        }
    }

    /// Checks a local access the way a device checks an SGE: the key must name a live
    /// registration, the range must lie inside it and the registration must grant `needed`.
    pub fn check_local_access(&self, lkey: u32, addr: u64, len: u64, needed: Access) -> Result<()> {
        let table = lock(&self.shared.translations);
        let reg = table.get(&lkey).ok_or_else(|| {
            ProviderError::invalid(
                &self.shared.name,
                format!("lkey {lkey:#x} is not registered"),
            )
        })?;
        let inside = addr >= reg.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= reg.addr + reg.len);
        if !inside {
            return Err(ProviderError::invalid(
                &self.shared.name,
                format!(
                    "range {addr:#x}+{len} lies outside registration {lkey:#x} ({:#x}+{})",
                    reg.addr, reg.len
                ),
            ));
        }
        if !reg.access.contains(needed) {
            return Err(ProviderError::invalid(
                &self.shared.name,
                format!(
                    "registration {lkey:#x} grants {:?}, not {needed:?}",
                    reg.access
                ),
            ));
        }
        Ok(())
    }
}

impl Device for LoopbackDevice {
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn provider(&self) -> ProviderKind {
        ProviderKind::Loopback
    }

    fn attributes(&self) -> Result<DeviceAttributes> {
        Ok(DeviceAttributes {
            // A locally administered EUI-64, the shape rxe derives from a MAC address.
            node_guid: 0x0200_00ff_fe00_0001,
            firmware_version: env!("CARGO_PKG_VERSION").to_owned(),
            port_count: 1,
            max_qp: 1 << 20,
            max_qp_wr: 1 << 14,
            max_sge: 32,
            max_cq: 1 << 20,
            max_cqe: 32_767,
            max_mr: MAX_MR,
            max_pd: MAX_PD,
            max_mr_size: u64::MAX,
            max_mw: MAX_MR,
            max_qp_rd_atom: 128,
            atomics: AtomicSupport::Hca,
            mw_type1: true,
            mw_type2a: false,
            mw_type2b: true,
        })
    }

    fn query_port(&self, port: u8) -> Result<PortAttributes> {
        check_port(&self.shared.name, port)?;
        Ok(PortAttributes {
            port,
            state: PortState::Active,
            physical_state: "link_up",
            active_mtu: PORT_MTU,
            max_mtu: PORT_MTU,
            lid: 0,
            link_layer: LinkLayer::Ethernet,
            gid_table_len: 1024,
        })
    }

    fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        check_port(&self.shared.name, port)?;
        Ok(vec![
            GidEntry {
                index: 0,
                gid: "fe80::ff:fe00:1".parse::<Ipv6Addr>().expect("literal GID"),
                gid_type: GidType::RoceV2,
            },
            GidEntry {
                index: 1,
                gid: std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped(),
                gid_type: GidType::RoceV2,
            },
        ])
    }

    fn alloc_pd(&self) -> Result<Arc<dyn ProtectionDomain>> {
        if self.shared.counters.snapshot().pds >= u64::from(MAX_PD) {
            return Err(out_of_resources(&self.shared.name, "ibv_alloc_pd"));
        }
        Ok(Arc::new(LoopbackPd(Arc::new(PdInner {
            _tracked: self.shared.counters.track(ObjectKind::Pd),
            device: Arc::clone(&self.shared),
        }))))
    }

    fn object_counts(&self) -> ObjectCounts {
        self.shared.counters.snapshot()
    }
}

fn check_port(device: &str, port: u8) -> Result<()> {
    if port != 1 {
        return Err(ProviderError::invalid(
            device,
            format!("port {port} does not exist (the device has port 1)"),
        ));
    }
    Ok(())
}

fn out_of_resources(device: &str, operation: &'static str) -> ProviderError {
    ProviderError::Os {
        device: device.to_owned(),
        operation,
        source: std::io::Error::from_raw_os_error(libc::ENOMEM),
    }
}

/// The handle the engine holds; registrations hold the inner part, so a PD lives until its
/// last registration is gone, as with verbs.
#[derive(Debug)]
struct LoopbackPd(Arc<PdInner>);

#[derive(Debug)]
struct PdInner {
    device: Arc<Shared>,
    _tracked: Tracked,
}

impl ProtectionDomain for LoopbackPd {
    fn register(&self, memory: Arc<SharedMemory>, access: Access) -> Result<Arc<dyn MemoryRegion>> {
        let device = &self.0.device;
        let name = &device.name;
        access
            .check_consistent()
            .map_err(|message| ProviderError::invalid(name, message))?;
        if device.counters.snapshot().mrs >= u64::from(MAX_MR) {
            return Err(out_of_resources(name, "ibv_reg_mr"));
        }
        // Keys as rxe makes them: a table index in the upper 24 bits, a variant byte below.
        let index = device.next_index.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
        let key = (index << 8) | (index.wrapping_mul(0x9e) & 0xff);
        let registration = Registration {
            addr: memory.addr(),
            len: memory.len() as u64,
            access,
        };
        lock(&device.translations).insert(key, registration);
        Ok(Arc::new(LoopbackMr {
            key,
            access,
            memory,
            _tracked: device.counters.track(ObjectKind::Mr),
            pd: Arc::clone(&self.0),
        }))
    }

    fn device_name(&self) -> &str {
        &self.0.device.name
    }
}

#[derive(Debug)]
struct LoopbackMr {
    key: u32,
    access: Access,
    memory: Arc<SharedMemory>,
    _tracked: Tracked,
    pd: Arc<PdInner>,
}

impl MemoryRegion for LoopbackMr {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
    fn access(&self) -> Access {
        self.access
    }
    fn memory(&self) -> &Arc<SharedMemory> {
        &self.memory
    }
}

impl Drop for LoopbackMr {
    fn drop(&mut self) {
        lock(&self.pd.device.translations).remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::conformance;

    #[test]
    fn loopback_conformance() {
        conformance::run_all(&LoopbackDevice::new(DEFAULT_NAME));
    }

    #[test]
    fn deregistered_keys_stop_resolving_and_bounds_are_checked() {
        let dev = LoopbackDevice::new("lo-test");
        let pd = dev.alloc_pd().unwrap();
        let mem = Arc::new(SharedMemory::create(c"t", 8192).unwrap());
        let mr = pd.register(Arc::clone(&mem), Access::LOCAL_WRITE).unwrap();
        let (lkey, addr) = (mr.lkey(), mr.addr());
        dev.check_local_access(lkey, addr, 8192, Access::LOCAL_WRITE)
            .unwrap();
        dev.check_local_access(lkey, addr + 4096, 4096, Access::NONE)
            .unwrap();
        assert!(dev
            .check_local_access(lkey, addr + 4096, 4097, Access::NONE)
            .is_err());
        assert!(dev
            .check_local_access(lkey, addr - 1, 2, Access::NONE)
            .is_err());
        assert!(dev
            .check_local_access(lkey, addr, 8, Access::REMOTE_READ)
            .is_err());
        assert!(dev
            .check_local_access(lkey ^ 0x100, addr, 8, Access::NONE)
            .is_err());
        drop(mr);
        assert!(dev.check_local_access(lkey, addr, 8, Access::NONE).is_err());
    }
}
