//! The engine: everything rdmad owns — devices with their protection domains, pools,
//! sessions, regions, keys, queue pairs and exports — behind one face, [`Engine`]. The
//! D-Bus layer calls in with plain inputs the policy layer made (an [`Owner`], [`Limits`],
//! a [`Scope`], [`PoolAccess`]); the providers are called out to. No zbus types and no
//! bus callers here. Its submodules are private: what it offers is what this file exports.

mod datapath;
mod devices;
mod error;
mod pool;
mod qp;
mod registry;
mod tenancy;
mod token;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

/// Device facts and errors the engine passes on as the device reports them.
pub use crate::provider::{
    DeviceAttributes, GidEntry, Lingering, ObjectCounts, PortAttributes, ProviderError, QpState,
    RemoteEndpoint,
};
pub use devices::DeviceSelection;
pub use error::EngineError;
pub use pool::{PoolStats, REGION_ACCESS};
pub use qp::{ExportId, LocalEndpoint, QpId, QpOptions};
pub use registry::{
    AttachMode, Handout, KeyId, KeyInfo, QuotaLine, RegionId, RegionInfo, Removed, SessionId,
    SessionInfo,
};
pub use tenancy::{Limit, Limits, Owner, PoolAccess, QuotaError, Scope, Usage};

use crate::config::{Config, ConfigError, PoolConfig, ProviderChoice, QuotaKind};
use crate::lock::lock;
use devices::{open_devices, DeviceEntry};
use pool::Pool;
use qp::QueuePairRecord;
use registry::Registry;

/// What the engine holds, counted (`Manager.ObjectCounts`, `rdmactl status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Sessions, those still being released included.
    pub sessions: usize,
    pub regions: usize,
    pub keys: usize,
    pub qps: usize,
}

/// What a peer may do through an export.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteRights {
    pub read: bool,
    pub write: bool,
    pub atomic: bool,
}

impl RemoteRights {
    fn access(self) -> crate::provider::Access {
        use crate::provider::Access;
        let mut access = Access::NONE;
        for (wanted, right) in [
            (self.read, Access::REMOTE_READ),
            (self.write, Access::REMOTE_WRITE),
            (self.atomic, Access::REMOTE_ATOMIC),
        ] {
            if wanted {
                access = access.union(right);
            }
        }
        access
    }
}

/// A new export: its id and what the peer needs to reach the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportHandout {
    pub export: ExportId,
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
}

#[cfg(test)]
impl ExportHandout {
    /// (export, addr, rkey, len).
    fn parts(self) -> (ExportId, u64, u32, u64) {
        (self.export, self.addr, self.rkey, self.len)
    }
}

