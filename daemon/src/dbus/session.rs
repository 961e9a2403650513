//! `/org/rdmad1/session/<n>`, interface `org.rdmad1.Session`. Only the connection that
//! opened a session may use it; its user (or an administrator) may look at it and close it.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdmad_client::names::region_path;
use rdmad_client::types::{RingInfo, SessionInfo};
use rdmad_client::Error;
use tokio::sync::Notify;
use zbus::message::Header;
use zbus::object_server::ObjectServer;
use zbus::zvariant::{OwnedFd, OwnedObjectPath, OwnedValue};
use zbus::{interface, Connection};

use super::addressing;
use super::context::Context;
use super::options::Options;
use super::wire;
use crate::engine::{ListenOptions, ListenerId, QpHandout, QpOptions, SessionId, MAX_BACKLOG};
use crate::policy;

pub struct SessionObject {
    ctx: Arc<Context>,
    id: SessionId,
    /// The session's listeners, each with what wakes an `Accept` waiting on it.
    listeners: Mutex<HashMap<u64, Arc<Notify>>>,
}

impl SessionObject {
    pub fn new(ctx: Arc<Context>, id: SessionId) -> SessionObject {
        SessionObject {
            ctx,
            id,
            listeners: Mutex::new(HashMap::new()),
        }
    }

    fn listener(&self, id: u64) -> Result<Arc<Notify>, Error> {
        self.listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
            .ok_or_else(|| Error::NoSuchObject(format!("listener {id} (of session {})", self.id)))
    }
}

/// What `CreateQueuePair` and `Accept` hand a client of a new queue pair: its object, the
/// ring memfd, the doorbell, the completion channel and the ring's size and depths.
fn handout(q: QpHandout) -> (OwnedObjectPath, OwnedFd, OwnedFd, OwnedFd, RingInfo) {
    (
        wire::path(rdmad_client::names::qp_path(q.id.0)),
        OwnedFd::from(q.ring),
        OwnedFd::from(q.doorbell),
        OwnedFd::from(q.completion),
        RingInfo {
            size: q.ring_size,
            sq_entries: q.sq_entries,
            cq_entries: q.cq_entries,
        },
    )
}

/// The queue pair options `CreateQueuePair` and `Listen` take.
const QP_OPTIONS: [&str; 5] = [
    "send_depth",
    "recv_depth",
    "max_sge",
    "max_inline",
    "domain",
];

fn qp_options(method: &str, opts: &Options<'_>) -> Result<QpOptions, Error> {
    let mut qp_options = QpOptions::default();
    let narrow = |key: &str, value: u64| {
        u32::try_from(value)
            .map_err(|_| Error::InvalidArgument(format!("{method}: {key} {value} is too large")))
    };
    for (key, slot) in [
        ("send_depth", &mut qp_options.send_depth),
        ("recv_depth", &mut qp_options.recv_depth),
        ("max_sge", &mut qp_options.max_sge),
        ("max_inline", &mut qp_options.max_inline),
    ] {
        if let Some(v) = opts.unsigned(key)? {
            *slot = narrow(key, v)?;
        }
    }
    if let Some(domain) = opts.unsigned("domain")? {
        qp_options.domain = Some(u32::try_from(domain).ok().filter(|d| *d > 0).ok_or_else(
            || {
                Error::InvalidArgument(format!(
                    "{method}: domain {domain} is not a number from 1 to 2^32-1"
                ))
            },
        )?);
    }
    Ok(qp_options)
}

#[interface(name = "org.rdmad1.Session")]
impl SessionObject {
    /// Ends the session: its regions are freed, its attachments end.
    async fn close(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
        #[zbus(object_server)] server: &ObjectServer,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let (id, uid, scope) = (self.id, caller.uid, self.ctx.scope(&caller).await?);
        let removed = self
            .ctx
            .blocking(move |e| e.close_session(&caller.owner(), scope, id))
            .await??;
        tracing::info!(
            session = %self.id,
            uid,
            regions = removed.regions.len(),
            "session closed"
        );
        self.ctx.withdraw(server, &removed).await;
        Ok(())
    }

