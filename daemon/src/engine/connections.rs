//! Connections by address: a session's queue pairs connected through the kernel's RDMA
//! connection manager (`rdma_cm`), interoperable with any rdma_cm program.
//!
//! - `connect_to`: a queue pair of the session, still in RESET, resolves the peer's address
//!   and route, sends a connection request carrying its QPN and the client's private data,
//!   and on the peer's accept moves to RTS with the path rdma_cm chose (the GID of the
//!   resolved route, the PSNs and depths both ends agreed on).
//! - `listen` / `accept`: a listener of the session takes connection requests on an
//!   address and port; each `accept` makes a new queue pair in the session for the next
//!   request — within the user's quotas, or the request is rejected with private data that
//!   says why — connects it and accepts. At most `backlog` requests wait; later ones are
//!   rejected at once. Listeners end with their session.
//!
//! Either way the connection's rdma_cm identifier lives with the queue pair
//! (`QueuePairRecord::link`): destroying the queue pair (or ending its session)
//! disconnects the peer, and a disconnect from the peer's side moves the queue pair to the
//! error state, so whatever it holds completes flushed.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::qp::{ConnectDefaults, QpOptions, QueuePairRecord};
use super::{Engine, EngineError, Limits, Owner, QpHandout, QpId, SessionId};
use crate::lock::lock;
use crate::provider::cm::{
    CmId, CmPath, CmRequest, ConnParam, REPLY_PRIVATE_DATA, REQUEST_PRIVATE_DATA,
};
use crate::provider::{Access, RemoteEndpoint};

pub use super::ids::ListenerId;

/// The most listeners one session holds.
pub const MAX_LISTENERS_PER_SESSION: usize = 8;
/// The most connection requests one listener holds for `accept`.
pub const MAX_BACKLOG: u32 = 64;

/// An rdma_cm connection a queue pair was connected through.
#[derive(Debug)]
pub struct CmLink {
    pub peer: Option<SocketAddr>,
    /// Dropping it disconnects the peer.
    #[allow(dead_code)]
    pub id: Box<dyn CmId>,
}

/// How a listener accepts (`Listen` options).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenOptions {
    /// The queue pairs `accept` makes.
    pub qp: QpOptions,
    /// Requests held for `accept` (1 to [`MAX_BACKLOG`]).
    pub backlog: u32,
    /// Sent with every accept (at most [`REPLY_PRIVATE_DATA`] bytes).
    pub private_data: Vec<u8>,
}

/// A session's listener.
#[derive(Debug)]
pub struct Listener {
    pub id: ListenerId,
    pub session: SessionId,
    pub connection: String,
    pub address: SocketAddr,
    pub options: ListenOptions,
    pub accepted: AtomicU64,
    pub refused: AtomicU64,
    cm: Box<dyn CmId>,
}

/// What a connection by address told each end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connected {
    pub local: Option<SocketAddr>,
    pub peer: Option<SocketAddr>,
    /// The private data the peer sent (its accept, or its request).
    pub private_data: Vec<u8>,
    pub peer_qp_num: u32,
}

/// The listeners of the daemon, by id.
#[derive(Debug, Default)]
pub struct Listeners {
    by_id: Mutex<BTreeMap<ListenerId, Arc<Listener>>>,
    last: Mutex<ListenerId>,
}

impl Listeners {
    /// Forgets (and so closes) the listeners of sessions that ended.
    pub fn close_sessions(&self, sessions: &[SessionId]) -> Vec<ListenerId> {
        if sessions.is_empty() {
            return Vec::new();
        }
        let mut map = lock(&self.by_id);
        let gone: Vec<ListenerId> = map
            .values()
            .filter(|l| sessions.contains(&l.session))
            .map(|l| l.id)
            .collect();
        let closed: Vec<Arc<Listener>> = gone.iter().filter_map(|id| map.remove(id)).collect();
        drop(map);
        drop(closed);
        gone
    }
}

/// How long to wait for rdma_cm's answers.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a peer has to confirm an accept.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

impl Engine {
    fn own_listener(&self, owner: &Owner, id: ListenerId) -> Result<Arc<Listener>, EngineError> {
        let listener = lock(&self.listeners.by_id)
            .get(&id)
            .cloned()
            .ok_or_else(|| EngineError::NoSuchObject(format!("listener {id}")))?;
        if listener.connection != owner.connection {
            return Err(EngineError::NotAuthorized(format!(
                "listener {id} belongs to another session; only its owner may use it"
            )));
        }
        Ok(listener)
    }