/// A new queue pair handed to its client: its id, descriptors of its ring memfd, its
/// doorbell (write end) and completion channel (read end), the ring's size and depths.
#[derive(Debug)]
pub struct QpHandout {
    pub id: QpId,
    pub qp_num: u32,
    pub ring: std::os::fd::OwnedFd,
    pub doorbell: std::os::fd::OwnedFd,
    pub completion: std::os::fd::OwnedFd,
    pub ring_size: u64,
    pub sq_entries: u32,
    pub cq_entries: u32,
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

/// The daemon's state.
#[derive(Debug)]
pub struct Engine {
    /// Sessions, regions, keys and queue pairs.
    registry: Arc<Registry>,
    /// One data-path worker per device, by device name.
    workers: std::collections::HashMap<String, Arc<datapath::worker::Worker>>,
    pools: Vec<Arc<Pool>>,
    refill: Arc<pool::Refill>,
    refill_thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    devices: Vec<DeviceEntry>,
    config: RwLock<Arc<Config>>,
    config_path: PathBuf,
    started: SystemTime,
    reloads: AtomicU32,
}

impl Engine {
    /// Opens the devices `config` (and the `--provider` override) select.
    pub fn start(
        config: Config,
        config_path: PathBuf,
        provider: Option<ProviderChoice>,
    ) -> Result<Engine, EngineError> {
        let selection = DeviceSelection::from_config(&config, &config_path, provider);
        let devices = open_devices(&selection)?;
        let refill = Arc::new(pool::Refill::default());
        let mut pools = Vec::new();
        for pool_config in config.effective_pools() {
            let entry = match &pool_config.device {
                Some(name) => devices
                    .iter()
                    .find(|d| d.device.name() == name)
                    .expect("open_devices checked that every pool's device is served"),
                None => &devices[0],
            };
            pools.push(Arc::new(Pool::new(
                pool_config,
                entry.device.name().to_owned(),
                Arc::clone(&entry.pd),
                Arc::clone(&refill),
            )));
        }
        let refill_thread = pool::spawn_refill_thread(pools.clone(), Arc::clone(&refill))
            .map_err(|e| EngineError::Startup(format!("cannot start the refill thread: {e}")))?;
        refill.poke();
        let registry = Arc::new(Registry::default());
        let mut workers = std::collections::HashMap::new();
        for entry in &devices {
            let worker = datapath::worker::Worker::spawn(
                entry.device.name(),
                Arc::downgrade(&registry),
                std::time::Duration::from_micros(u64::from(config.daemon.worker_spin_us)),
            )
            .map_err(|e| EngineError::Startup(format!("cannot start a data-path worker: {e}")))?;
            workers.insert(entry.device.name().to_owned(), Arc::new(worker));
        }
        let listening: Vec<Arc<datapath::worker::Worker>> = workers.values().cloned().collect();
        registry.set_qp_listener(Box::new(move |ids| {
            for worker in &listening {
                worker.remove(ids);
            }
        }));
        let retrying: Vec<std::sync::Weak<dyn crate::provider::Device>> = devices
            .iter()
            .map(|entry| Arc::downgrade(&entry.device))
            .collect();
        registry.set_release_listener(Box::new(move || {
            for device in retrying.iter().filter_map(std::sync::Weak::upgrade) {
                device.retry_lingering();
            }
        }));
        let engine = Engine {
            registry,
            workers,
            pools,
            refill,
            refill_thread: std::sync::Mutex::new(Some(refill_thread)),
            devices,
            config: RwLock::new(Arc::new(config)),
            config_path,
            started: SystemTime::now(),
            reloads: AtomicU32::new(0),
        };
        Ok(engine)
    }

    /// What the quotas of a configuration draw on: the pools served here, as configured at
    /// start, and each device's memory windows (`max_mw`).
    pub fn capacities(&self) -> (Vec<PoolConfig>, Vec<(String, u64)>) {
        let pools = self.pool_configs();
        let windows = self
            .devices
            .iter()
            .filter_map(|d| {
                Some((
                    d.device.name().to_owned(),
                    u64::from(d.device.attributes().ok()?.max_mw),
                ))
            })
            .collect();
        (pools, windows)
    }

    /// The pools served here, as configured when the engine started.
    pub fn pool_configs(&self) -> Vec<PoolConfig> {
        self.pools.iter().map(|p| p.config.clone()).collect()
    }

    #[cfg(test)]
    fn devices(&self) -> &[DeviceEntry] {
        &self.devices
    }

    fn device(&self, name: &str) -> Result<&DeviceEntry, EngineError> {
        self.devices
            .iter()
            .find(|d| d.device.name() == name)
            .ok_or_else(|| EngineError::NoSuchDevice {
                name: name.to_owned(),
                available: self.device_list(),
            })
    }

    /// The devices served, for messages: `a, b`, or `none`.
    fn device_list(&self) -> String {
        let names: Vec<&str> = self.devices.iter().map(|d| d.device.name()).collect();
        if names.is_empty() {
            "none".to_owned()
        } else {
            names.join(", ")
        }
    }

    // Devices.

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

    // Sessions.

    /// Opens a session for `owner`, within `limits`.
    pub fn open_session(&self, owner: &Owner, limits: &Limits) -> Result<SessionId, EngineError> {
        self.registry.open_session(owner, limits)
    }

