//! The library's connection to rdmad: one bus connection per process, opened on first use
//! on the bus `RDMAD_BUS_ADDRESS` names (else the system bus), and over it a direct
//! connection to rdmad (`Manager.OpenDirect`) that every call goes on, skipping the bus
//! daemon; the bus connection watches rdmad's name, and carries the calls when no direct
//! connection could be opened. Both are driven by a one-thread
//! runtime the library owns. The verbs calls are synchronous, so each one blocks the
//! calling thread on its call ([`Backend::block_on`]).

use std::sync::OnceLock;

use rdmad_client::proxy::{DeviceProxy, ManagerProxy, QueuePairProxy, SessionProxy};
use rdmad_client::queue_pair::QueuePairRing;
use rdmad_client::types::Endpoint;
use rdmad_client::{Capabilities, GidEntry, PortInfo};
use zbus::zvariant::OwnedObjectPath;
use zbus::zvariant::Value;

/// What the library knows of one device rdmad serves.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub name: String,
    /// `verbs` or `loopback`.
    pub provider: String,
    /// Node GUID in host order.
    pub node_guid: u64,
    pub firmware_version: String,
    pub ports: Vec<PortInfo>,
    pub gids: Vec<GidEntry>,
    pub capabilities: Capabilities,
}

pub struct Backend {
    runtime: tokio::runtime::Runtime,
    /// The bus connection: rdmad's name is watched on it.
    bus: zbus::Connection,
    /// Where the calls go: the direct connection, or the bus connection when rdmad opened
    /// none (it was not running yet, refused — a user's 64 are taken —, or is older than
    /// `Manager.OpenDirect`). See [`Backend::connection`].
    connection: tokio::sync::Mutex<zbus::Connection>,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend").finish_non_exhaustive()
    }
}

static BACKEND: OnceLock<Result<Backend, String>> = OnceLock::new();

/// The process's connection to rdmad, opened on first use. The error says which bus was
/// tried and why it failed; it is kept, so a program that cannot reach rdmad is told the
/// same thing on every call.
pub fn backend() -> Result<&'static Backend, String> {
    BACKEND
        .get_or_init(Backend::connect)
        .as_ref()
        .map_err(Clone::clone)
}

/// `xxxx:xxxx:xxxx:xxxx` (as rdmad and ibv_devinfo print it) to a number.
pub fn parse_guid(text: &str) -> Option<u64> {
    let hex: String = text.chars().filter(|c| *c != ':').collect();
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(&hex, 16).ok()
}

impl Backend {
    fn connect() -> Result<Backend, String> {
        let bus =
            std::env::var(rdmad_client::names::BUS_ADDRESS_ENV).unwrap_or_else(|_| "system".into());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("rdmad-verbs")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the library's bus thread: {e}"))?;
        let bus_connection = runtime
            .block_on(rdmad_client::connect(None))
            .map_err(|e| format!("cannot connect to the {bus} bus, where rdmad serves: {e}"))?;
        let connection = runtime
            .block_on(rdmad_client::connect_direct(&bus_connection))
            .unwrap_or_else(|_| bus_connection.clone());
        Ok(Backend {
            runtime,
            bus: bus_connection,
            connection: tokio::sync::Mutex::new(connection),
        })
    }

    /// Calls `on_gone` (on the library's bus thread) with what happened once the rdmad
    /// instance serving now leaves the bus, or at once if none serves now.
    pub fn watch_daemon(&self, on_gone: impl FnOnce(String) + Send + 'static) {
        // The watch starts before this returns: a departure right after is not missed.
        match self.block_on(rdmad_client::DaemonWatch::new(&self.bus)) {
            Ok(mut watch) => {
                self.runtime
                    .spawn(async move { on_gone(watch.gone().await.to_string()) });
            }
            Err(e) => on_gone(format!("rdmad is not on the bus: {}", e.message())),
        }
    }

