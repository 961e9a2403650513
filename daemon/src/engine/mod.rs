//! The registry of everything rdmad owns: devices with their protection domains now,
//! sessions, regions and queue pairs as they arrive. No zbus types here; the D-Bus layer
//! calls in, the providers are called out to.

pub mod datapath;
mod devices;
pub mod pool;
pub mod qp;
pub mod registry;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

pub use devices::{open_devices, DeviceEntry, DeviceSelection};
pub use pool::{Pool, PoolStats};
pub use registry::{AttachMode, Handout, KeyId, RegionId, Registry, Removed, SessionId};

use crate::config::{Config, ConfigError, PoolConfig, ProviderChoice};
use crate::lock::lock;
use crate::policy::quota::{Capacity, OversizedQuota, QuotaError};
use crate::provider::{ObjectCounts, ProviderError};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("no device named {name:?} (devices: {available})")]
    NoSuchDevice { name: String, available: String },
    #[error(transparent)]
    Provider(#[from] ProviderError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Startup(String),
    #[error("{0} does not exist")]
    NoSuchObject(String),
    #[error("{0}")]
    NotAuthorized(String),
    #[error(transparent)]
    Quota(#[from] QuotaError),
    #[error("{0}")]
    PoolExhausted(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    Io(String),
}

/// The daemon's state.
#[derive(Debug)]
pub struct Engine {
    /// Sessions, regions, keys and queue pairs.
    pub registry: Arc<Registry>,
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
        engine.warn_of_oversized_quotas(&engine.config());
        Ok(engine)
    }

    /// The quotas of `config` under which one user could take a whole pool served here,
    /// or every memory window of a device.
    pub fn oversized_quotas(&self, config: &Config) -> Vec<OversizedQuota> {
        let pools: Vec<PoolConfig> = self.pools.iter().map(|p| p.config.clone()).collect();
        let devices: Vec<Capacity> = self
            .devices
            .iter()
            .filter_map(|d| {
                Some(Capacity {
                    name: d.device.name().to_owned(),
                    amount: u64::from(d.device.attributes().ok()?.max_mw),
                })
            })
            .collect();
        crate::policy::quota::oversized(config, &pools, &devices)
    }

    /// One warning per quota that protects nothing (see [`Engine::oversized_quotas`]).
    fn warn_of_oversized_quotas(&self, config: &Config) {
        for q in self.oversized_quotas(config) {
            tracing::warn!(table = %q.table, key = q.kind.key(), "{q}");
        }
    }

    pub fn devices(&self) -> &[DeviceEntry] {
        &self.devices
    }

    pub fn device(&self, name: &str) -> Result<&DeviceEntry, EngineError> {
        self.devices
            .iter()
            .find(|d| d.device.name() == name)
            .ok_or_else(|| EngineError::NoSuchDevice {
                name: name.to_owned(),
                available: self.device_names(),
            })
    }

    fn device_names(&self) -> String {
        let names: Vec<&str> = self.devices.iter().map(|d| d.device.name()).collect();
        if names.is_empty() {
            "none".to_owned()
        } else {
            names.join(", ")
        }
    }

    /// Creates a queue pair for `session` on `device` and starts serving its rings.
    pub fn create_qp(
        &self,
        caller: &crate::policy::Caller,
        session: SessionId,
        device: &str,
        options: qp::QpOptions,
    ) -> Result<(qp::QpId, Arc<qp::QueuePairRecord>), EngineError> {
        let entry = self.device(device)?;
        let (id, record) =
            self.registry
                .create_qp(&self.config(), caller, session, entry, options)?;
        if let Some(worker) = self.workers.get(device) {
            worker.add(id, Arc::clone(&record));
            // The session may have been closed since the registry took the QP, and the
            // worker told to let go of it before it had it: look again now that it has it.
            if self.registry.own_qp(caller, id).is_err() {
                worker.remove(&[id]);
                return Err(EngineError::NoSuchObject(format!(
                    "session {session} (closed while the queue pair was made)"
                )));
            }
        }
        Ok((id, record))
    }

    /// Binds a type-2 window over region `region` through QP `qp` (both the caller's, on
    /// one device, the QP connected) so the QP's peer can reach it with `access`, within
    /// the caller's `exports` quota. Every call binds a window of its own, with its own
    /// rkey and export id. Returns the export id and what the peer needs:
    /// `(addr, rkey, length)`.
    pub fn export_remote(
        &self,
        caller: &crate::policy::Caller,
        region: RegionId,
        qp_id: qp::QpId,
        access: crate::provider::Access,
    ) -> Result<(qp::ExportId, u64, u32, u64), EngineError> {
        use crate::config::QuotaKind;
        use crate::provider::QpState;
        let q = self.registry.own_qp(caller, qp_id)?;
        let (mr, device) = self.registry.own_region_mr(caller, region)?;
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
        self.registry
            .reserve(&self.config(), caller, QuotaKind::Exports, 1)?;
        let bound = self
            .bind_window(caller, region, qp_id, &q, &mr, access)
            .and_then(|window| {
                let rkey = window.rkey();
                Ok((self.registry.add_export(region, qp_id, window)?, rkey))
            });
        match bound {
            Ok((export, rkey)) => Ok((export, mr.addr(), rkey, mr.len() as u64)),
            Err(e) => {
                self.registry
                    .unreserve(caller.uid, &[(QuotaKind::Exports, 1)]);
                Err(e)
            }
        }
    }

    /// Allocates a type-2 window and binds it over `mr` through QP `qp_id` (the
    /// device's worker posts the bind).
    fn bind_window(
        &self,
        caller: &crate::policy::Caller,
        region: RegionId,
        qp_id: qp::QpId,
        q: &qp::QueuePairRecord,
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
                if self.registry.own_qp(caller, qp_id).is_err() {
                    EngineError::NoSuchObject(format!(
                        "queue pair {qp_id} (destroyed while the export was being made)"
                    ))
                } else {
                    EngineError::Io(format!("cannot bind a window over region {region}: {e}"))
                }
            })?;
        Ok(window)
    }

    /// Invalidates and releases an export: the peer's rkey stops working.
    pub fn release_export(
        &self,
        caller: &crate::policy::Caller,
        region: RegionId,
        export: qp::ExportId,
    ) -> Result<(), EngineError> {
        let (qp_id, taken) = self.registry.remove_export(caller, region, export)?;
        let device = self
            .registry
            .own_qp(caller, qp_id)
            .map(|q| q.device.clone());
        if let Some(worker) = device.ok().and_then(|d| self.workers.get(&d)) {
            let rkey = taken.window.rkey();
            if let Err(e) = worker.run(qp_id, crate::provider::SendOp::LocalInvalidate { rkey }) {
                // Dropping the window below invalidates it as well. A QP destroyed since it
                // was looked up (its session closed, `Destroy`) is no surprise.
                if self.registry.own_qp(caller, qp_id).is_ok() {
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

    pub fn pools(&self) -> &[Arc<Pool>] {
        &self.pools
    }

    pub fn pool(&self, name: &str) -> Result<&Arc<Pool>, EngineError> {
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
        self.warn_of_oversized_quotas(&new);
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
        let caller = crate::policy::Caller {
            bus_name: ":1.1".into(),
            uid: 0,
            gids: Vec::new(),
            pid: None,
        };
        let baseline = engine.provider_counts();
        // How long one creation takes, to spread the closings over it.
        let started = std::time::Instant::now();
        let session = engine
            .registry
            .open_session(&engine.config(), &caller)
            .unwrap();
        drop(engine.create_qp(&caller, session, "loopback0", qp::QpOptions::default()));
        let span = started.elapsed().max(std::time::Duration::from_micros(20));
        engine
            .registry
            .close_session(&engine.config(), &caller, session)
            .unwrap();
        let rounds = 3000u32;
        for round in 0..rounds {
            let session = engine
                .registry
                .open_session(&engine.config(), &caller)
                .unwrap();
            let barrier = Arc::new(std::sync::Barrier::new(2));
            let closer = {
                let (engine, caller, barrier) =
                    (Arc::clone(&engine), caller.clone(), Arc::clone(&barrier));
                let delay = span * round / rounds;
                std::thread::spawn(move || {
                    barrier.wait();
                    let until = std::time::Instant::now() + delay;
                    while std::time::Instant::now() < until {
                        std::hint::spin_loop();
                    }
                    engine
                        .registry
                        .close_session(&engine.config(), &caller, session)
                        .unwrap();
                })
            };
            barrier.wait();
            drop(engine.create_qp(&caller, session, "loopback0", qp::QpOptions::default()));
            closer.join().unwrap();
        }
        assert_eq!(engine.registry.qp_count(), 0);
        let after = engine.provider_counts();
        assert_eq!((after.qps, after.cqs), (baseline.qps, baseline.cqs));
    }
}
