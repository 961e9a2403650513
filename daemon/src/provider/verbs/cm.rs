//! rdma_cm through librdmacm: one event channel for the whole daemon, read by one thread
//! that acknowledges every event at once and hands it to the identifier it belongs to.
//!
//! Each identifier's `context` is a token naming its slot in [`State`]; waits (address,
//! route, the peer's answer, the peer's confirmation) take events from their slot's queue.
//! A listener's slot queues connection requests up to its backlog and refuses the rest
//! with the listener's refusal text, so no peer can make rdmad hold more than the backlog.
//! Because the thread acknowledges events before it looks at them, `rdma_destroy_id`
//! (which waits for its identifier's events to be acknowledged) never waits on it.

use std::collections::{HashMap, VecDeque};
use std::ffi::CStr;
use std::io;
use std::mem::{size_of, zeroed};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::raw::{c_int, c_void};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_get_device_name, ibv_qp_attr, ibv_qp_state, rdma_accept, rdma_ack_cm_event, rdma_bind_addr,
    rdma_cm_event, rdma_cm_event_type as ev, rdma_cm_id, rdma_conn_param, rdma_connect,
    rdma_create_event_channel, rdma_create_id, rdma_destroy_id, rdma_disconnect, rdma_establish,
    rdma_event_channel, rdma_get_cm_event, rdma_init_qp_attr, rdma_listen, rdma_port_space,
    rdma_reject, rdma_resolve_addr, rdma_resolve_route,
};

use super::super::cm::{
    CmId, CmPath, CmReply, CmRequest, ConnParam, ConnectionManager, REJECT_PRIVATE_DATA,
    REPLY_PRIVATE_DATA, REQUEST_PRIVATE_DATA,
};
use super::super::{
    mtu_bytes, ProviderError, RemoteEndpoint, Result, RtrAttributes, RtsAttributes,
};
use crate::lock::lock;

/// What errors name as the device for rdma_cm's own failures.
const CM: &str = "rdma_cm";

/// The daemon's connection manager, made on first use. A failure to open it is not
/// kept: the next call tries again, so loading `rdma_ucm` after rdmad started needs no
/// restart. A manager whose event thread stopped is replaced the same way (what its
/// identifiers wait for fails at once; see [`Shared::unanswered`]).
pub fn connection_manager() -> Result<Arc<dyn ConnectionManager>> {
    static MANAGER: Mutex<Option<Arc<RdmaCm>>> = Mutex::new(None);
    let mut manager = lock(&MANAGER);
    if let Some(cm) = manager.as_ref().filter(|cm| cm.shared.failure().is_none()) {
        return Ok(Arc::clone(cm) as Arc<dyn ConnectionManager>);
    }
    match RdmaCm::start() {
        Ok(cm) => {
            let cm = Arc::new(cm);
            *manager = Some(Arc::clone(&cm));
            Ok(cm as Arc<dyn ConnectionManager>)
        }
        Err(why) => Err(ProviderError::Os {
            device: CM.to_owned(),
            operation: "rdma_create_event_channel",
            source: why,
        }),
    }
}

#[derive(Debug)]
struct RdmaCm {
    shared: Arc<Shared>,
}

/// The event channel and the slots of every identifier.
#[derive(Debug)]
struct Shared {
    channel: Channel,
    state: Mutex<State>,
    changed: Condvar,
    next_token: AtomicU64,
}

#[derive(Debug)]
struct Channel(NonNull<rdma_event_channel>);

// SAFETY: an event channel is a file descriptor librdmacm reads from; librdmacm may be
// called from any thread. The channel is never destroyed (a manager replaced after its
// event thread stopped keeps its channel for the identifiers made on it).
unsafe impl Send for Channel {}
// SAFETY: as above; only `rdma_get_cm_event` (one thread) and `rdma_create_id` (which
// only records the pointer) use it.
unsafe impl Sync for Channel {}

#[derive(Debug, Default)]
struct State {
    slots: HashMap<u64, Slot>,
    /// Why the event thread stopped, once it has: nothing more will be delivered.
    failed: Option<String>,
}