    /// Allocates a region of at least `size` bytes from `pool`. Returns its object, a
    /// read-write memfd to map (`MAP_SHARED`) and its size.
    async fn allocate_region(
        &self,
        pool: &str,
        size: u64,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
        #[zbus(object_server)] server: &ObjectServer,
    ) -> Result<(OwnedObjectPath, OwnedFd, u64), Error> {
        Options::new("AllocateRegion", &options, &[])?;
        let caller = self.ctx.caller(connection, &header).await?;
        let grants = self.ctx.grants(&caller).await?;
        let owner = caller.owner();
        // A warm region is handed out here; only making one waits, off the bus threads.
        let warm = self.ctx.engine.allocate_warm(
            &owner,
            &grants.limits,
            &grants.pools,
            self.id,
            pool,
            size,
        )?;
        let handout = match warm {
            Some(handout) => handout,
            None => {
                let (id, pool) = (self.id, pool.to_owned());
                self.ctx
                    .blocking(move |e| {
                        e.allocate(&owner, &grants.limits, &grants.pools, id, &pool, size)
                    })
                    .await??
            }
        };
        self.ctx
            .publish_region(server, &caller, handout.region)
            .await?;
        tracing::debug!(
            session = %self.id,
            region = %handout.region,
            size = handout.size,
            "region allocated"
        );
        Ok((
            wire::path(region_path(handout.region.0)),
            OwnedFd::from(handout.fd),
            handout.size,
        ))
    }

