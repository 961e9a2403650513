//! What the engine shows: devices as they report themselves now, pools with their live use,
//! queue pairs with their state, and counts of what it holds.

use super::*;

/// What the engine holds, counted (`Manager.ObjectCounts`, `rdmactl status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Sessions, those still being released included.
    pub sessions: usize,
    pub regions: usize,
    pub keys: usize,
    pub qps: usize,
}

/// A queue pair as its viewer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpInfo {
    pub id: QpId,
    pub session: SessionId,
    pub owner_uid: u32,
    pub device: String,
    /// From the device (`ibv_query_qp`).
    pub state: QpState,
    pub qp_num: u32,
    pub send_depth: u32,
    pub recv_depth: u32,
    /// The peer's GID and QPN, once connected.
    pub peer: Option<(std::net::Ipv6Addr, u32)>,
    /// The peer's IP address and port, when connected by address (`ConnectTo`, `Accept`).
    pub peer_address: Option<std::net::SocketAddr>,
    pub posted: u64,
    pub completed: u64,
    pub failed: u64,
    pub refused: u64,
}

/// A served device: what never changes while rdmad runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSummary {
    pub name: String,
    pub provider: String,
    /// The port queue pairs use.
    pub port: u8,
}

/// A pool as configured, with its live use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSnapshot {
    pub config: PoolConfig,
    pub device: String,
    pub stats: PoolStats,
}

impl Engine {
    /// The names of the devices served, in the order they were opened.
    pub fn device_names(&self) -> Vec<String> {
        self.devices
            .iter()
            .map(|d| d.device.name().to_owned())
            .collect()
    }

    /// Device `name`'s name, provider and port.
    pub fn device_summary(&self, name: &str) -> Result<DeviceSummary, EngineError> {
        let entry = self.device(name)?;
        Ok(DeviceSummary {
            name: entry.device.name().to_owned(),
            provider: entry.device.provider().to_string(),
            port: entry.port,
        })
    }

    /// Device `name`'s attributes, as the device reports them now (a verbs call: may block).
    pub fn device_attributes(&self, name: &str) -> Result<DeviceAttributes, EngineError> {
        Ok(self.device(name)?.device.attributes()?)
    }

    /// Every port of device `name`, as the device reports them now (may block).
    pub fn device_ports(&self, name: &str) -> Result<Vec<PortAttributes>, EngineError> {
        let device = &self.device(name)?.device;
        let count = device.attributes()?.port_count;
        (1..=count)
            .map(|port| Ok(device.query_port(port)?))
            .collect()
    }

    /// The GID table of every port of device `name`: (port, entry), read now (may block).
    pub fn device_gids(&self, name: &str) -> Result<Vec<(u8, GidEntry)>, EngineError> {
        let device = &self.device(name)?.device;
        let count = device.attributes()?.port_count;
        let mut out = Vec::new();
        for port in 1..=count {
            out.extend(device.gid_table(port)?.into_iter().map(|g| (port, g)));
        }
        Ok(out)
    }

    /// What device `name` refused to destroy (see [`Engine::lingering`]).
    pub fn device_lingering(&self, name: &str) -> Result<Vec<Lingering>, EngineError> {
        Ok(self.device(name)?.device.lingering())
    }

    /// The names of the pools served.
    pub fn pool_names(&self) -> Vec<String> {
        self.pools.iter().map(|p| p.name().to_owned()).collect()
    }

    /// Pool `name` as configured, with its live use.
    pub fn pool_snapshot(&self, name: &str) -> Result<PoolSnapshot, EngineError> {
        let pool = self.pool(name)?;
        Ok(PoolSnapshot {
            config: pool.config.clone(),
            device: pool.device.clone(),
            stats: pool.stats(),
        })
    }

    /// Every pool served, as configured, with its live use.
    pub fn pool_snapshots(&self) -> Vec<PoolSnapshot> {
        self.pools
            .iter()
            .map(|pool| PoolSnapshot {
                config: pool.config.clone(),
                device: pool.device.clone(),
                stats: pool.stats(),
            })
            .collect()
    }

    /// Sessions (those still being released included), regions, keys and queue pairs.
    pub fn counts(&self) -> Counts {
        let (sessions, regions, keys) = self.registry.counts();
        Counts {
            sessions,
            regions,
            keys,
            qps: self.registry.qp_count(),
        }
    }
}

/// A queue pair's snapshot; its state from the device.
pub(super) fn qp_info(id: QpId, q: &QueuePairRecord) -> QpInfo {
    let peer = lock(&q.remote).as_ref().map(|r| (r.gid, r.qp_num));
    let counter = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    QpInfo {
        id,
        session: q.session,
        owner_uid: q.owner_uid,
        device: q.device.clone(),
        state: q.state(),
        qp_num: q.local.qp_num,
        send_depth: q.options.send_depth,
        recv_depth: q.options.recv_depth,
        peer,
        peer_address: lock(&q.link).as_ref().and_then(|l| l.peer),
        posted: counter(&q.counters.posted),
        completed: counter(&q.counters.completed),
        failed: counter(&q.counters.failed),
        refused: counter(&q.counters.refused),
    }
}