    /// Listens on `address` for `session` (`owner`'s). Whether the user may listen on that
    /// port is the policy layer's decision, made before. `on_request` runs whenever a
    /// request arrives for [`Engine::accept`]. Returns the listener and the address it
    /// listens on (with the port rdma_cm chose when `address` has port 0).
    pub fn listen(
        &self,
        owner: &Owner,
        session: SessionId,
        address: SocketAddr,
        options: ListenOptions,
        on_request: Arc<dyn Fn() + Send + Sync>,
    ) -> Result<(ListenerId, SocketAddr), EngineError> {
        self.registry.check_own_session(owner, session)?;
        if options.backlog == 0 || options.backlog > MAX_BACKLOG {
            return Err(EngineError::InvalidArgument(format!(
                "backlog {} is out of range: 1 to {MAX_BACKLOG}",
                options.backlog
            )));
        }
        if options.private_data.len() > REPLY_PRIVATE_DATA {
            return Err(EngineError::InvalidArgument(format!(
                "private_data of {} bytes is more than an accept carries ({REPLY_PRIVATE_DATA})",
                options.private_data.len()
            )));
        }
        let too_many = || {
            EngineError::InvalidArgument(format!(
                "session {session} has {MAX_LISTENERS_PER_SESSION} listeners, the most a \
                 session may hold; close one (StopListening) first"
            ))
        };
        let held = |map: &BTreeMap<ListenerId, Arc<Listener>>| {
            map.values().filter(|l| l.session == session).count()
        };
        if held(&lock(&self.listeners.by_id)) >= MAX_LISTENERS_PER_SESSION {
            return Err(too_many());
        }
        let entry = &self.devices[0];
        options.qp.check(entry.device.as_ref())?;
        let cm = entry.device.connection_manager()?;
        let id = cm.listen(
            address,
            options.backlog,
            b"rdmad: the listener has as many requests waiting as it holds (its backlog)",
        )?;
        id.on_request(on_request);
        let listener_id = {
            let mut last = lock(&self.listeners.last);
            *last = last.next();
            *last
        };
        let address = id.local_addr().unwrap_or(address);
        let listener = Arc::new(Listener {
            id: listener_id,
            session,
            connection: owner.connection.clone(),
            address,
            options,
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            cm: id,
        });
        {
            // Counted again with the insert: concurrent Listens do not pass the limit.
            let mut map = lock(&self.listeners.by_id);
            if held(&map) >= MAX_LISTENERS_PER_SESSION {
                drop(map);
                drop(listener);
                return Err(too_many());
            }
            map.insert(listener_id, listener);
        }
        // The session may have ended meanwhile: its listener goes with it.
        if self.registry.check_own_session(owner, session).is_err() {
            self.listeners.close_sessions(&[session]);
            return Err(EngineError::NoSuchObject(format!(
                "session {session} (closed while it started listening)"
            )));
        }
        Ok((listener_id, address))
    }

    /// Stops listener `id` (`owner`'s): requests still waiting are rejected.
    pub fn stop_listening(&self, owner: &Owner, id: ListenerId) -> Result<(), EngineError> {
        self.own_listener(owner, id)?;
        let removed = lock(&self.listeners.by_id).remove(&id);
        drop(removed);
        Ok(())
    }

    /// Takes the next request waiting on listener `id` (`owner`'s), if one waits: makes a
    /// queue pair for it in the listener's session within `limits`, connects it and
    /// accepts. A request past the quotas is rejected (the peer sees a fixed phrase saying
    /// so, nothing of the user) and the quota error returned. A request whose peer gave up
    /// meanwhile (the accept fails, or is never confirmed) costs nothing more: its queue
    /// pair is destroyed and the next request is taken. `Ok(None)`: no request waits.
    pub fn accept(
        &self,
        owner: &Owner,
        limits: &Limits,
        id: ListenerId,
    ) -> Result<Option<(QpHandout, Connected)>, EngineError> {
        let listener = self.own_listener(owner, id)?;
        loop {
            let Some(request) = listener.cm.next_request(Duration::ZERO)? else {
                return Ok(None);
            };
            match self.accept_one(owner, limits, &listener, request)? {
                Some(accepted) => return Ok(Some(accepted)),
                None => continue,
            }
        }
    }

