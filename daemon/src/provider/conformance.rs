//! Behaviour every provider must show, run against the loopback device in the unit tests
//! and against `rxe0` in the VM tier (`rxe_*` tests). A check that passes on one provider and
//! fails on the other is a bug in the provider that differs from the real device.

use std::sync::Arc;

use super::{Access, Device, ProviderError};
use crate::memory::SharedMemory;

pub fn run_all(dev: &dyn Device) {
    attributes_and_ports(dev);
    gid_table_has_roce_v2_ipv4_mapped_entry(dev);
    pd_and_mr_lifecycle(dev);
    invalid_access_is_refused(dev);
    region_outlives_dropped_pd(dev);
    unsupported_or_working_windows(dev);
}

fn attributes_and_ports(dev: &dyn Device) {
    let attrs = dev.attributes().expect("device attributes");
    assert!(attrs.port_count >= 1, "a device has at least one port");
    assert!(attrs.max_mr > 0 && attrs.max_pd > 0 && attrs.max_qp > 0);
    assert!(attrs.max_sge >= 1 && attrs.max_cqe >= 1);
    assert_ne!(attrs.node_guid, 0, "node GUID must be set");
    let port = dev.query_port(1).expect("port 1");
    assert_eq!(port.port, 1);
    assert!(
        [256, 512, 1024, 2048, 4096].contains(&port.active_mtu),
        "{port:?}"
    );
    for bad in [0, attrs.port_count + 1] {
        match dev.query_port(bad) {
            Err(ProviderError::InvalidArgument { message, .. }) => {
                assert!(message.contains(&format!("port {bad}")), "{message}")
            }
            other => panic!("port {bad} must be refused as invalid, got {other:?}"),
        }
    }
}

fn gid_table_has_roce_v2_ipv4_mapped_entry(dev: &dyn Device) {
    let gids = dev.gid_table(1).expect("GID table");
    assert!(!gids.is_empty());
    assert!(
        gids.iter()
            .any(|g| g.is_ipv4_mapped() && g.gid_type == super::GidType::RoceV2),
        "expected an IPv4-mapped RoCE v2 GID in {gids:?}"
    );
    let mut indices: Vec<u32> = gids.iter().map(|g| g.index).collect();
    indices.dedup();
    assert_eq!(indices.len(), gids.len(), "GID indices are unique");
    assert!(
        gids.iter().all(|g| !g.gid.is_unspecified()),
        "only populated entries"
    );
}

fn pd_and_mr_lifecycle(dev: &dyn Device) {
    let base = dev.object_counts();
    let pd = dev.alloc_pd().expect("alloc_pd");
    assert_eq!(dev.object_counts().pds, base.pds + 1);

    let mem = Arc::new(SharedMemory::create(c"conformance", 64 * 1024).unwrap());
    mem.write_at(100, b"written before registration").unwrap();
    let a = pd
        .register(Arc::clone(&mem), Access::LOCAL_WRITE | Access::MW_BIND)
        .expect("register memfd mapping");
    let other = Arc::new(SharedMemory::create(c"conformance", 4096).unwrap());
    let b = pd
        .register(other, Access::LOCAL_WRITE)
        .expect("second registration");
    assert_eq!(dev.object_counts().mrs, base.mrs + 2);
    assert_eq!(a.addr(), mem.addr());
    assert_eq!(a.len(), 64 * 1024);
    assert_eq!(a.access(), Access::LOCAL_WRITE | Access::MW_BIND);
    assert_ne!(a.lkey(), b.lkey(), "keys of live registrations differ");
    let mut buf = [0u8; 27];
    a.memory().read_at(100, &mut buf).unwrap();
    assert_eq!(&buf, b"written before registration");

    drop(a);
    drop(b);
    assert_eq!(dev.object_counts().mrs, base.mrs);
    drop(pd);
    assert_eq!(dev.object_counts(), base);
}

fn invalid_access_is_refused(dev: &dyn Device) {
    let base = dev.object_counts();
    let pd = dev.alloc_pd().unwrap();
    let mem = Arc::new(SharedMemory::create(c"conformance", 4096).unwrap());
    for access in [
        Access::REMOTE_WRITE,
        Access::REMOTE_ATOMIC | Access::REMOTE_READ,
    ] {
        match pd.register(Arc::clone(&mem), access) {
            Err(ProviderError::InvalidArgument { .. }) => {}
            other => panic!("{access:?} without local_write must be refused, got {other:?}"),
        }
    }
    drop(pd);
    assert_eq!(
        dev.object_counts(),
        base,
        "a refused registration leaves nothing behind"
    );
}

fn region_outlives_dropped_pd(dev: &dyn Device) {
    let base = dev.object_counts();
    let pd = dev.alloc_pd().unwrap();
    let mem = Arc::new(SharedMemory::create(c"conformance", 4096).unwrap());
    let mr = pd.register(mem, Access::LOCAL_WRITE).unwrap();
    drop(pd);
    assert_eq!(
        dev.object_counts().pds,
        base.pds + 1,
        "the region keeps its PD alive"
    );
    mr.memory().write_at(0, b"still mapped").unwrap();
    drop(mr);
    assert_eq!(dev.object_counts(), base);
}

fn unsupported_or_working_windows(dev: &dyn Device) {
    let pd = dev.alloc_pd().unwrap();
    match pd.alloc_mw(super::MwType::Type2) {
        Ok(mw) => assert_eq!(mw.kind(), super::MwType::Type2),
        Err(ProviderError::NotSupported { .. }) => {}
        Err(other) => panic!("alloc_mw must work or answer NotSupported, got {other:?}"),
    }
}