#[derive(Default)]
struct Slot {
    events: VecDeque<Event>,
    /// A listener's waiting requests, and how many may wait.
    requests: VecDeque<Pending>,
    backlog: usize,
    refusal: Vec<u8>,
    /// Run once when the connection ends.
    on_disconnect: Option<Box<dyn FnOnce() + Send>>,
    /// A listener's: run when a request is queued.
    on_request: Option<Arc<dyn Fn() + Send + Sync>>,
    /// The identifier, valid while the slot exists (its owner removes the slot before
    /// destroying it).
    id: Option<RawId>,
    disconnected: bool,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("events", &self.events.len())
            .field("requests", &self.requests.len())
            .field("disconnected", &self.disconnected)
            .finish()
    }
}

/// An event, copied out of librdmacm's before it was acknowledged.
#[derive(Debug, Clone)]
struct Event {
    kind: ev::Type,
    status: c_int,
    private_data: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
}

/// A connection request not yet taken by the engine.
#[derive(Debug)]
struct Pending {
    id: RawId,
    /// The slot the event thread made for it.
    token: u64,
    event: Event,
    arrived: Instant,
}

/// How long a connection request is held for `next_request`: about as long as the peer's
/// connection manager waits for an answer (its REQ's response timeout, about 4 s, times
/// 15 tries). A request older than this is refused, so requests whose peers gave up do not
/// fill a backlog (the kernel tells rdmad nothing of a peer that gave up before the
/// accept).
const REQUEST_LIFETIME: Duration = Duration::from_secs(60);

/// Takes the requests of listener `token` that are older than [`REQUEST_LIFETIME`] out of
/// its queue (and their slots), for [`refuse_all`] once the lock is released.
fn expire(state: &mut State, token: u64) -> Vec<Pending> {
    let Some(slot) = state.slots.get_mut(&token) else {
        return Vec::new();
    };
    let now = Instant::now();
    let mut expired = Vec::new();
    while slot
        .requests
        .front()
        .is_some_and(|p| now.duration_since(p.arrived) > REQUEST_LIFETIME)
    {
        expired.extend(slot.requests.pop_front());
    }
    for p in &expired {
        state.slots.remove(&p.token);
    }
    expired
}

fn refuse_all(requests: Vec<Pending>) {
    for p in requests {
        refuse(p.id, b"rdmad: the request waited too long for an accept");
    }
}

/// An identifier pointer moved between threads.
#[derive(Debug, Clone, Copy)]
struct RawId(NonNull<rdma_cm_id>);

// SAFETY: librdmacm may be called from any thread on an identifier; each is destroyed once,
// by its owner (a `VerbsCmId`, or the event thread for a request it refused).
unsafe impl Send for RawId {}

/// Refuses a request no one will take, and destroys its identifier.
fn refuse(id: RawId, note: &[u8]) {
    let len = note.len().min(REJECT_PRIVATE_DATA);
    // SAFETY: `id` is a request's identifier that nothing else holds; the note outlives
    // the call, which copies it.
    unsafe {
        rdma_reject(id.0.as_ptr(), note.as_ptr().cast(), len as u8);
        rdma_destroy_id(id.0.as_ptr());
    }
}

impl RdmaCm {
    fn start() -> io::Result<RdmaCm> {
        // SAFETY: plain call; a null result is an error with errno set.
        let channel = NonNull::new(unsafe { rdma_create_event_channel() }).ok_or_else(|| {
            let e = io::Error::last_os_error();
            io::Error::other(format!(
                "cannot open the RDMA connection manager (/dev/infiniband/rdma_cm; is the \
                 rdma_ucm module loaded?): {e}"
            ))
        })?;
        let shared = Arc::new(Shared {
            channel: Channel(channel),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            next_token: AtomicU64::new(1),
        });
        let reader = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("rdmad-cm".into())
            .spawn(move || reader.run())?;
        Ok(RdmaCm { shared })
    }
}