    /// [`Engine::accept`] for one request: `Ok(None)` when its peer is gone.
    fn accept_one(
        &self,
        owner: &Owner,
        limits: &Limits,
        listener: &Listener,
        request: CmRequest,
    ) -> Result<Option<(QpHandout, Connected)>, EngineError> {
        let peer = request.id.peer_addr();
        let refuse = |note: &str, why: &dyn std::fmt::Display| {
            listener.refused.fetch_add(1, Ordering::Relaxed);
            tracing::info!(listener = %listener.id, address = %listener.address, peer = ?peer, "connection request refused: {why}");
            let _ = request.id.reject(note.as_bytes());
        };
        let device = request
            .id
            .device()
            .filter(|(name, _)| self.devices.iter().any(|d| d.device.name() == name));
        let Some((device, port)) = device else {
            let why = format!(
                "it arrived through {:?}, which rdmad does not serve",
                request.id.device()
            );
            refuse(
                "rdmad: the request came through a device rdmad does not serve",
                &why,
            );
            return Err(EngineError::DeviceUnusable(format!(
                "a connection request to listener {}: {why}",
                listener.id
            )));
        };
        let handout = match self.create_qp(
            owner,
            limits,
            listener.session,
            &device,
            listener.options.qp,
        ) {
            Ok(h) => h,
            Err(e) => {
                let note = match e {
                    EngineError::Quota(_) => "rdmad: refused: the listener is at its quota",
                    _ => "rdmad: refused: no queue pair could be made for the connection",
                };
                refuse(note, &e);
                return Err(e);
            }
        };
        let qp_id = handout.id;
        let connected = (|| {
            let q = self.registry.own_qp(owner, qp_id)?;
            let d = ConnectDefaults::for_device(self.device(&device)?.device.as_ref())?;
            q.qp.to_init(port, remote_rights())?;
            let path = request.id.path()?;
            let remote = apply_path(&q, &path, &d)?;
            Ok::<_, EngineError>((q, remote, d))
        })();
        let destroy = || {
            if let Ok(teardown) = self.registry.destroy_qp(owner, qp_id) {
                self.release(teardown);
            }
        };
        let (q, remote, d) = match connected {
            Ok(x) => x,
            Err(e) => {
                refuse("rdmad: refused: the connection could not be set up", &e);
                destroy();
                return Err(e);
            }
        };
        let accepted = request.id.accept(
            &ConnParam {
                qp_num: q.local.qp_num,
                private_data: listener.options.private_data.clone(),
                responder_resources: request.initiator_depth.min(d.rd_atomic),
                initiator_depth: request.responder_resources.min(d.rd_atomic),
                retry_count: d.retry_cnt,
                rnr_retry_count: d.rnr_retry,
            },
            CONFIRM_TIMEOUT,
        );
        if let Err(e) = accepted {
            tracing::info!(listener = %listener.id, peer = ?peer, "a connection request's peer went away before the connection was made: {e}");
            destroy();
            return Ok(None);
        }
        listener.accepted.fetch_add(1, Ordering::Relaxed);
        let connected = Connected {
            local: request.id.local_addr(),
            peer,
            private_data: request.private_data.clone(),
            peer_qp_num: remote.qp_num,
        };
        keep_link(&q, request.id, &connected);
        Ok(Some((handout, connected)))
    }

    /// Connects queue pair `id` (`owner`'s, in RESET) to whoever listens on `to`,
    /// sending `private_data`, from `from` if given; waits up to `timeout` for each step.
    pub fn connect_to(
        &self,
        owner: &Owner,
        id: QpId,
        to: SocketAddr,
        from: Option<SocketAddr>,
        private_data: Vec<u8>,
        timeout: Duration,
    ) -> Result<Connected, EngineError> {
        let q = self.registry.own_qp(owner, id)?;
        if private_data.len() > REQUEST_PRIVATE_DATA {
            return Err(EngineError::InvalidArgument(format!(
                "private_data of {} bytes is more than a connection request carries \
                 ({REQUEST_PRIVATE_DATA})",
                private_data.len()
            )));
        }
        if q.connecting.swap(true, Ordering::AcqRel) {
            return Err(EngineError::InvalidArgument(format!(
                "queue pair {id} is being connected already (a ConnectTo is under way)"
            )));
        }
        let result = self.connect_qp_to(&q, id, to, from, private_data, timeout);
        q.connecting.store(false, Ordering::Release);
        result
    }