    /// Closes session `id` (`owner`'s user's, or anyone's in scope `All`); returns what
    /// was removed with it.
    pub fn close_session(
        &self,
        owner: &Owner,
        scope: Scope,
        id: SessionId,
    ) -> Result<Removed, EngineError> {
        self.registry.close_session(owner, scope, id)
    }

    /// Closes every session of a bus connection that left the bus; returns what was
    /// removed.
    pub fn close_sessions_of(&self, connection: &str) -> Removed {
        self.registry.close_sessions_of(connection)
    }

    /// Closes every session (the bus is going away); returns what was removed.
    pub fn close_all(&self) -> Removed {
        self.registry.close_all()
    }

    pub fn session(
        &self,
        viewer: &Owner,
        scope: Scope,
        id: SessionId,
    ) -> Result<SessionInfo, EngineError> {
        self.registry.session(viewer, scope, id)
    }

    pub fn sessions(&self, viewer: &Owner, scope: Scope) -> Vec<SessionInfo> {
        self.registry.sessions(viewer, scope)
    }

    // Regions and keys.

    /// Allocates a region of at least `size` bytes from pool `pool` into `session`
    /// (`owner`'s), within `limits` and if `pools` admits the pool.
    pub fn allocate(
        &self,
        owner: &Owner,
        limits: &Limits,
        pools: &PoolAccess,
        session: SessionId,
        pool: &str,
        size: u64,
    ) -> Result<Handout, EngineError> {
        let pool = self.pool(pool)?;
        self.registry
            .allocate(owner, limits, pools, session, pool, size)
    }

    /// Frees region `id` (`owner`'s connection's); returns what was removed.
    pub fn free(&self, owner: &Owner, id: RegionId) -> Result<Removed, EngineError> {
        self.registry.free(owner, id)?;
        Ok(Removed {
            regions: vec![id],
            ..Removed::default()
        })
    }

    /// Creates an access key for region `id` (`owner`'s connection's), within `limits`;
    /// returns the token and the key's id.
    pub fn share(
        &self,
        owner: &Owner,
        limits: &Limits,
        id: RegionId,
        access: AttachMode,
        lifetime: Option<Duration>,
    ) -> Result<(String, KeyId), EngineError> {
        self.registry.share(owner, limits, id, access, lifetime)
    }

    /// Revokes key `key` (its region's owner's, or anyone's in scope `All`).
    pub fn revoke(&self, owner: &Owner, scope: Scope, key: KeyId) -> Result<(), EngineError> {
        self.registry.revoke(owner, scope, key)
    }

    /// Revokes key `key` of region `region`, which `viewer` must see.
    pub fn revoke_of_region(
        &self,
        owner: &Owner,
        scope: Scope,
        region: RegionId,
        key: KeyId,
    ) -> Result<(), EngineError> {
        let info = self.registry.region(owner, scope, region)?;
        if !info.keys.iter().any(|k| k.id == key) {
            return Err(EngineError::NoSuchObject(format!(
                "key {key} of region {region}"
            )));
        }
        self.registry.revoke(owner, scope, key)
    }

    /// Attaches the region `token` grants to `session` (`owner`'s), if `pools` admits its
    /// pool.
    pub fn attach(
        &self,
        owner: &Owner,
        pools: &PoolAccess,
        session: SessionId,
        token: &str,
    ) -> Result<Handout, EngineError> {
        self.registry.attach(owner, pools, session, token)
    }

    /// Ends the attachment of region `id` to a session of `owner`'s connection.
    pub fn detach(&self, owner: &Owner, id: RegionId) -> Result<(), EngineError> {
        self.registry.detach(owner, id)
    }

    pub fn region(
        &self,
        viewer: &Owner,
        scope: Scope,
        id: RegionId,
    ) -> Result<RegionInfo, EngineError> {
        self.registry.region(viewer, scope, id)
    }

    pub fn regions(&self, viewer: &Owner, scope: Scope) -> Vec<RegionInfo> {
        self.registry.regions(viewer, scope)
    }

    // Quotas.