impl Shared {
    /// Reads events until the channel fails (it never does short of a kernel fault); then
    /// every wait ends at once and the next `connection_manager()` opens a new one.
    fn run(&self) {
        loop {
            let mut raw: *mut rdma_cm_event = ptr::null_mut();
            // SAFETY: the channel is valid for the daemon's life; `raw` receives an event
            // librdmacm owns until it is acknowledged below.
            let rc = unsafe { rdma_get_cm_event(self.channel.0.as_ptr(), &mut raw) };
            if rc != 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!(
                    "rdma_cm events can no longer be read: {e}; the next connection by \
                     address opens the connection manager again"
                );
                // Listeners' waiters wake and hear it (`next_request`); connections are
                // over as far as rdmad can tell (no disconnect can reach them any more):
                // their disconnect callbacks run, moving their queue pairs to the error
                // state.
                let (wake, ended): (Vec<_>, Vec<_>) = {
                    let mut state = lock(&self.state);
                    state.failed = Some(e.to_string());
                    let wake = state
                        .slots
                        .values()
                        .filter_map(|slot| slot.on_request.clone())
                        .collect();
                    let ended = state
                        .slots
                        .values_mut()
                        .filter_map(|slot| {
                            slot.disconnected = true;
                            slot.on_disconnect.take()
                        })
                        .collect();
                    (wake, ended)
                };
                self.changed.notify_all();
                for f in wake {
                    f();
                }
                for f in ended {
                    f();
                }
                return;
            }
            // SAFETY: `raw` is a valid event until acknowledged; it is copied first, with
            // the tokens in its identifiers' `context`: until the acknowledgement no
            // identifier of the event can be destroyed (rdma_destroy_id waits for it), after
            // it either may be, so they are not read again.
            let (event, id, token, listener) = unsafe {
                let e = &*raw;
                let conn = &e.param.conn;
                let private_data = if conn.private_data.is_null() {
                    Vec::new()
                } else {
                    std::slice::from_raw_parts(
                        conn.private_data.cast::<u8>(),
                        usize::from(conn.private_data_len),
                    )
                    .to_vec()
                };
                let copied = Event {
                    kind: e.event,
                    status: e.status,
                    private_data,
                    responder_resources: conn.responder_resources,
                    initiator_depth: conn.initiator_depth,
                };
                let token = |id: *mut rdma_cm_id| {
                    NonNull::new(id).map_or(0, |id| (*id.as_ptr()).context as u64)
                };
                (copied, e.id, token(e.id), token(e.listen_id))
            };
            // SAFETY: `raw` came from rdma_get_cm_event and is acknowledged once.
            unsafe { rdma_ack_cm_event(raw) };
            self.deliver(event, id, token, listener);
        }
    }

    /// Hands an acknowledged event to its slot: `token` is its identifier's, `listener` the
    /// listener's of a connection request. `id` is used only for a connection request,
    /// whose new identifier no one else knows yet.
    fn deliver(&self, event: Event, id: *mut rdma_cm_id, token: u64, listener: u64) {
        let Some(id) = NonNull::new(id) else { return };
        if event.kind == ev::RDMA_CM_EVENT_CONNECT_REQUEST {
            let token = listener;
            let mut state = lock(&self.state);
            let expired = expire(&mut state, token);
            let Some(slot) = state.slots.get_mut(&token) else {
                drop(state);
                refuse_all(expired);
                refuse(RawId(id), b"rdmad: no longer listening");
                return;
            };
            if slot.requests.len() >= slot.backlog {
                let note = slot.refusal.clone();
                drop(state);
                refuse_all(expired);
                tracing::info!("connection request refused: the listener's backlog is full");
                refuse(RawId(id), &note);
                return;
            }
            // The request's identifier gets a slot of its own now, before any of its
            // own events is read (only this thread reads `context`).
            let child = self.next_token.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the request's identifier is valid and, until it is queued below,
            // known to this thread only.
            unsafe { (*id.as_ptr()).context = child as *mut c_void };
            slot.requests.push_back(Pending {
                id: RawId(id),
                token: child,
                event,
                arrived: Instant::now(),
            });
            let wake = slot.on_request.clone();
            state.slots.insert(
                child,
                Slot {
                    id: Some(RawId(id)),
                    ..Slot::default()
                },
            );
            drop(state);
            refuse_all(expired);
            self.changed.notify_all();
            if let Some(f) = wake {
                f();
            }
            return;
        }
        let ends = matches!(
            event.kind,
            ev::RDMA_CM_EVENT_DISCONNECTED
                | ev::RDMA_CM_EVENT_DEVICE_REMOVAL
                | ev::RDMA_CM_EVENT_CONNECT_ERROR
                | ev::RDMA_CM_EVENT_UNREACHABLE
                | ev::RDMA_CM_EVENT_REJECTED
        );
        let mut state = lock(&self.state);
        let Some(slot) = state.slots.get_mut(&token) else {
            return;
        };
        let call = if ends {
            slot.disconnected = true;
            slot.on_disconnect.take()
        } else {
            None
        };
        if event.kind == ev::RDMA_CM_EVENT_DISCONNECTED {
            if let Some(id) = slot.id {
                // Answers the peer's disconnect request (DREP) at once, so the peer's
                // disconnect completes without waiting for its timeout.
                // SAFETY: the slot exists, so its identifier is not destroyed yet (its
                // owner removes the slot under this lock first).
                unsafe { rdma_disconnect(id.0.as_ptr()) };
            }
        }
        slot.events.push_back(event);
        // Only the last few matter to a waiter; a connection's late events are not kept.
        while slot.events.len() > 16 {
            slot.events.pop_front();
        }
        drop(state);
        self.changed.notify_all();
        if let Some(f) = call {
            f();
        }
    }

    /// Why the event thread stopped, if it has.
    fn failure(&self) -> Option<String> {
        lock(&self.state).failed.clone()
    }

    /// The error for a wait that ended without its event: `waited` says what did not
    /// happen in time, unless the event thread stopped, which is said instead.
    fn unanswered(&self, waited: String) -> ProviderError {
        match self.failure() {
            Some(why) => connection_error(format!(
                "rdmad stopped reading rdma_cm events ({why}); try again: the next \
                 connection opens the connection manager anew"
            )),
            None => connection_error(waited),
        }
    }

    fn new_slot(&self, slot: Slot) -> u64 {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        lock(&self.state).slots.insert(token, slot);
        token
    }

    /// Waits up to `timeout` for an event of one of `kinds` on `token`'s slot; other
    /// events are dropped. Returns `None` at once if the event thread has stopped (say why
    /// with [`Shared::unanswered`]).
    fn wait(&self, token: u64, kinds: &[ev::Type], timeout: Duration) -> Option<Event> {
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.state);
        loop {
            let slot = state.slots.get_mut(&token)?;
            while let Some(e) = slot.events.pop_front() {
                if kinds.contains(&e.kind) {
                    return Some(e);
                }
            }
            // Events delivered before the thread stopped are still answers.
            if state.failed.is_some() {
                return None;
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl ConnectionManager for RdmaCm {
    fn listen(&self, addr: SocketAddr, backlog: u32, refusal: &[u8]) -> Result<Box<dyn CmId>> {
        let id = VerbsCmId::create(
            &self.shared,
            Slot {
                backlog: backlog as usize,
                refusal: refusal.to_vec(),
                ..Slot::default()
            },
        )?;
        let (mut storage, _) = to_sockaddr(addr);
        // SAFETY: `id` is valid; `storage` holds a sockaddr of `addr`'s family.
        let rc = unsafe {
            rdma_bind_addr(
                id.raw.0.as_ptr(),
                (&mut storage as *mut libc::sockaddr_storage).cast(),
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return Err(ProviderError::InvalidArgument {
                device: CM.to_owned(),
                message: match e.raw_os_error() {
                    Some(libc::EADDRINUSE) => format!("{addr} is in use by another listener"),
                    Some(libc::EADDRNOTAVAIL) | Some(libc::ENODEV) => format!(
                        "{} is not an address of this host's RDMA devices",
                        addr.ip()
                    ),
                    _ => format!("cannot bind to {addr}: {e}"),
                },
            });
        }
        // SAFETY: `id` is valid and bound.
        let rc = unsafe { rdma_listen(id.raw.0.as_ptr(), backlog.clamp(1, 1024) as c_int) };
        if rc != 0 {
            return Err(ProviderError::last_os(CM, "rdma_listen"));
        }
        Ok(Box::new(id))
    }

    fn resolve(
        &self,
        from: Option<SocketAddr>,
        to: SocketAddr,
        timeout: Duration,
    ) -> Result<Box<dyn CmId>> {
        let id = VerbsCmId::create(&self.shared, Slot::default())?;
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as c_int;
        let (mut dst, _) = to_sockaddr(to);
        let mut src = from.map(|a| to_sockaddr(a).0);
        // SAFETY: `id` is valid; both sockaddrs live across the call, which copies them.
        let rc = unsafe {
            rdma_resolve_addr(
                id.raw.0.as_ptr(),
                src.as_mut().map_or(ptr::null_mut(), |s| {
                    (s as *mut libc::sockaddr_storage).cast()
                }),
                (&mut dst as *mut libc::sockaddr_storage).cast(),
                ms,
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return Err(connection_error(format!("cannot resolve {}: {e}", to.ip())));
        }
        // Each step ends in its success event or its error event (or nothing in time).
        let step = |done: ev::Type, failed: ev::Type, doing: &str, failure: &str| {
            let e = id
                .shared
                .wait(id.token, &[done, failed], timeout + Duration::from_secs(1))
                .ok_or_else(|| {
                    id.shared
                        .unanswered(format!("{doing} {} took longer than {timeout:?}", to.ip()))
                })?;
            if e.kind == done {
                return Ok(());
            }
            Err(connection_error(format!(
                "{} {failure} ({})",
                to.ip(),
                status_text(e.status)
            )))
        };
        step(
            ev::RDMA_CM_EVENT_ADDR_RESOLVED,
            ev::RDMA_CM_EVENT_ADDR_ERROR,
            "resolving",
            "cannot be reached through an RDMA device of this host",
        )?;
        // SAFETY: `id` is valid.
        if unsafe { rdma_resolve_route(id.raw.0.as_ptr(), ms) } != 0 {
            let e = io::Error::last_os_error();
            return Err(connection_error(format!("no route to {}: {e}", to.ip())));
        }
        step(
            ev::RDMA_CM_EVENT_ROUTE_RESOLVED,
            ev::RDMA_CM_EVENT_ROUTE_ERROR,
            "finding a route to",
            "has no route from here",
        )?;
        Ok(Box::new(id))
    }
}

fn connection_error(message: String) -> ProviderError {
    ProviderError::Connection {
        device: CM.to_owned(),
        message,
    }
}

/// An identifier with its slot; dropping it disconnects (if connected) and destroys it.
#[derive(Debug)]
struct VerbsCmId {
    raw: RawId,
    token: u64,
    shared: Arc<Shared>,
    connected: AtomicBool,
}

// SAFETY: see `RawId`; the slot is behind the shared mutex.
unsafe impl Sync for VerbsCmId {}

impl VerbsCmId {
    fn create(shared: &Arc<Shared>, slot: Slot) -> Result<VerbsCmId> {
        let token = shared.new_slot(slot);
        let mut raw: *mut rdma_cm_id = ptr::null_mut();
        // SAFETY: the channel is valid; the context is a plain number read back by the
        // event thread.
        let rc = unsafe {
            rdma_create_id(
                shared.channel.0.as_ptr(),
                &mut raw,
                token as *mut c_void,
                rdma_port_space::RDMA_PS_TCP,
            )
        };
        let Some(raw) = NonNull::new(raw).filter(|_| rc == 0) else {
            lock(&shared.state).slots.remove(&token);
            return Err(ProviderError::last_os(CM, "rdma_create_id"));
        };
        if let Some(slot) = lock(&shared.state).slots.get_mut(&token) {
            slot.id = Some(RawId(raw));
        }
        Ok(VerbsCmId {
            raw: RawId(raw),
            token,
            shared: Arc::clone(shared),
            connected: AtomicBool::new(false),
        })
    }

    /// Takes over a request's identifier and the slot the event thread made for it.
    fn adopt(shared: &Arc<Shared>, raw: RawId, token: u64) -> VerbsCmId {
        VerbsCmId {
            raw,
            token,
            shared: Arc::clone(shared),
            connected: AtomicBool::new(false),
        }
    }

    fn id(&self) -> *mut rdma_cm_id {
        self.raw.0.as_ptr()
    }

    fn conn_param(param: &ConnParam, limit: usize) -> Result<rdma_conn_param> {
        if param.private_data.len() > limit {
            return Err(ProviderError::InvalidArgument {
                device: CM.to_owned(),
                message: format!(
                    "private data of {} bytes is more than the {limit} a connection carries here",
                    param.private_data.len()
                ),
            });
        }
        Ok(rdma_conn_param {
            private_data: if param.private_data.is_empty() {
                ptr::null()
            } else {
                param.private_data.as_ptr().cast()
            },
            private_data_len: param.private_data.len() as u8,
            responder_resources: param.responder_resources,
            initiator_depth: param.initiator_depth,
            flow_control: 1,
            retry_count: param.retry_count.min(7),
            rnr_retry_count: param.rnr_retry_count.min(7),
            srq: 0,
            qp_num: param.qp_num,
        })
    }

    /// The peer's address for messages, or "the peer" when the identifier has none.
    fn peer_name(&self) -> String {
        self.peer_addr()
            .map_or_else(|| "the peer".to_owned(), |a| a.to_string())
    }

    fn qp_attr(&self, state: ibv_qp_state::Type) -> Result<ibv_qp_attr> {
        // SAFETY: plain C data; all-zero bytes are valid.
        let mut attr: ibv_qp_attr = unsafe { zeroed() };
        attr.qp_state = state;
        let mut mask: c_int = 0;
        // SAFETY: `id` is valid; attr and mask are written by the call.
        if unsafe { rdma_init_qp_attr(self.id(), &mut attr, &mut mask) } != 0 {
            return Err(ProviderError::last_os(CM, "rdma_init_qp_attr"));
        }
        Ok(attr)
    }
}

impl Drop for VerbsCmId {
    fn drop(&mut self) {
        if self.connected.load(Ordering::Acquire) {
            // SAFETY: `id` is valid until destroyed below.
            unsafe { rdma_disconnect(self.id()) };
        }
        let mut state = lock(&self.shared.state);
        let requests = state
            .slots
            .remove(&self.token)
            .map(|slot| slot.requests)
            .unwrap_or_default();
        for pending in &requests {
            state.slots.remove(&pending.token);
        }
        drop(state);
        for pending in requests {
            refuse(pending.id, b"rdmad: the listener was closed");
        }
        // SAFETY: `id` is ours and destroyed once; the event thread acknowledged all of
        // its events before delivering them.
        unsafe { rdma_destroy_id(self.id()) };
    }
}

impl CmId for VerbsCmId {
    fn device(&self) -> Option<(String, u8)> {
        // SAFETY: `id` is valid; `verbs` is null or librdmacm's open context, whose
        // device and name live as long as librdmacm.
        unsafe {
            let verbs = (*self.id()).verbs;
            if verbs.is_null() || (*verbs).device.is_null() {
                return None;
            }
            let name = ibv_get_device_name((*verbs).device);
            if name.is_null() {
                return None;
            }
            Some((
                CStr::from_ptr(name).to_string_lossy().into_owned(),
                (*self.id()).port_num,
            ))
        }
    }

    fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: `id` is valid; the route's source address is a sockaddr_storage.
        from_sockaddr(unsafe { &(*self.id()).route.addr.src_addr_union.src_storage })
    }

    fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as above, for the destination.
        from_sockaddr(unsafe { &(*self.id()).route.addr.dst_addr_union.dst_storage })
    }

    fn path(&self) -> Result<CmPath> {
        let init = self.qp_attr(ibv_qp_state::IBV_QPS_INIT)?;
        let rtr = self.qp_attr(ibv_qp_state::IBV_QPS_RTR)?;
        let rts = self.qp_attr(ibv_qp_state::IBV_QPS_RTS)?;
        // SAFETY: reading the `raw` view of a GID union.
        let dgid = Ipv6Addr::from(unsafe { rtr.ah_attr.grh.dgid.raw });
        Ok(CmPath {
            remote: RemoteEndpoint {
                gid: dgid,
                qp_num: rtr.dest_qp_num,
                psn: rtr.rq_psn,
                lid: rtr.ah_attr.dlid,
            },
            rtr: RtrAttributes {
                port: if rtr.ah_attr.port_num != 0 {
                    rtr.ah_attr.port_num
                } else {
                    init.port_num
                },
                sgid_index: u32::from(rtr.ah_attr.grh.sgid_index),
                path_mtu: match mtu_bytes(rtr.path_mtu) {
                    0 => 1024,
                    n => n,
                },
                max_dest_rd_atomic: rtr.max_dest_rd_atomic,
                min_rnr_timer: rtr.min_rnr_timer,
            },
            rts: RtsAttributes {
                psn: rts.sq_psn,
                timeout: rts.timeout,
                retry_cnt: rts.retry_cnt,
                rnr_retry: rts.rnr_retry,
                max_rd_atomic: rts.max_rd_atomic,
            },
        })
    }

    fn connect(&self, param: &ConnParam, timeout: Duration) -> Result<CmReply> {
        let mut p = Self::conn_param(param, REQUEST_PRIVATE_DATA)?;
        // SAFETY: `id` is valid and resolved; `p` and its private data live across the
        // call, which copies them.
        if unsafe { rdma_connect(self.id(), &mut p) } != 0 {
            let e = io::Error::last_os_error();
            return Err(connection_error(format!(
                "cannot send the connection request: {e}"
            )));
        }
        let peer = self.peer_name();
        let e = self
            .shared
            .wait(
                self.token,
                &[
                    ev::RDMA_CM_EVENT_CONNECT_RESPONSE,
                    ev::RDMA_CM_EVENT_ESTABLISHED,
                    ev::RDMA_CM_EVENT_REJECTED,
                    ev::RDMA_CM_EVENT_UNREACHABLE,
                    ev::RDMA_CM_EVENT_CONNECT_ERROR,
                ],
                timeout,
            )
            .ok_or_else(|| {
                self.shared
                    .unanswered(format!("{peer} did not answer within {timeout:?}"))
            })?;
        match e.kind {
            ev::RDMA_CM_EVENT_CONNECT_RESPONSE | ev::RDMA_CM_EVENT_ESTABLISHED => Ok(CmReply {
                private_data: e.private_data,
                responder_resources: e.responder_resources,
                initiator_depth: e.initiator_depth,
            }),
            ev::RDMA_CM_EVENT_REJECTED => Err(connection_error(rejection(&peer, &e))),
            _ => Err(connection_error(format!(
                "{peer} is unreachable ({}: status {})",
                event_name(e.kind),
                e.status
            ))),
        }
    }

    fn establish(&self) -> Result<()> {
        // SAFETY: `id` is valid and has the peer's accept.
        if unsafe { rdma_establish(self.id()) } != 0 {
            return Err(ProviderError::last_os(CM, "rdma_establish"));
        }
        self.connected.store(true, Ordering::Release);
        Ok(())
    }

    fn accept(&self, param: &ConnParam, timeout: Duration) -> Result<()> {
        let mut p = Self::conn_param(param, REPLY_PRIVATE_DATA)?;
        // SAFETY: `id` is a request's; `p` lives across the call, which copies it.
        if unsafe { rdma_accept(self.id(), &mut p) } != 0 {
            return Err(ProviderError::last_os(CM, "rdma_accept"));
        }
        self.connected.store(true, Ordering::Release);
        let peer = self.peer_name();
        let e = self
            .shared
            .wait(
                self.token,
                &[
                    ev::RDMA_CM_EVENT_ESTABLISHED,
                    ev::RDMA_CM_EVENT_CONNECT_ERROR,
                    ev::RDMA_CM_EVENT_UNREACHABLE,
                    ev::RDMA_CM_EVENT_REJECTED,
                    ev::RDMA_CM_EVENT_DISCONNECTED,
                ],
                timeout,
            )
            .ok_or_else(|| {
                self.shared.unanswered(format!(
                    "{peer} did not confirm the connection within {timeout:?}"
                ))
            })?;
        if e.kind == ev::RDMA_CM_EVENT_ESTABLISHED {
            Ok(())
        } else {
            Err(connection_error(format!(
                "{peer} did not complete the connection ({}, status {})",
                event_name(e.kind),
                e.status
            )))
        }
    }

    fn reject(&self, private_data: &[u8]) -> Result<()> {
        let len = private_data.len().min(REJECT_PRIVATE_DATA);
        // SAFETY: `id` is a request's; the data outlives the call, which copies it.
        if unsafe { rdma_reject(self.id(), private_data.as_ptr().cast(), len as u8) } != 0 {
            return Err(ProviderError::last_os(CM, "rdma_reject"));
        }
        Ok(())
    }

    fn next_request(&self, timeout: Duration) -> Result<Option<CmRequest>> {
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.shared.state);
        loop {
            let expired = expire(&mut state, self.token);
            if !expired.is_empty() {
                drop(state);
                refuse_all(expired);
                state = lock(&self.shared.state);
            }
            let failed = state.failed.is_some();
            let Some(slot) = state.slots.get_mut(&self.token) else {
                return Ok(None);
            };
            if failed {
                // A request still queued cannot be connected (its events would never
                // arrive): refuse them all, and say the listener is over.
                let requests: Vec<Pending> = slot.requests.drain(..).collect();
                for p in &requests {
                    state.slots.remove(&p.token);
                }
                let why = state.failed.clone().unwrap_or_default();
                drop(state);
                for p in requests {
                    refuse(p.id, b"rdmad: no longer listening");
                }
                return Err(connection_error(format!(
                    "rdmad stopped reading rdma_cm events ({why}): this listener hears no \
                     more requests; stop listening and listen again"
                )));
            }
            if let Some(p) = slot.requests.pop_front() {
                drop(state);
                let id = VerbsCmId::adopt(&self.shared, p.id, p.token);
                return Ok(Some(CmRequest {
                    id: Box::new(id),
                    private_data: p.event.private_data,
                    responder_resources: p.event.responder_resources,
                    initiator_depth: p.event.initiator_depth,
                }));
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Ok(None);
            };
            state = self
                .shared
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn on_request(&self, f: Arc<dyn Fn() + Send + Sync>) {
        if let Some(slot) = lock(&self.shared.state).slots.get_mut(&self.token) {
            slot.on_request = Some(f);
        }
    }

    fn on_disconnect(&self, f: Box<dyn FnOnce() + Send>) {
        let mut state = lock(&self.shared.state);
        match state.slots.get_mut(&self.token) {
            Some(slot) if !slot.disconnected => slot.on_disconnect = Some(f),
            _ => {
                drop(state);
                f();
            }
        }
    }
}

/// Why a peer rejected, in words: IB CM reject reason 8 is "no listener on that port"
/// (invalid service ID), 28 a program's own refusal with its private data.
fn rejection(peer: &str, e: &Event) -> String {
    let said = describe_private_data(&e.private_data);
    match e.status {
        8 => {
            format!("{peer} refused the connection: nothing listens on that port (reject reason 8)")
        }
        28 if said.is_empty() => {
            format!("{peer} rejected the connection (reject reason 28, by its program)")
        }
        28 => format!("{peer} rejected the connection: {said} (reject reason 28, by its program)"),
        n => format!(
            "{peer} rejected the connection (reject reason {n}){}",
            if said.is_empty() {
                String::new()
            } else {
                format!(": {said}")
            }
        ),
    }
}

/// Private data as text if it is text (up to a NUL), else as hex.
pub fn describe_private_data(data: &[u8]) -> String {
    let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    let text = &data[..end];
    if data[end..].iter().all(|&b| b == 0)
        && text.iter().all(|b| b.is_ascii_graphic() || *b == b' ')
    {
        String::from_utf8_lossy(text).into_owned()
    } else {
        data.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// An error event's status: a negative errno from the kernel in words, else the number
/// (librdmacm's own failures report -1).
fn status_text(status: c_int) -> String {
    if status < -1 {
        io::Error::from_raw_os_error(-status).to_string()
    } else {
        format!("status {status}")
    }
}

fn event_name(kind: ev::Type) -> &'static str {
    match kind {
        ev::RDMA_CM_EVENT_ADDR_ERROR => "address error",
        ev::RDMA_CM_EVENT_ROUTE_ERROR => "route error",
        ev::RDMA_CM_EVENT_CONNECT_ERROR => "connection error",
        ev::RDMA_CM_EVENT_UNREACHABLE => "unreachable",
        ev::RDMA_CM_EVENT_REJECTED => "rejected",
        ev::RDMA_CM_EVENT_DISCONNECTED => "disconnected",
        ev::RDMA_CM_EVENT_DEVICE_REMOVAL => "device removed",
        ev::RDMA_CM_EVENT_TIMEWAIT_EXIT => "time-wait over",
        _ => "event",
    }
}

fn to_sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, usize) {
    // SAFETY: plain C data; all-zero bytes are valid.
    let mut storage: libc::sockaddr_storage = unsafe { zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            (storage, size_of::<libc::sockaddr_in>())
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            (storage, size_of::<libc::sockaddr_in6>())
        }
    }
}

fn from_sockaddr(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match c_int::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says it holds a sockaddr_in.
            let sin =
                unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says it holds a sockaddr_in6.
            let sin6 = unsafe {
                &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses_survive_the_c_form() {
        for a in [
            "10.1.2.3:7471".parse::<SocketAddr>().unwrap(),
            "[fd00:77::2]:18515".parse().unwrap(),
        ] {
            assert_eq!(from_sockaddr(&to_sockaddr(a).0), Some(a));
        }
    }

    #[test]
    fn private_data_reads_as_text_when_it_is() {
        assert_eq!(describe_private_data(b"rdmad: quota\0\0"), "rdmad: quota");
        assert_eq!(describe_private_data(&[1, 2, 0xff]), "0102ff");
        assert_eq!(describe_private_data(b""), "");
    }
}