    fn connect_qp_to(
        &self,
        q: &Arc<QueuePairRecord>,
        id: QpId,
        to: SocketAddr,
        from: Option<SocketAddr>,
        private_data: Vec<u8>,
        timeout: Duration,
    ) -> Result<Connected, EngineError> {
        let busy = lock(&q.link).is_some() || lock(&q.remote).is_some();
        if busy || q.state() != crate::provider::QpState::Reset {
            return Err(EngineError::InvalidArgument(format!(
                "queue pair {id} is connected already (or was moved out of RESET); \
                 create another one for another connection"
            )));
        }
        let entry = self.device(&q.device)?;
        let cm = entry.device.connection_manager()?;
        let started = Instant::now();
        let cm_id = cm.resolve(from, to, timeout.min(RESOLVE_TIMEOUT))?;
        match cm_id.device() {
            Some((device, port)) if device == q.device && port == q.local.port => {}
            Some((device, port)) => {
                return Err(EngineError::InvalidArgument(format!(
                    "the route to {} leaves through {device} port {port}, and queue pair {id} \
                     is on {} port {}: create the queue pair on {device}",
                    to.ip(),
                    q.device,
                    q.local.port
                )))
            }
            None => {
                return Err(EngineError::InvalidArgument(format!(
                    "{} is not reached through an RDMA device",
                    to.ip()
                )))
            }
        }
        let d = ConnectDefaults::for_device(entry.device.as_ref())?;
        q.qp.to_init(q.local.port, remote_rights())?;
        let left = timeout
            .saturating_sub(started.elapsed())
            .max(Duration::from_secs(1));
        let moved = (|| {
            let reply = cm_id.connect(
                &ConnParam {
                    qp_num: q.local.qp_num,
                    private_data,
                    responder_resources: d.rd_atomic,
                    initiator_depth: d.rd_atomic,
                    retry_count: d.retry_cnt,
                    rnr_retry_count: d.rnr_retry,
                },
                left,
            )?;
            let path = cm_id.path()?;
            let remote = apply_path(q, &path, &d)?;
            cm_id.establish()?;
            Ok::<_, EngineError>((reply, remote))
        })();
        let (reply, remote) = match moved {
            Ok(done) => done,
            Err(e) => {
                // Moved part of the way and not connected: the queue pair is left to
                // flush (a new ConnectTo needs a new queue pair).
                let _ = q.qp.to_error();
                *lock(&q.remote) = None;
                return Err(e);
            }
        };
        let connected = Connected {
            local: cm_id.local_addr(),
            peer: cm_id.peer_addr().or(Some(to)),
            private_data: reply.private_data,
            peer_qp_num: remote.qp_num,
        };
        keep_link(q, cm_id, &connected);
        Ok(connected)
    }
}

fn remote_rights() -> Access {
    Access::LOCAL_WRITE
        .union(Access::REMOTE_WRITE)
        .union(Access::REMOTE_READ)
        .union(Access::REMOTE_ATOMIC)
}

/// Moves `q` (in INIT) to RTR and RTS with the path rdma_cm chose. rdma_cm leaves the
/// RNR timer at 0 (655 ms between a peer's retries when no receive is posted); rdmad's
/// default is used instead, and its timeout when the path has none.
fn apply_path(
    q: &QueuePairRecord,
    path: &CmPath,
    d: &ConnectDefaults,
) -> Result<RemoteEndpoint, EngineError> {
    // The peer's numbers are the peer's: the depths are held to what this end offered (its
    // device's), the retry count to rdmad's (a peer asking 7 would make Soft-RoCE retry for
    // ever), as librdmacm does for the queue pairs it makes.
    let mut rtr = path.rtr.clone();
    rtr.max_dest_rd_atomic = rtr.max_dest_rd_atomic.min(d.rd_atomic);
    if rtr.min_rnr_timer == 0 {
        rtr.min_rnr_timer = d.min_rnr_timer;
    }
    if rtr.port == 0 {
        rtr.port = q.local.port;
    }
    q.qp.to_rtr(&path.remote, &rtr)?;
    let mut rts = path.rts.clone();
    rts.max_rd_atomic = rts.max_rd_atomic.min(d.rd_atomic);
    rts.retry_cnt = rts.retry_cnt.min(d.retry_cnt);
    if rts.timeout == 0 {
        rts.timeout = d.timeout;
    }
    q.qp.to_rts(&rts)?;
    *lock(&q.remote) = Some(path.remote.clone());
    Ok(path.remote.clone())
}

/// Keeps the connection's identifier with its queue pair, and moves the queue pair to the
/// error state when the peer (or the device) ends the connection.
fn keep_link(q: &Arc<QueuePairRecord>, id: Box<dyn CmId>, connected: &Connected) {
    let qp = Arc::downgrade(&q.qp);
    let (peer, qpn) = (connected.peer, q.local.qp_num);
    id.on_disconnect(Box::new(move || {
        if let Some(qp) = qp.upgrade() {
            tracing::info!(qpn, peer = ?peer, "the peer ended the connection: queue pair moved to the error state");
            let _ = qp.to_error();
        }
    }));
    *lock(&q.link) = Some(CmLink {
        peer: connected.peer,
        id,
    });
}