    /// The limits of the user `limits` are for, next to its live use.
    pub fn quota(&self, limits: &Limits) -> Vec<QuotaLine> {
        self.registry.quota(limits)
    }

    // Queue pairs.

    /// Creates a queue pair for `session` (`owner`'s) on `device`, within `limits`, and
    /// starts serving its rings.
    pub fn create_qp(
        &self,
        owner: &Owner,
        limits: &Limits,
        session: SessionId,
        device: &str,
        options: QpOptions,
    ) -> Result<QpHandout, EngineError> {
        let entry = self.device(device)?;
        let (id, record) = self
            .registry
            .create_qp(owner, limits, session, entry, options)?;
        if let Some(worker) = self.workers.get(device) {
            worker.add(id, Arc::clone(&record));
            // The session may have been closed since the registry took the QP, and the
            // worker told to let go of it before it had it: look again now that it has it.
            if self.registry.own_qp(owner, id).is_err() {
                worker.remove(&[id]);
                return Err(EngineError::NoSuchObject(format!(
                    "session {session} (closed while the queue pair was made)"
                )));
            }
        }
        let dup = |fd: std::os::fd::BorrowedFd<'_>| {
            fd.try_clone_to_owned()
                .map_err(|e| EngineError::Io(format!("cannot hand out queue pair {id}: {e}")))
        };
        let handout = (|| {
            Ok(QpHandout {
                id,
                qp_num: record.local.qp_num,
                ring: dup(record.ring.fd())?,
                doorbell: dup(record.doorbell.client_end())?,
                completion: dup(record.completion_event.client_end())?,
                ring_size: record.ring.len() as u64,
                sq_entries: record.layout.sq_entries,
                cq_entries: record.layout.cq_entries,
            })
        })();
        if handout.is_err() {
            let _ = self.registry.destroy_qp(owner, id);
        }
        handout
    }

    /// Whether `owner`'s connection owns queue pair `id`.
    pub fn owns_qp(&self, owner: &Owner, id: QpId) -> bool {
        self.registry.own_qp(owner, id).is_ok()
    }

    /// What a peer needs to connect to queue pair `id` (`owner`'s connection's).
    pub fn qp_endpoint(&self, owner: &Owner, id: QpId) -> Result<LocalEndpoint, EngineError> {
        Ok(self.registry.own_qp(owner, id)?.local.clone())
    }

    /// Connects queue pair `id` (`owner`'s connection's) to `peer`, with the path MTU the
    /// smaller of both ends' and the device's connect defaults (verbs calls: may block).
    pub fn connect_qp(
        &self,
        owner: &Owner,
        id: QpId,
        peer: RemoteEndpoint,
        peer_mtu: u32,
    ) -> Result<(), EngineError> {
        let q = self.registry.own_qp(owner, id)?;
        let mtu = q.local.mtu.min(peer_mtu);
        let entry = self.device(&q.device)?;
        q.connect_with_mtu(entry.device.as_ref(), peer, mtu)
    }

    /// Destroys queue pair `id` (`owner`'s connection's), its windows first; returns what
    /// was removed.
    pub fn destroy_qp(&self, owner: &Owner, id: QpId) -> Result<Removed, EngineError> {
        self.registry.destroy_qp(owner, id)?;
        Ok(Removed {
            qps: vec![id],
            ..Removed::default()
        })
    }

    /// Queue pair `id` (`owner`'s connection's), its state read from the device (may
    /// block).
    pub fn qp(&self, owner: &Owner, id: QpId) -> Result<QpInfo, EngineError> {
        Ok(qp_info(id, self.registry.own_qp(owner, id)?.as_ref()))
    }

    /// The queue pairs `viewer` may see, their states read from the device (may block).
    pub fn qps(&self, viewer: &Owner, scope: Scope) -> Vec<QpInfo> {
        self.registry
            .qps(viewer, scope)
            .iter()
            .map(|(id, q)| qp_info(*id, q))
            .collect()
    }

    // Exports.