    /// Runs `f` while the library's bus thread is parked in a task of its own: it makes no
    /// system call meanwhile. Moving pages under the program (`abi::remap`) needs this: the
    /// bus thread's buffers (its socket reads, its `epoll_wait` events) may live in the very
    /// heap pages being moved, and a kernel write into pages made read-only for the move
    /// would fail rather than wait.
    pub fn with_bus_thread_parked<R>(&self, f: impl FnOnce() -> R) -> R {
        let (parked, is_parked) = std::sync::mpsc::sync_channel::<()>(1);
        let (resume, resumed) = std::sync::mpsc::sync_channel::<()>(1);
        self.runtime.spawn(async move {
            let _ = parked.send(());
            // Blocks the runtime's one worker thread until `resume` is dropped.
            let _ = resumed.recv();
        });
        // Err only if the task was dropped unrun (the runtime is shutting down): nothing
        // runs there then either.
        let _ = is_parked.recv();
        let result = f();
        drop(resume);
        result
    }

    /// Runs a bus call to completion on the calling thread.
    pub fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }

    /// The connection calls go on: the direct connection while it is open. Once it has
    /// closed (rdmad stopped, and perhaps another instance serves now) a new one is opened,
    /// or, failing that, the calls go on the bus, as they do when none could be opened.
    async fn connection(&self) -> zbus::Connection {
        // Held across the reopening, so that threads finding it closed at once open one.
        let mut current = self.connection.lock().await;
        if current.is_closed() {
            *current = rdmad_client::connect_direct(&self.bus)
                .await
                .unwrap_or_else(|_| self.bus.clone());
        }
        current.clone()
    }

    async fn manager(&self) -> Result<ManagerProxy<'static>, String> {
        ManagerProxy::new(&self.connection().await)
            .await
            .map_err(|e| format!("cannot reach rdmad: {e}"))
    }

    /// Every device rdmad serves, in its order.
    pub fn devices(&self) -> Result<Vec<DeviceInfo>, String> {
        self.block_on(async {
            let manager = self.manager().await?;
            let summaries = manager
                .list_devices()
                .await
                .map_err(|e| format!("rdmad did not list its devices: {e}"))?;
            let mut devices = Vec::with_capacity(summaries.len());
            for summary in summaries {
                devices.push(
                    self.device(summary.name, summary.provider, summary.path)
                        .await?,
                );
            }
            Ok(devices)
        })
    }

    async fn device(
        &self,
        name: String,
        provider: String,
        path: OwnedObjectPath,
    ) -> Result<DeviceInfo, String> {
        let failed =
            |what: &str, e: zbus::Error| format!("device {name}: cannot read its {what}: {e}");
        let proxy = DeviceProxy::builder(&self.connection().await)
            .path(path)
            .map_err(|e| failed("object", e))?
            .build()
            .await
            .map_err(|e| failed("object", e))?;
        let guid = proxy
            .node_guid()
            .await
            .map_err(|e| failed("node GUID", e))?;
        Ok(DeviceInfo {
            node_guid: parse_guid(&guid).unwrap_or(0),
            firmware_version: proxy
                .firmware_version()
                .await
                .map_err(|e| failed("firmware version", e))?,
            ports: proxy.ports().await.map_err(|e| failed("ports", e))?,
            gids: proxy.gids().await.map_err(|e| failed("GID table", e))?,
            capabilities: proxy
                .capabilities()
                .await
                .map_err(|e| failed("capabilities", e))?,
            name,
            provider,
        })
    }

    /// Opens the session a device context stands for.
    pub fn open_session(&self) -> Result<OwnedObjectPath, String> {
        self.block_on(async {
            self.manager()
                .await?
                .open_session(Default::default())
                .await
                .map_err(|e| format!("rdmad refused a session: {e}"))
        })
    }

    /// Allocates a region of at least `size` bytes from `pool` in a context's session: its
    /// object, its memfd and its size. The error is rdmad's refusal as it worded it, and
    /// whether it was a quota or a full pool (the verbs report both as `ENOMEM`).
    pub fn allocate_region(
        &self,
        session: &OwnedObjectPath,
        pool: &str,
        size: u64,
    ) -> Result<(OwnedObjectPath, std::os::fd::OwnedFd, u64), (bool, String)> {
        self.block_on(async {
            let session = SessionProxy::builder(&self.connection().await)
                .path(session.clone())
                .map_err(|e| (false, e.to_string()))?
                .build()
                .await
                .map_err(|e| (false, e.to_string()))?;
            match session
                .allocate_region(pool, size, Default::default())
                .await
            {
                Ok((path, fd, size)) => Ok((path, fd.into(), size)),
                Err(e) => {
                    let memory = matches!(
                        e,
                        rdmad_client::Error::QuotaExceeded(_)
                            | rdmad_client::Error::PoolExhausted(_)
                    );
                    Err((memory, e.to_string()))
                }
            }
        })
    }

    /// Registers `length` bytes from `offset` of a region in the session's protection
    /// domain `domain`, named `iova` by work requests and peers, with `access` (letters
    /// `l`, `r`, `w`, `a`): the registration's id and its rkey. The error says whether it
    /// was a quota (the verbs report it as `ENOMEM`).
    pub fn register(
        &self,
        region: &OwnedObjectPath,
        domain: u32,
        (offset, length, iova): (u64, u64, u64),
        access: &str,
    ) -> Result<(u64, u32), (bool, String)> {
        self.block_on(async {
            let proxy = self
                .region(region)
                .await
                .map_err(|e| (false, e.to_string()))?;
            let mut options = std::collections::HashMap::new();
            options.insert("domain", Value::U32(domain));
            options.insert("offset", Value::U64(offset));
            options.insert("length", Value::U64(length));
            options.insert("iova", Value::U64(iova));
            options.insert("access", Value::from(access));
            match proxy.register(options).await {
                Ok((registration, _lkey, rkey)) => Ok((registration, rkey)),
                Err(e) => Err((
                    matches!(e, rdmad_client::Error::QuotaExceeded(_)),
                    e.to_string(),
                )),
            }
        })
    }

    /// Removes a registration `register` made: its rkey stops working.
    pub fn deregister(&self, region: &OwnedObjectPath, registration: u64) -> Result<(), String> {
        self.block_on(async {
            self.region(region)
                .await
                .map_err(|e| e.to_string())?
                .deregister(registration)
                .await
                .map_err(|e| {
                    format!(
                        "rdmad did not remove registration {registration} of region {}: {e}",
                        region.as_str()
                    )
                })
        })
    }

    async fn region(
        &self,
        path: &OwnedObjectPath,
    ) -> zbus::Result<rdmad_client::proxy::RegionProxy<'static>> {
        rdmad_client::proxy::RegionProxy::builder(&self.connection().await)
            .path(path.clone())?
            .build()
            .await
    }

    /// Frees a region (`Region.Free`).
    pub fn free_region(&self, path: &OwnedObjectPath) -> Result<(), String> {
        self.block_on(async {
            self.region(path)
                .await
                .map_err(|e| e.to_string())?
                .free()
                .await
                .map_err(|e| format!("rdmad did not free region {}: {e}", path.as_str()))
        })
    }

    /// Creates an RC queue pair in a context's session, in its protection domain `domain`:
    /// its object, its mapped rings, its endpoint (the device's QPN among it) and the
    /// depths rdmad gave it.
    pub fn create_queue_pair(
        &self,
        session: &OwnedObjectPath,
        device: &str,
        domain: u32,
        (send_depth, recv_depth, max_sge): (u32, u32, u32),
    ) -> Result<
        (
            OwnedObjectPath,
            QueuePairRing,
            Endpoint,
            rdmad_client::types::RingInfo,
        ),
        (bool, String),
    > {
        self.block_on(async {
            let plain = |e: zbus::Error| (false, e.to_string());
            let session = SessionProxy::builder(&self.connection().await)
                .path(session.clone())
                .map_err(plain)?
                .build()
                .await
                .map_err(plain)?;
            let mut options = std::collections::HashMap::new();
            options.insert("send_depth", Value::U32(send_depth));
            options.insert("recv_depth", Value::U32(recv_depth));
            options.insert("max_sge", Value::U32(max_sge));
            options.insert("domain", Value::U32(domain));
            let (path, ring, doorbell, completions, info) = session
                .create_queue_pair(device, options)
                .await
                .map_err(|e| {
                    let memory = matches!(e, rdmad_client::Error::QuotaExceeded(_));
                    (memory, e.to_string())
                })?;
            let ring = QueuePairRing::new(ring.into(), doorbell.into(), completions.into(), info)
                .map_err(|e| (false, format!("cannot map the queue pair's ring: {e}")))?;
            let qp = QueuePairProxy::builder(&self.connection().await)
                .path(path.clone())
                .map_err(plain)?
                .build()
                .await
                .map_err(plain)?;
            let endpoint = qp.endpoint().await.map_err(|e| (false, e.to_string()))?;
            Ok((path, ring, endpoint, info))
        })
    }

    async fn queue_pair(&self, path: &OwnedObjectPath) -> Result<QueuePairProxy<'static>, String> {
        QueuePairProxy::builder(&self.connection().await)
            .path(path.clone())
            .map_err(|e| e.to_string())?
            .build()
            .await
            .map_err(|e| e.to_string())
    }

    /// Connects a queue pair to its peer receive-only (RTR), from GID `gid_index`.
    pub fn connect_queue_pair(
        &self,
        path: &OwnedObjectPath,
        remote: &Endpoint,
        gid_index: Option<u32>,
    ) -> Result<(), String> {
        self.block_on(async {
            let mut options = std::collections::HashMap::new();
            options.insert("state", Value::from("rtr"));
            if let Some(index) = gid_index {
                options.insert("gid_index", Value::U32(index));
            }
            self.queue_pair(path)
                .await?
                .connect(remote, options)
                .await
                .map_err(|e| e.to_string())
        })
    }

    /// Moves a queue pair connected receive-only to RTS, its sends starting at `psn`.
    pub fn ready_queue_pair(&self, path: &OwnedObjectPath, psn: u32) -> Result<(), String> {
        self.block_on(async {
            let mut options = std::collections::HashMap::new();
            options.insert("psn", Value::U32(psn));
            self.queue_pair(path)
                .await?
                .ready(options)
                .await
                .map_err(|e| e.to_string())
        })
    }

    /// Moves a queue pair to the error state: what it holds completes flushed.
    pub fn flush_queue_pair(&self, path: &OwnedObjectPath) -> Result<(), String> {
        self.block_on(async {
            self.queue_pair(path)
                .await?
                .flush()
                .await
                .map_err(|e| e.to_string())
        })
    }

    pub fn destroy_queue_pair(&self, path: &OwnedObjectPath) -> Result<(), String> {
        self.block_on(async {
            self.queue_pair(path)
                .await?
                .destroy()
                .await
                .map_err(|e| format!("rdmad did not destroy queue pair {}: {e}", path.as_str()))
        })
    }

    /// Closes a context's session: rdmad releases everything in it.
    pub fn close_session(&self, path: &OwnedObjectPath) -> Result<(), String> {
        self.block_on(async {
            let session = SessionProxy::builder(&self.connection().await)
                .path(path.clone())
                .map_err(|e| e.to_string())?
                .build()
                .await
                .map_err(|e| e.to_string())?;
            session
                .close()
                .await
                .map_err(|e| format!("rdmad did not close session {}: {e}", path.as_str()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::parse_guid;

    #[test]
    fn guids_parse_as_rdmad_prints_them() {
        assert_eq!(
            parse_guid("0002:c903:0011:2233"),
            Some(0x0002_c903_0011_2233)
        );
        assert_eq!(parse_guid("0002:c903:0011"), None);
        assert_eq!(parse_guid("zzzz:c903:0011:2233"), None);
    }
}