    /// Attaches the region an access key grants. Returns its object, a memfd (opened
    /// read-only for an `ro` key), its size and the access, `ro` or `rw`.
    async fn attach_region(
        &self,
        key: &str,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(OwnedObjectPath, OwnedFd, u64, String), Error> {
        Options::new("AttachRegion", &options, &[])?;
        let caller = self.ctx.caller(connection, &header).await?;
        let (id, key) = (self.id, key.to_owned());
        let handout = self
            .ctx
            .blocking(move |e| {
                let pools = policy::pool_access(&caller, &e.pool_configs());
                e.attach(&caller.owner(), &pools, id, &key)
            })
            .await??;
        tracing::info!(
            session = %self.id,
            region = %handout.region,
            access = handout.access.as_str(),
            "region attached"
        );
        Ok((
            wire::path(region_path(handout.region.0)),
            OwnedFd::from(handout.fd),
            handout.size,
            handout.access.as_str().to_owned(),
        ))
    }

    /// Creates an RC queue pair (and its CQ) on `device`. Options (`u`): `send_depth`,
    /// `recv_depth` (default 128), `max_sge` (default 4), `domain` (a protection domain of
    /// the session's own, from 1, as `Region.Register` takes it: the queue pair's requests
    /// then use the registrations in that domain, and its peer reaches their rkeys).
    /// Returns its object, the ring memfd
    /// (map it shared, read-write), the doorbell (the write end of a pipe: write a byte
    /// after submitting when the ring asks for a wake-up), the completion channel (the read
    /// end of a pipe, readable when completions arrive), and the ring's size and depths.
    async fn create_queue_pair(
        &self,
        device: &str,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
        #[zbus(object_server)] server: &ObjectServer,
    ) -> Result<(OwnedObjectPath, OwnedFd, OwnedFd, OwnedFd, RingInfo), Error> {
        let opts = Options::new("CreateQueuePair", &options, &QP_OPTIONS)?;
        let qp_options = qp_options("CreateQueuePair", &opts)?;
        let caller = self.ctx.caller(connection, &header).await?;
        let (session, owner, on) = (self.id, caller.owner(), device.to_owned());
        let limits = self.ctx.grants(&caller).await?.limits.clone();
        let q = self
            .ctx
            .blocking(move |e| e.create_qp(&owner, &limits, session, &on, qp_options))
            .await??;
        let id = q.id;
        self.ctx.publish_qp(server, &caller, id).await?;
        tracing::info!(
            session = %self.id,
            qp = %id,
            qpn = q.qp_num,
            device,
            "queue pair created"
        );
        Ok(handout(q))
    }

    /// Listens for connections by address through rdma_cm on `address` (empty: every
    /// address of the host's RDMA devices) and `port`, if the configuration lets the
    /// caller listen there (`[listen]`). Options: the queue pair options of
    /// `CreateQueuePair` for the queue pairs `Accept` makes; `backlog` (`u`, default 8, at
    /// most 64): requests held for `Accept` (later ones are rejected at once);
    /// `private_data` (`ay`, at most 196 bytes): sent with every accept. Returns the
    /// listener's number and the address and port it listens on. The listener ends with
    /// `StopListening` or the session.
    async fn listen(
        &self,
        address: &str,
        port: u16,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(u64, String, u16), Error> {
        let known: Vec<&str> = QP_OPTIONS
            .iter()
            .copied()
            .chain(["backlog", "private_data"])
            .collect();
        let opts = Options::new("Listen", &options, &known)?;
        let qp = qp_options("Listen", &opts)?;
        let backlog = match opts.unsigned("backlog")? {
            None => 8,
            Some(n) if (1..=u64::from(MAX_BACKLOG)).contains(&n) => n as u32,
            Some(n) => {
                return Err(Error::InvalidArgument(format!(
                    "Listen: backlog {n} is out of range: 1 to {MAX_BACKLOG}"
                )))
            }
        };
        let private_data = opts.bytes("private_data")?.unwrap_or_default();
        let ip = addressing::ip("Listen", "address", address)?
            .unwrap_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED));
        if port == 0 {
            return Err(Error::InvalidArgument(
                "Listen: port 0: name the port to listen on".into(),
            ));
        }
        let caller = self.ctx.caller(connection, &header).await?;
        // The grants name users and groups: looked up off the bus's threads.
        let (who, config) = (caller.clone(), self.ctx.config());
        self.ctx
            .blocking(move |_| policy::may_listen(&who, &config, port))
            .await?
            .map_err(Error::NotAuthorized)?;
        let wake = Arc::new(Notify::new());
        let waker = {
            let wake = Arc::clone(&wake);
            Arc::new(move || wake.notify_one())
        };
        let session = self.id;
        let owner = caller.owner();
        let (id, bound) = self
            .ctx
            .blocking(move |e| {
                e.listen(
                    &owner,
                    session,
                    SocketAddr::new(ip, port),
                    ListenOptions {
                        qp,
                        backlog,
                        private_data,
                    },
                    waker,
                )
            })
            .await??;
        self.listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.0, wake);
        tracing::info!(session = %self.id, listener = %id, address = %bound, uid = caller.uid, "listening");
        Ok((id.0, bound.ip().to_string(), bound.port()))
    }

    /// Waits for the next connection request on `listener`, then makes a queue pair for
    /// it in this session (within the quotas: past them the peer is rejected with the
    /// reason, and so is this call), connects it and accepts. Option `timeout_ms` (`u`,
    /// default 20000, at most 600000). Returns what `CreateQueuePair` returns, and the
    /// connection: `address`, `port` (the peer's), `local_address`, `local_port`,
    /// `qp_num` (the peer's) and `private_data` (the peer's request's).
    #[allow(clippy::type_complexity)]
    async fn accept(
        &self,
        listener: u64,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
        #[zbus(object_server)] server: &ObjectServer,
    ) -> Result<
        (
            OwnedObjectPath,
            OwnedFd,
            OwnedFd,
            OwnedFd,
            RingInfo,
            HashMap<String, OwnedValue>,
        ),
        Error,
    > {
        let opts = Options::new("Accept", &options, &["timeout_ms"])?;
        let wait = addressing::timeout("Accept", &opts, Duration::from_secs(20))?;
        let wake = self.listener(listener)?;
        let caller = self.ctx.caller(connection, &header).await?;
        let deadline = tokio::time::Instant::now() + wait;
        let (q, connected) = loop {
            // Registered before looking, so a request that arrives meanwhile wakes it.
            let woken = wake.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let turn = self.ctx.connecting.take(caller.uid).await?;
            let (owner, limits) = (
                caller.owner(),
                self.ctx.grants(&caller).await?.limits.clone(),
            );
            let taken = self
                .ctx
                .blocking(move |e| e.accept(&owner, &limits, ListenerId(listener)))
                .await??;
            drop(turn);
            if let Some(done) = taken {
                break done;
            }
            if tokio::time::timeout_at(deadline, woken.as_mut())
                .await
                .is_err()
            {
                return Err(Error::ConnectionFailed(format!(
                    "Accept: no connection request came to listener {listener} within {} ms",
                    wait.as_millis()
                )));
            }
        };
        let id = q.id;
        self.ctx.publish_qp(server, &caller, id).await?;
        tracing::info!(session = %self.id, qp = %id, qpn = q.qp_num, peer = ?connected.peer, listener, "connection accepted");
        let (path, ring, doorbell, completion, info) = handout(q);
        Ok((
            path,
            ring,
            doorbell,
            completion,
            info,
            addressing::describe(&connected)?,
        ))
    }

    /// Stops `listener`: requests still waiting for `Accept` are rejected; connections
    /// already accepted stay.
    async fn stop_listening(
        &self,
        listener: u64,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        self.listener(listener)?;
        let caller = self.ctx.caller(connection, &header).await?;
        self.ctx
            .blocking(move |e| e.stop_listening(&caller.owner(), ListenerId(listener)))
            .await??;
        self.listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&listener);
        tracing::info!(session = %self.id, listener, "stopped listening");
        Ok(())
    }

    async fn get_info(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<SessionInfo, Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let scope = self.ctx.scope(&caller).await?;
        let info = self.ctx.engine.session(&caller.owner(), scope, self.id)?;
        // Its user is named: a lookup, off the bus's threads.
        self.ctx.blocking(move |_| wire::session(&info)).await
    }
}