    /// Binds a type-2 window over region `region` through QP `qp` (both `owner`'s
    /// connection's, on one device, the QP connected) so the QP's peer can reach it with
    /// `rights`, within the `exports` limit of `limits`. Every call binds a window of its
    /// own, with its own rkey and export id.
    pub fn export_remote(
        &self,
        owner: &Owner,
        limits: &Limits,
        region: RegionId,
        qp_id: QpId,
        rights: RemoteRights,
    ) -> Result<ExportHandout, EngineError> {
        let access = rights.access();
        if access == crate::provider::Access::NONE {
            return Err(EngineError::InvalidArgument(
                "an export must grant the peer something: read, write or atomics".into(),
            ));
        }
        let q = self.registry.own_qp(owner, qp_id)?;
        let (mr, device) = self.registry.own_region_mr(owner, region)?;
        if device != q.device {
            return Err(EngineError::InvalidArgument(format!(
                "region {region} is registered on {device}, queue pair {qp_id} is on {}",
                q.device
            )));
        }
        if q.state() != QpState::Rts {
            return Err(EngineError::InvalidArgument(format!(
                "queue pair {qp_id} is not connected: Connect it before exporting through it"
            )));
        }
        self.registry.reserve(limits, QuotaKind::Exports, 1)?;
        let bound = self
            .bind_window(owner, region, qp_id, &q, &mr, access)
            .and_then(|window| {
                let rkey = window.rkey();
                Ok((self.registry.add_export(region, qp_id, window)?, rkey))
            });
        match bound {
            Ok((export, rkey)) => Ok(ExportHandout {
                export,
                addr: mr.addr(),
                rkey,
                len: mr.len() as u64,
            }),
            Err(e) => {
                self.registry
                    .unreserve(limits.uid, &[(QuotaKind::Exports, 1)]);
                Err(e)
            }
        }
    }

    /// Allocates a type-2 window and binds it over `mr` through QP `qp_id` (the
    /// device's worker posts the bind).
    fn bind_window(
        &self,
        owner: &Owner,
        region: RegionId,
        qp_id: QpId,
        q: &QueuePairRecord,
        mr: &Arc<dyn crate::provider::MemoryRegion>,
        access: crate::provider::Access,
    ) -> Result<Arc<dyn crate::provider::MemoryWindow>, EngineError> {
        use crate::provider::{MwType, SendOp};
        let entry = self.device(&q.device)?;
        let window = entry.pd.alloc_mw(MwType::Type2)?;
        let worker = self
            .workers
            .get(&q.device)
            .ok_or_else(|| EngineError::Io(format!("no data-path worker for {}", q.device)))?;
        worker
            .run(
                qp_id,
                SendOp::BindMw {
                    mw: Arc::clone(&window),
                    mr: Arc::clone(mr),
                    addr: mr.addr(),
                    len: mr.len() as u64,
                    access,
                },
            )
            .map_err(|e| {
                // Destroyed (or its session closed) meanwhile: that is what the caller hears.
                if self.registry.own_qp(owner, qp_id).is_err() {
                    EngineError::NoSuchObject(format!(
                        "queue pair {qp_id} (destroyed while the export was being made)"
                    ))
                } else {
                    EngineError::Io(format!("cannot bind a window over region {region}: {e}"))
                }
            })?;
        Ok(window)
    }

    /// Invalidates and releases export `export` of region `region` (`owner`'s
    /// connection's): the peer's rkey stops working.
    pub fn release_export(
        &self,
        owner: &Owner,
        region: RegionId,
        export: ExportId,
    ) -> Result<(), EngineError> {
        let (qp_id, taken) = self.registry.remove_export(owner, region, export)?;
        let device = self.registry.own_qp(owner, qp_id).map(|q| q.device.clone());
        if let Some(worker) = device.ok().and_then(|d| self.workers.get(&d)) {
            let rkey = taken.window.rkey();
            if let Err(e) = worker.run(qp_id, crate::provider::SendOp::LocalInvalidate { rkey }) {
                // Dropping the window below invalidates it as well. A QP destroyed since it
                // was looked up (its session closed, `Destroy`) is no surprise.
                if self.registry.own_qp(owner, qp_id).is_ok() {
                    tracing::warn!(region, export, "invalidation failed: {e}");
                } else {
                    tracing::debug!(region, export, "the queue pair went away first: {e}");
                }
            }
        }
        // Deallocated whether or not the invalidation worked; the QP (which may have been
        // destroyed meanwhile) and the registration (the region may have been freed) go
        // only after the window.
        drop(taken);
        Ok(())
    }

