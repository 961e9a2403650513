//! Engine snapshots as the wire types of `rdmad-client`: the one place they are converted.

use std::time::{SystemTime, UNIX_EPOCH};

use rdmad_client::names::{pool_path, region_path, session_path};
use rdmad_client::types::{KeyInfo, PoolInfo, RegionInfo, SessionInfo};
use zbus::zvariant::OwnedObjectPath;

use crate::engine::{PoolSnapshot, RegionInfo as EngineRegion, SessionInfo as EngineSession};
use crate::policy::quota::user_name;

pub fn path(p: String) -> OwnedObjectPath {
    OwnedObjectPath::try_from(p).expect("rdmad builds only valid object paths")
}

pub fn usec(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

pub fn session(s: &EngineSession) -> SessionInfo {
    SessionInfo {
        id: s.id.0,
        path: path(session_path(s.id.0)),
        uid: s.uid,
        user: user_name(s.uid),
        bus_name: s.bus_name.clone(),
        pid: s.pid.unwrap_or(0),
        created_usec: usec(s.created),
        regions: count(s.regions.len()),
        attachments: count(s.attachments.len()),
        registered_bytes: s.registered_bytes,
    }
}

pub fn region(r: &EngineRegion) -> RegionInfo {
    RegionInfo {
        id: r.id.0,
        path: path(region_path(r.id.0)),
        session: path(session_path(r.session.0)),
        owner_uid: r.owner_uid,
        pool: r.pool.clone(),
        device: r.device.clone(),
        size: r.size,
        requested: r.requested,
        keys: r
            .keys
            .iter()
            .map(|k| KeyInfo {
                id: k.id.0,
                region: k.region.0,
                access: k.access.as_str().to_owned(),
                expires_usec: k.expires.map_or(0, usec),
            })
            .collect(),
        attachments: count(r.attachments.len()),
    }
}

pub fn pool(p: &PoolSnapshot) -> PoolInfo {
    let stats = &p.stats;
    PoolInfo {
        name: p.config.name.clone(),
        path: path(pool_path(&p.config.name)),
        device: p.device.clone(),
        capacity: stats.capacity,
        used: stats.used,
        free: stats.free,
        regions: stats.regions,
        warm_regions: stats.warm_regions,
        warm_bytes: stats.warm_bytes,
        size_classes: p.config.size_classes.iter().map(|c| c.0).collect(),
        granularity: p.config.granularity.map_or(0, |g| g.0),
        hugepages: p.config.hugepages,
    }
}
