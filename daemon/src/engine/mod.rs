//! The engine: everything rdmad owns — devices with their protection domains, pools,
//! sessions, regions, keys, queue pairs and exports — behind one face, [`Engine`]. The
//! D-Bus layer calls in with plain inputs the policy layer made (an [`Owner`], [`Limits`],
//! a [`Scope`], [`PoolAccess`]); the providers are called out to. No zbus types and no
//! bus callers here. Its submodules are private: what it offers is what this file exports.

mod connections;
mod datapath;
mod devices;
mod error;
mod ids;
mod pool;
mod qp;
mod queue_pairs;
mod registry;
mod releaser;
mod sessions;
mod snapshots;
mod tenancy;
mod token;

/// For the fuzzers and tests only, not part of the engine's face: the request validator
/// the data-path workers run on every submission, so `fuzz/ring_entry` can feed it any
/// bytes.
#[doc(hidden)]
pub mod testing {
    pub use super::datapath::validate::{check_into, RegionRight, RegionRights};
    pub use super::ids::DomainId;
}

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

/// Device facts and errors the engine passes on as the device reports them.
pub use crate::provider::{
    Access, DeviceAttributes, GidEntry, Lingering, ObjectCounts, PortAttributes, ProviderError,
    QpState, RemoteEndpoint, Span,
};
pub use connections::{Connected, ListenOptions, ListenerId, MAX_BACKLOG};
pub use devices::DeviceSelection;
pub use error::EngineError;
pub use pool::{PoolError, PoolStats, REGION_ACCESS};
pub use qp::{ExportId, LocalChoice, LocalEndpoint, QpId, QpOptions};
pub use queue_pairs::{ExportHandout, QpHandout, RemoteRights};
pub use registry::{
    AttachMode, Handout, KeyId, KeyInfo, QuotaLine, RegionId, RegionInfo, RegistrationHandout,
    RegistrationId, Removed, SessionId, SessionInfo,
};
pub use snapshots::{Counts, DeviceSummary, PoolSnapshot, QpInfo};
pub use tenancy::{Limit, Limits, Owner, PoolAccess, QuotaError, Scope, Usage};

use crate::config::{Config, ConfigError, PoolConfig, ProviderChoice, QuotaKind};
use crate::lock::lock;
use devices::{open_devices, DeviceEntry};
use pool::Pool;
use qp::QueuePairRecord;
use registry::Registry;

/// The daemon's state.
#[derive(Debug)]
pub struct Engine {
    /// Sessions, regions, keys and queue pairs.
    registry: Arc<Registry>,
    /// Deregisters and unmaps freed regions behind `Free`'s reply.
    releaser: releaser::Releaser,
    /// One data-path worker per device, by device name.
    /// The data-path workers; each QP is served by one (`QueuePairRecord::worker`).
    workers: Vec<datapath::worker::Worker>,
    pools: Vec<Arc<Pool>>,
    refill: Arc<pool::Refill>,
    refill_thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    devices: Vec<DeviceEntry>,
    config: RwLock<Arc<Config>>,
    config_path: PathBuf,
    started: SystemTime,
    reloads: AtomicU32,
    /// Sessions' listeners for connections by address.
    listeners: connections::Listeners,
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
            .map_err(|e| EngineError::os("cannot start the refill thread", e))?;
        refill.poke();
        let registry = Arc::new(Registry::default());
        let releaser = releaser::Releaser::spawn(
            Arc::clone(&registry),
            devices.iter().map(|d| Arc::clone(&d.device)).collect(),
        )
        .map_err(|e| EngineError::os("cannot start the release thread", e))?;
        let spin = std::time::Duration::from_micros(u64::from(config.daemon.worker_spin_us));
        let workers = (0..config.daemon.worker_count())
            .map(|i| datapath::worker::Worker::spawn(i, spin))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| EngineError::os("cannot start a data-path worker", e))?;
        let engine = Engine {
            registry,
            releaser,
            workers,
            pools,
            refill,
            refill_thread: std::sync::Mutex::new(Some(refill_thread)),
            devices,
            config: RwLock::new(Arc::new(config)),
            config_path,
            started: SystemTime::now(),
            reloads: AtomicU32::new(0),
            listeners: connections::Listeners::default(),
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

    /// Releases what a teardown took out of the registry; returns what it removed. Windows
    /// go first, whatever the data-path workers do: their rkeys die at once, and no window
    /// is left to outlive its memory. Then the workers let go of the removed QPs (bounded:
    /// a worker that does not in time keeps its QPs until it does, and then destroys them
    /// itself), then the QPs go, then the registrations (but for those a request still in
    /// flight holds: the release thread keeps them, and what they hold of quotas and pools,
    /// until it is let go); then what the devices refused to destroy is tried again. The
    /// removed sessions count as sessions until all that is done.
    fn release(&self, teardown: registry::Teardown<'_>) -> Removed {
        let registry::Teardown {
            removed,
            garbage:
                registry::Garbage {
                    windows,
                    registrations,
                    qps,
                    freed,
                    domains,
                },
            releasing,
        } = teardown;
        drop(windows);
        drop(registrations);
        if !removed.qps.is_empty() {
            for worker in &self.workers {
                worker.remove(&removed.qps);
            }
        }
        drop(qps);
        // Regions that requests still in flight (another session's, through an
        // attachment) hold go to the release thread, which keeps them until they are let
        // go; the rest go now.
        let (settlements, held) = registry::Freed::let_go(freed);
        drop(domains);
        self.registry.settle(settlements);
        if !held.is_empty() {
            self.releaser.release(releaser::Deferred { freed: held });
        } else if !removed.qps.is_empty() {
            // The removed QPs' requests let go of what they held: look again at the
            // regions kept for requests in flight.
            self.releaser.look_again();
        }
        self.retry_lingering();
        drop(releasing);
        self.listeners.close_sessions(&removed.sessions);
        removed
    }

    /// Releases a teardown that removed regions only: windows now (no peer may reach the
    /// memory once this returns), the registrations and memory on the release thread once
    /// no request in flight holds them, and the quota and pool use they hold after that.
    fn release_later(&self, teardown: registry::Teardown<'_>) -> Removed {
        if !teardown.removed.qps.is_empty() || !teardown.removed.sessions.is_empty() {
            return self.release(teardown);
        }
        let registry::Teardown {
            removed,
            garbage:
                registry::Garbage {
                    windows,
                    registrations,
                    qps,
                    freed,
                    domains,
                },
            releasing,
        } = teardown;
        drop(windows);
        drop(registrations);
        drop(qps);
        drop(domains);
        self.releaser.release(releaser::Deferred { freed });
        drop(releasing);
        removed
    }

    /// Waits until the releases of regions freed before this call are done, so that counts,
    /// quota use and pool use read after it no longer include them. It may block for as
    /// long as those deregistrations take: call it off the bus's executor.
    pub fn settled(&self) {
        self.releaser.settled();
    }

    /// Whether freed regions are still being released (when [`Engine::settled`] would wait).
    pub fn releases_pending(&self) -> bool {
        self.releaser.pending()
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
        let removed = self.close_all();
        self.releaser.stop();
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
mod tests;