    // Pools, counts, configuration.

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

    fn pool(&self, name: &str) -> Result<&Arc<Pool>, EngineError> {
        self.pools.iter().find(|p| p.name() == name).ok_or_else(|| {
            let names: Vec<&str> = self.pools.iter().map(|p| p.name()).collect();
            EngineError::NoSuchObject(format!("pool {name:?} (pools: {})", names.join(", ")))
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        Arc::clone(&self.config.read().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn config_path(&self) -> &std::path::Path {
        &self.config_path
    }

    pub fn started(&self) -> SystemTime {
        self.started
    }

    pub fn reload_count(&self) -> u32 {
        self.reloads.load(Ordering::Relaxed)
    }

    /// Re-reads the configuration file. On error the configuration in force stays.
    /// Settings that only take effect at start (provider, devices) are reported in the
    /// returned list so the caller can log that they need a restart; a file naming a device
    /// the host does not have is refused, as the next start would refuse it.
    pub fn reload(&self) -> Result<(Arc<Config>, Vec<String>), ConfigError> {
        let new = Arc::new(Config::load_or_default(&self.config_path)?);
        let host = devices::host_device_names(&self.devices);
        let host: Vec<&str> = host.iter().map(String::as_str).collect();
        devices::check_named_devices(&new, &self.config_path, &host).map_err(|e| e.located())?;
        let mut slot = self.config.write().unwrap_or_else(|e| e.into_inner());
        let mut needs_restart = Vec::new();
        if new.daemon.provider != slot.daemon.provider
            || new.daemon.loopback_fallback != slot.daemon.loopback_fallback
        {
            needs_restart.push("daemon.provider/loopback_fallback".to_owned());
        }
        if new.daemon.worker_spin_us != slot.daemon.worker_spin_us {
            needs_restart.push("daemon.worker_spin_us".to_owned());
        }
        if new.devices != slot.devices {
            needs_restart.push("[[device]]".to_owned());
        }
        if new.effective_pools() != slot.effective_pools() {
            needs_restart.push("[[pool]]".to_owned());
        }
        *slot = Arc::clone(&new);
        drop(slot);
        self.reloads.fetch_add(1, Ordering::Relaxed);
        Ok((new, needs_restart))
    }

    /// What the devices refused to destroy (kept, counted among the live objects, and
    /// retried after every teardown and by the service every few seconds), by device.
    pub fn lingering(&self) -> Vec<(String, crate::provider::Lingering)> {
        self.devices
            .iter()
            .flat_map(|entry| {
                let name = entry.device.name().to_owned();
                entry
                    .device
                    .lingering()
                    .into_iter()
                    .map(move |l| (name.clone(), l))
            })
            .collect()
    }

    /// Tries again to destroy what the devices refused to; returns how many objects are
    /// still left.
    pub fn retry_lingering(&self) -> usize {
        retry_lingering_on(&self.devices)
    }

    /// Provider objects alive on all devices (the daemon's own PDs included).
    pub fn provider_counts(&self) -> ObjectCounts {
        let mut total = ObjectCounts::default();
        for entry in &self.devices {
            let c = entry.device.object_counts();
            total.pds += c.pds;
            total.mrs += c.mrs;
            total.mws += c.mws;
            total.cqs += c.cqs;
            total.qps += c.qps;
        }
        total
    }

    /// One line for systemd's `STATUS=` and `rdmactl status`.
    pub fn status_line(&self) -> String {
        let devices: Vec<String> = self
            .devices
            .iter()
            .map(|d| format!("{} ({})", d.device.name(), d.device.provider()))
            .collect();
        let (sessions, regions, _) = self.registry.counts();
        let lingering = self.lingering().len();
        format!(
            "Serving {} device{}: {}; {sessions} session{}, {regions} region{}{}",
            devices.len(),
            if devices.len() == 1 { "" } else { "s" },
            devices.join(", "),
            if sessions == 1 { "" } else { "s" },
            if regions == 1 { "" } else { "s" },
            match lingering {
                0 => String::new(),
                n => format!(
                    "; {n} object{} the device refused to destroy (rdmactl dev)",
                    if n == 1 { "" } else { "s" }
                ),
            }
        )
    }

    /// Releases everything, children before parents. Provider objects log their own
    /// failures on drop and never stop the teardown, so nothing is left behind.
    pub fn shutdown(self) {
        let removed = self.registry.close_all();
        if !removed.sessions.is_empty() {
            tracing::info!(
                sessions = removed.sessions.len(),
                regions = removed.regions.len(),
                "closed the remaining sessions"
            );
        }
        lock(&self.refill.wanted).stop = true;
        self.refill.wake.notify_all();
        if let Some(thread) = lock(&self.refill_thread).take() {
            if thread.join().is_err() {
                tracing::error!("the refill thread panicked");
            }
        }
        drop(self.workers);
        for pool in &self.pools {
            pool.drain();
        }
        drop(self.pools);
        let left = retry_lingering_on(&self.devices);
        if left > 0 {
            tracing::error!(
                "{left} registration(s) or window(s) could not be destroyed: the kernel \
                 releases them when rdmad exits"
            );
        }
        for entry in self.devices {
            tracing::debug!(device = entry.device.name(), "closing device");
            drop(entry);
        }
    }
}

/// A queue pair's snapshot; its state from the device.
fn qp_info(id: QpId, q: &QueuePairRecord) -> QpInfo {
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
        posted: counter(&q.counters.posted),
        completed: counter(&q.counters.completed),
        failed: counter(&q.counters.failed),
        refused: counter(&q.counters.refused),
    }
}

/// Retries what `devices` refused to destroy; returns how many objects are still left.
fn retry_lingering_on(devices: &[DeviceEntry]) -> usize {
    devices
        .iter()
        .map(|entry| entry.device.retry_lingering())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn config_file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    #[test]
    fn loopback_engine_serves_one_device_with_a_pd() {
        let file = config_file("");
        let engine = Engine::start(
            Config::default(),
            file.path().to_owned(),
            Some(ProviderChoice::Loopback),
        )
        .unwrap();
        assert_eq!(engine.devices().len(), 1);
        let entry = engine.device("loopback0").unwrap();
        assert_eq!(entry.port, 1);
        assert_eq!(engine.provider_counts().pds, 1);
        assert_eq!(
            engine.status_line(),
            "Serving 1 device: loopback0 (loopback); 0 sessions, 0 regions"
        );
        match engine.device("mlx5_0") {
            Err(e @ EngineError::NoSuchDevice { .. }) => {
                assert_eq!(
                    e.to_string(),
                    "no device named \"mlx5_0\" (devices: loopback0)"
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn reload_swaps_valid_config_and_keeps_old_on_error() {
        let mut file = config_file("[daemon]\nlog_level = \"info\"\n");
        let engine = Engine::start(
            Config::load(file.path()).unwrap(),
            file.path().to_owned(),
            Some(ProviderChoice::Loopback),
        )
        .unwrap();

        file.as_file_mut().set_len(0).unwrap();
        std::fs::write(file.path(), "[daemon]\nlog_level = \"debug\"\n").unwrap();
        let (new, restart) = engine.reload().unwrap();
        assert_eq!(new.daemon.log_level, crate::config::LogLevel::Debug);
        assert!(restart.is_empty());
        assert_eq!(engine.reload_count(), 1);

        std::fs::write(file.path(), "[daemon]\nlog_level = \"loud\"\n").unwrap();
        let err = engine.reload().unwrap_err();
        assert_eq!((err.line, err.key.as_str()), (2, "daemon.log_level"));
        assert_eq!(
            engine.config().daemon.log_level,
            crate::config::LogLevel::Debug
        );
        assert_eq!(engine.reload_count(), 1);

        std::fs::write(file.path(), "[[device]]\nname = \"loopback0\"\n").unwrap();
        let (_, restart) = engine.reload().unwrap();
        assert_eq!(restart, vec!["[[device]]".to_owned()]);
        assert_eq!(engine.reload_count(), 2);

        // A device or pool device the host does not have: the next start would refuse it.
        for (text, line, key) in [
            (
                "[quota.default]\nregions = 3\n\n[[device]]\nname = \"mlx5_0\"\n",
                5,
                "device[0].name",
            ),
            (
                "[[pool]]\nname = \"p\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\n\
                 device = \"mlx5_0\"\n",
                5,
                "pool[0].device",
            ),
        ] {
            std::fs::write(file.path(), text).unwrap();
            let err = engine.reload().unwrap_err();
            assert_eq!((err.line, err.key.as_str()), (line, key), "{err}");
            assert!(err.message.contains("\"mlx5_0\""), "{err}");
            assert_eq!(engine.reload_count(), 2);
            assert_eq!(engine.config().devices[0].name, "loopback0");
        }
    }

    #[test]
    fn shutdown_releases_every_provider_object() {
        let engine = Engine::start(
            Config::default(),
            PathBuf::from("/dev/null"),
            Some(ProviderChoice::Loopback),
        )
        .unwrap();
        let device = Arc::clone(&engine.devices()[0].device);
        assert_eq!(device.object_counts().pds, 1);
        engine.shutdown();
        assert_eq!(device.object_counts(), ObjectCounts::default());
    }

    /// A queue pair whose session is closed while it is being created is not left to the
    /// data-path worker, which would keep it (and its CQ) alive with no session. Found while
    /// fuzzing the D-Bus surface (`tests/tests/fuzz_dbus.rs`); the race is swept by closing
    /// the session a little later in every round.
    #[test]
    fn a_queue_pair_made_while_its_session_closes_is_released() {
        let engine = Arc::new(
            Engine::start(
                Config::default(),
                PathBuf::from("/dev/null"),
                Some(ProviderChoice::Loopback),
            )
            .unwrap(),
        );
        let owner = Owner {
            uid: 0,
            connection: ":1.1".into(),
            pid: None,
        };
        let limits = Limits::unlimited(0);
        let baseline = engine.provider_counts();
        // How long one creation takes, to spread the closings over it.
        let started = std::time::Instant::now();
        let session = engine.open_session(&owner, &limits).unwrap();
        drop(engine.create_qp(&owner, &limits, session, "loopback0", QpOptions::default()));
        let span = started.elapsed().max(std::time::Duration::from_micros(20));
        engine.close_session(&owner, Scope::Own, session).unwrap();
        let rounds = 3000u32;
        for round in 0..rounds {
            let session = engine.open_session(&owner, &limits).unwrap();
            let barrier = Arc::new(std::sync::Barrier::new(2));
            let closer = {
                let (engine, owner, barrier) =
                    (Arc::clone(&engine), owner.clone(), Arc::clone(&barrier));
                let delay = span * round / rounds;
                std::thread::spawn(move || {
                    barrier.wait();
                    let until = std::time::Instant::now() + delay;
                    while std::time::Instant::now() < until {
                        std::hint::spin_loop();
                    }
                    engine.close_session(&owner, Scope::Own, session).unwrap();
                })
            };
            barrier.wait();
            drop(engine.create_qp(&owner, &limits, session, "loopback0", QpOptions::default()));
            closer.join().unwrap();
        }
        assert_eq!(engine.registry.qp_count(), 0);
        let after = engine.provider_counts();
        assert_eq!((after.qps, after.cqs), (baseline.qps, baseline.cqs));
    }
}
