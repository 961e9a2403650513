//! Sessions, regions and access keys, and who owns what. Every session's resources are
//! released as one unit; quota usage is reserved under the same lock that checks it, so
//! concurrent requests never overshoot.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use super::pool::{Pool, PoolError};
use super::qp::{self, Export, ExportId, QpId, QpOptions, QueuePairRecord};
use super::DeviceEntry;
use super::EngineError;
use crate::config::{Config, QuotaKind};
use crate::lock::lock;
use crate::policy::keys::{self, KeyDigest};
use crate::policy::quota::{self, Usage};
use crate::policy::{self, lookups, Caller};
use crate::provider::MemoryRegion;

pub type SessionId = u64;
pub type RegionId = u64;
pub type KeyId = u64;

/// How a region is attached (and what an access key grants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    ReadOnly,
    ReadWrite,
}

impl AttachMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AttachMode::ReadOnly => "ro",
            AttachMode::ReadWrite => "rw",
        }
    }

    pub fn parse(s: &str) -> Option<AttachMode> {
        match s {
            "ro" => Some(AttachMode::ReadOnly),
            "rw" => Some(AttachMode::ReadWrite),
            _ => None,
        }
    }
}

#[derive(Debug)]
struct Session {
    owner: Caller,
    created: SystemTime,
    regions: BTreeSet<RegionId>,
    attachments: BTreeMap<RegionId, AttachMode>,
    qps: BTreeSet<QpId>,
}

#[derive(Debug)]
struct Region {
    session: SessionId,
    owner_uid: u32,
    pool: Arc<Pool>,
    requested: u64,
    mr: Arc<dyn MemoryRegion>,
    keys: BTreeSet<KeyId>,
    attached: BTreeMap<SessionId, AttachMode>,
    /// Windows bound over it for peers: (queue pair, export).
    exports: BTreeSet<(QpId, ExportId)>,
}

impl Region {
    fn size(&self) -> u64 {
        self.mr.len() as u64
    }
}

#[derive(Debug)]
struct Key {
    region: RegionId,
    digest: KeyDigest,
    access: AttachMode,
    expires: Option<SystemTime>,
    owner_uid: u32,
}

#[derive(Debug, Default)]
struct State {
    sessions: BTreeMap<SessionId, Session>,
    regions: BTreeMap<RegionId, Region>,
    keys: BTreeMap<KeyId, Key>,
    qps: BTreeMap<QpId, Arc<QueuePairRecord>>,
    usage: HashMap<u32, Usage>,
    last_session: SessionId,
    last_region: RegionId,
    last_key: KeyId,
    last_qp: QpId,
    last_export: ExportId,
    /// Sessions taken out of the registry whose objects are still being released. They
    /// still count as sessions ([`Registry::counts`]), so that whoever sees the count of
    /// sessions drop also sees what they held released: provider objects, pool space.
    releasing: usize,
}

/// What a teardown removed, so the D-Bus layer can withdraw the objects.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Removed {
    pub sessions: Vec<SessionId>,
    pub regions: Vec<RegionId>,
    pub qps: Vec<QpId>,
}

impl Removed {
    fn extend(&mut self, other: Removed) {
        self.sessions.extend(other.sessions);
        self.regions.extend(other.regions);
        self.qps.extend(other.qps);
    }
}

/// A memory window bound through a queue pair.
type Window = Arc<dyn crate::provider::MemoryWindow>;

/// A window taken out of the queue pair it was bound through, with what must outlive it.
/// Fields drop in order: the window (its rkey dies), then that queue pair (rxe blocks ~50 s
/// destroying a QP with a valid type-2 window), then the registration it is bound over
/// (rxe refuses to deregister an MR with a bound window).
#[derive(Debug)]
pub struct TakenWindow {
    pub window: Window,
    pub bound_through: Arc<QueuePairRecord>,
    pub over: Arc<dyn MemoryRegion>,
}

impl TakenWindow {
    fn new(export: Export, bound_through: &Arc<QueuePairRecord>) -> TakenWindow {
        let Export { window, mr, .. } = export;
        TakenWindow {
            window,
            bound_through: Arc::clone(bound_through),
            over: mr,
        }
    }
}

/// Device objects released outside the lock (destruction can be slow). Windows are always
/// taken out of their queue pairs explicitly — never left inside one that someone else
/// (a data-path worker slow to let go) may still hold — and go first.
#[derive(Default)]
struct Garbage {
    windows: Vec<TakenWindow>,
    qps: Vec<Arc<QueuePairRecord>>,
    mrs: Vec<Arc<dyn MemoryRegion>>,
}

impl Garbage {
    fn extend(&mut self, other: Garbage) {
        self.windows.extend(other.windows);
        self.qps.extend(other.qps);
        self.mrs.extend(other.mrs);
    }

    /// Takes every window out of queue pair `qp` (being removed) and out of its regions'
    /// lists of exports, which stop counting against their owners' `exports` quota.
    fn take_windows_of(&mut self, s: &mut State, qp: QpId, record: &Arc<QueuePairRecord>) {
        let exports = std::mem::take(&mut *lock(&record.exports));
        for (export, e) in exports {
            if let Some(region) = s.regions.get_mut(&e.region) {
                if region.exports.remove(&(qp, export)) {
                    let uid = region.owner_uid;
                    if let Some(usage) = s.usage.get_mut(&uid) {
                        usage.sub(QuotaKind::Exports, 1);
                    }
                    Registry::forget_idle_user(s, uid);
                }
            }
            self.windows.push(TakenWindow::new(e, record));
        }
    }
}

/// A snapshot of a session, as the caller may see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    pub id: SessionId,
    pub uid: u32,
    pub bus_name: String,
    pub pid: Option<u32>,
    pub created: SystemTime,
    pub regions: Vec<RegionId>,
    pub attachments: Vec<(RegionId, AttachMode)>,
    pub registered_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub id: KeyId,
    pub region: RegionId,
    pub access: AttachMode,
    pub expires: Option<SystemTime>,
    pub owner_uid: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    pub id: RegionId,
    pub session: SessionId,
    pub owner_uid: u32,
    pub pool: String,
    pub device: String,
    pub size: u64,
    pub requested: u64,
    pub keys: Vec<KeyInfo>,
    pub attachments: Vec<(SessionId, AttachMode)>,
}

/// One line of a quota report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaLine {
    pub kind: QuotaKind,
    pub limit: u64,
    pub used: u64,
    pub source: String,
}

/// A region handed to a client: its id, a descriptor of its memfd and its size.
#[derive(Debug)]
pub struct Handout {
    pub region: RegionId,
    pub fd: OwnedFd,
    pub size: u64,
    pub access: AttachMode,
}

fn not_authorized(message: impl Into<String>) -> EngineError {
    EngineError::NotAuthorized(message.into())
}

/// Told which queue pairs were removed, before they are released (the data-path workers
/// let go of them).
pub type QpListener = Box<dyn Fn(&[QpId]) + Send + Sync>;

/// Told after every teardown.
pub type ReleaseListener = Box<dyn Fn() + Send + Sync>;

#[derive(Default)]
pub struct Registry {
    state: Mutex<State>,
    qp_listener: std::sync::OnceLock<QpListener>,
    release_listener: std::sync::OnceLock<ReleaseListener>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// The registry's state, locked. While it is held, user and group lookups (NSS, which may
/// block on a directory server) are a bug, checked in debug builds: see
/// [`crate::policy::lookups`].
struct Locked<'a> {
    // Field order is drop order: the lock is released, then lookups are allowed again.
    state: std::sync::MutexGuard<'a, State>,
    _no_lookups: lookups::Forbidden,
}

impl std::ops::Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.state
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.state
    }
}

impl Registry {
    fn lock(&self) -> Locked<'_> {
        Locked {
            state: lock(&self.state),
            _no_lookups: lookups::forbid(),
        }
    }

    /// Sets who hears of removed queue pairs (once).
    pub fn set_qp_listener(&self, listener: QpListener) {
        if self.qp_listener.set(listener).is_err() {
            tracing::error!("the queue-pair listener was set twice");
        }
    }

    /// Sets what runs after every teardown (once): the engine retries what the devices
    /// refused to destroy.
    pub fn set_release_listener(&self, listener: ReleaseListener) {
        if self.release_listener.set(listener).is_err() {
            tracing::error!("the release listener was set twice");
        }
    }

    /// Releases what a teardown removed. Windows go first, whatever the data-path workers
    /// do: their rkeys die at once, and no window is left to outlive its memory. Then the
    /// listener has the workers let go of the removed QPs (bounded: a worker that does not
    /// in time keeps its QPs until it does, and then destroys them itself), then the QPs,
    /// then the registrations.
    fn release(&self, removed_qps: &[QpId], garbage: Garbage) {
        let Garbage { windows, qps, mrs } = garbage;
        drop(windows);
        if !removed_qps.is_empty() {
            if let Some(listener) = self.qp_listener.get() {
                listener(removed_qps);
            }
        }
        drop(qps);
        drop(mrs);
        if let Some(listener) = self.release_listener.get() {
            listener();
        }
    }

    /// Sessions (those still being released included), regions and keys.
    pub fn counts(&self) -> (usize, usize, usize) {
        let s = self.lock();
        (
            s.sessions.len() + s.releasing,
            s.regions.len(),
            s.keys.len(),
        )
    }

    /// Releases what removed sessions held, outside the lock (`s`), counting them as
    /// sessions until it is done.
    fn release_sessions(&self, mut s: Locked<'_>, removed: &Removed, garbage: Garbage) {
        struct Releasing<'a>(&'a Registry, usize);
        impl Drop for Releasing<'_> {
            fn drop(&mut self) {
                self.0.lock().releasing -= self.1;
            }
        }
        s.releasing += removed.sessions.len();
        drop(s);
        let _done = Releasing(self, removed.sessions.len());
        self.release(&removed.qps, garbage);
    }

    pub fn qp_count(&self) -> usize {
        self.lock().qps.len()
    }

    /// Live usage of `uid` (zero when it holds nothing).
    pub fn usage(&self, uid: u32) -> Usage {
        self.lock().usage.get(&uid).copied().unwrap_or_default()
    }

    pub fn open_session(&self, config: &Config, caller: &Caller) -> Result<SessionId, EngineError> {
        let limits = quota::limits_for(config, caller.uid, &caller.gids);
        let mut s = self.lock();
        let usage = s.usage.entry(caller.uid).or_default();
        quota::check(&limits, usage, QuotaKind::Sessions, 1)?;
        usage.add(QuotaKind::Sessions, 1);
        s.last_session += 1;
        let id = s.last_session;
        s.sessions.insert(
            id,
            Session {
                owner: caller.clone(),
                created: SystemTime::now(),
                regions: BTreeSet::new(),
                attachments: BTreeMap::new(),
                qps: BTreeSet::new(),
            },
        );
        Ok(id)
    }

    /// Closes a session: the owner connection, another process of the same user, or an
    /// administrator may.
    pub fn close_session(
        &self,
        config: &Config,
        caller: &Caller,
        id: SessionId,
    ) -> Result<Removed, EngineError> {
        let admin = policy::is_admin(caller, config);
        let mut s = self.lock();
        let session = s
            .sessions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("session {id}")))?;
        if session.owner.uid != caller.uid && !admin {
            return Err(not_authorized(format!(
                "session {id} belongs to another user; only its owner or an administrator may close it"
            )));
        }
        let (removed, garbage) = Self::remove_session(&mut s, id);
        self.release_sessions(s, &removed, garbage);
        Ok(removed)
    }

    /// Closes every session of a bus connection that left the bus.
    pub fn close_sessions_of(&self, bus_name: &str) -> Removed {
        self.close_where(|session| session.owner.bus_name == bus_name)
    }

    /// Closes everything (shutdown).
    pub fn close_all(&self) -> Removed {
        self.close_where(|_| true)
    }

    fn close_where(&self, pick: impl Fn(&Session) -> bool) -> Removed {
        let mut s = self.lock();
        let ids: Vec<SessionId> = s
            .sessions
            .iter()
            .filter(|(_, session)| pick(session))
            .map(|(id, _)| *id)
            .collect();
        let mut all = Removed::default();
        let mut garbage = Garbage::default();
        for id in ids {
            let (removed, g) = Self::remove_session(&mut s, id);
            all.extend(removed);
            garbage.extend(g);
        }
        self.release_sessions(s, &all, garbage);
        all
    }

    fn remove_session(s: &mut State, id: SessionId) -> (Removed, Garbage) {
        let mut removed = Removed::default();
        let mut garbage = Garbage::default();
        let Some(session) = s.sessions.remove(&id) else {
            return (removed, garbage);
        };
        removed.sessions.push(id);
        for qp in &session.qps {
            if let Some(record) = s.qps.remove(qp) {
                garbage.take_windows_of(s, *qp, &record);
                garbage.qps.push(record);
                removed.qps.push(*qp);
            }
        }
        if let Some(usage) = s.usage.get_mut(&session.owner.uid) {
            usage.sub(QuotaKind::Qps, session.qps.len() as u64);
        }
        for region in &session.attachments {
            if let Some(r) = s.regions.get_mut(region.0) {
                r.attached.remove(&id);
            }
        }
        for region in session.regions {
            if let Some(g) = Self::remove_region(s, region) {
                garbage.extend(g);
                removed.regions.push(region);
            }
        }
        if let Some(usage) = s.usage.get_mut(&session.owner.uid) {
            usage.sub(QuotaKind::Sessions, 1);
        }
        Self::forget_idle_user(s, session.owner.uid);
        (removed, garbage)
    }

    /// Removes a region with its keys, attachments and exports; returns its registration
    /// and windows to drop.
    fn remove_region(s: &mut State, id: RegionId) -> Option<Garbage> {
        let region = s.regions.remove(&id)?;
        let mut garbage = Garbage::default();
        // Windows bound through queue pairs still served (those of removed queue pairs
        // were taken out with them).
        for (qp, export) in &region.exports {
            if let Some(record) = s.qps.get(qp) {
                if let Some(e) = lock(&record.exports).remove(export) {
                    garbage.windows.push(TakenWindow::new(e, record));
                }
            }
        }
        for key in &region.keys {
            s.keys.remove(key);
        }
        for session in region.attached.keys() {
            if let Some(attacher) = s.sessions.get_mut(session) {
                attacher.attachments.remove(&id);
            }
        }
        if let Some(owner) = s.sessions.get_mut(&region.session) {
            owner.regions.remove(&id);
        }
        let size = region.size();
        if let Some(usage) = s.usage.get_mut(&region.owner_uid) {
            usage.sub(QuotaKind::Regions, 1);
            usage.sub(QuotaKind::RegisteredBytes, size);
            usage.sub(QuotaKind::Keys, region.keys.len() as u64);
            usage.sub(QuotaKind::Exports, region.exports.len() as u64);
        }
        region.pool.release(size);
        Self::forget_idle_user(s, region.owner_uid);
        garbage.mrs.push(region.mr);
        Some(garbage)
    }

    fn forget_idle_user(s: &mut State, uid: u32) {
        if s.usage.get(&uid).is_some_and(Usage::is_zero) {
            s.usage.remove(&uid);
        }
    }

    /// Checks `amount` more of `kind` against `caller`'s limits and reserves them, in one
    /// step under the lock; [`Registry::unreserve`] gives them back if the creation fails.
    pub fn reserve(
        &self,
        config: &Config,
        caller: &Caller,
        kind: QuotaKind,
        amount: u64,
    ) -> Result<(), EngineError> {
        let limits = quota::limits_for(config, caller.uid, &caller.gids);
        let mut s = self.lock();
        let usage = s.usage.entry(caller.uid).or_default();
        let checked = quota::check(&limits, usage, kind, amount);
        if checked.is_ok() {
            usage.add(kind, amount);
        }
        Self::forget_idle_user(&mut s, caller.uid);
        checked.map_err(EngineError::from)
    }

    /// Gives back use reserved for a creation that failed.
    pub fn unreserve(&self, uid: u32, charges: &[(QuotaKind, u64)]) {
        let mut s = self.lock();
        if let Some(usage) = s.usage.get_mut(&uid) {
            for &(kind, amount) in charges {
                usage.sub(kind, amount);
            }
        }
        Self::forget_idle_user(&mut s, uid);
    }

    /// The session, if `caller`'s connection owns it.
    fn own_session<'a>(
        s: &'a mut State,
        caller: &Caller,
        id: SessionId,
    ) -> Result<&'a mut Session, EngineError> {
        let session = s
            .sessions
            .get_mut(&id)
            .ok_or(EngineError::NoSuchObject(format!("session {id}")))?;
        if session.owner.bus_name != caller.bus_name {
            return Err(not_authorized(format!(
                "session {id} belongs to another connection; use the session you opened"
            )));
        }
        Ok(session)
    }

    /// Allocates a region of `size` bytes from `pool` into `session`.
    pub fn allocate(
        &self,
        config: &Config,
        caller: &Caller,
        session: SessionId,
        pool: &Arc<Pool>,
        size: u64,
    ) -> Result<Handout, EngineError> {
        check_pool_access(pool, caller)?;
        let rounded = pool.round(size)?;
        let limits = quota::limits_for(config, caller.uid, &caller.gids);
        {
            let mut s = self.lock();
            Self::own_session(&mut s, caller, session)?;
            let usage = s.usage.entry(caller.uid).or_default();
            quota::check(&limits, usage, QuotaKind::Regions, 1)?;
            quota::check(&limits, usage, QuotaKind::RegisteredBytes, rounded)?;
            usage.add(QuotaKind::Regions, 1);
            usage.add(QuotaKind::RegisteredBytes, rounded);
        }
        let unreserve = |registry: &Registry| {
            registry.unreserve(
                caller.uid,
                &[
                    (QuotaKind::Regions, 1),
                    (QuotaKind::RegisteredBytes, rounded),
                ],
            )
        };
        let allocation = match pool.allocate(rounded) {
            Ok(a) => a,
            Err(e) => {
                unreserve(self);
                return Err(e.into());
            }
        };
        let mr = allocation.mr;
        let fd = match mr.memory().fd().try_clone_to_owned() {
            Ok(fd) => fd,
            Err(e) => {
                unreserve(self);
                pool.release(rounded);
                return Err(EngineError::Io(format!(
                    "cannot duplicate the region's memfd: {e}"
                )));
            }
        };
        let mut s = self.lock();
        // The session may have been closed while the region was being made.
        if Self::own_session(&mut s, caller, session).is_err() {
            drop(s);
            unreserve(self);
            pool.release(rounded);
            return Err(EngineError::NoSuchObject(format!(
                "session {session} (closed during the allocation)"
            )));
        }
        s.last_region += 1;
        let id = s.last_region;
        s.sessions
            .get_mut(&session)
            .expect("checked above")
            .regions
            .insert(id);
        s.regions.insert(
            id,
            Region {
                session,
                owner_uid: caller.uid,
                pool: Arc::clone(pool),
                requested: size,
                mr,
                keys: BTreeSet::new(),
                attached: BTreeMap::new(),
                exports: BTreeSet::new(),
            },
        );
        Ok(Handout {
            region: id,
            fd,
            size: rounded,
            access: AttachMode::ReadWrite,
        })
    }

    /// The region, if `caller`'s connection owns it (through its session).
    fn own_region<'a>(
        s: &'a State,
        caller: &Caller,
        id: RegionId,
    ) -> Result<&'a Region, EngineError> {
        let region = s
            .regions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("region {id}")))?;
        let owner = s
            .sessions
            .get(&region.session)
            .map(|x| x.owner.bus_name.as_str());
        if owner != Some(caller.bus_name.as_str()) {
            return Err(not_authorized(format!(
                "region {id} belongs to another session; only its owner may do this"
            )));
        }
        Ok(region)
    }

    /// Frees a region: its keys die, its attachments end, its registration is dropped and
    /// its memory is never handed out again.
    pub fn free(&self, caller: &Caller, id: RegionId) -> Result<(), EngineError> {
        let mut s = self.lock();
        Self::own_region(&s, caller, id)?;
        let garbage = Self::remove_region(&mut s, id);
        drop(s);
        if let Some(g) = garbage {
            self.release(&[], g);
        }
        Ok(())
    }

    /// Creates an access key for a region the caller owns.
    pub fn share(
        &self,
        config: &Config,
        caller: &Caller,
        id: RegionId,
        access: AttachMode,
        lifetime: Option<Duration>,
    ) -> Result<(String, KeyId), EngineError> {
        let limits = quota::limits_for(config, caller.uid, &caller.gids);
        let (token, digest) =
            keys::new_token().map_err(|e| EngineError::Io(format!("no random numbers: {e}")))?;
        let expires = match lifetime {
            Some(d) => Some(SystemTime::now().checked_add(d).ok_or_else(|| {
                EngineError::InvalidArgument(format!("expiry {d:?} is too far away"))
            })?),
            None => None,
        };
        let mut s = self.lock();
        Self::own_region(&s, caller, id)?;
        Self::purge_expired(&mut s);
        let usage = s.usage.entry(caller.uid).or_default();
        quota::check(&limits, usage, QuotaKind::Keys, 1)?;
        usage.add(QuotaKind::Keys, 1);
        s.last_key += 1;
        let key_id = s.last_key;
        s.keys.insert(
            key_id,
            Key {
                region: id,
                digest,
                access,
                expires,
                owner_uid: caller.uid,
            },
        );
        s.regions
            .get_mut(&id)
            .expect("checked above")
            .keys
            .insert(key_id);
        Ok((token, key_id))
    }

    /// Revokes a key: its region's owner or an administrator may. Live attachments stay.
    pub fn revoke(&self, config: &Config, caller: &Caller, key: KeyId) -> Result<(), EngineError> {
        let admin = policy::is_admin(caller, config);
        let mut s = self.lock();
        let k = s
            .keys
            .get(&key)
            .ok_or(EngineError::NoSuchObject(format!("key {key}")))?;
        let region = k.region;
        if !admin {
            Self::own_region(&s, caller, region)?;
        }
        Self::remove_key(&mut s, key);
        Ok(())
    }

    fn remove_key(s: &mut State, key: KeyId) {
        if let Some(k) = s.keys.remove(&key) {
            if let Some(r) = s.regions.get_mut(&k.region) {
                r.keys.remove(&key);
            }
            if let Some(usage) = s.usage.get_mut(&k.owner_uid) {
                usage.sub(QuotaKind::Keys, 1);
            }
            Self::forget_idle_user(s, k.owner_uid);
        }
    }

    fn purge_expired(s: &mut State) {
        let now = SystemTime::now();
        let expired: Vec<KeyId> = s
            .keys
            .iter()
            .filter(|(_, k)| k.expires.is_some_and(|e| e <= now))
            .map(|(id, _)| *id)
            .collect();
        for key in expired {
            Self::remove_key(s, key);
        }
    }

    /// Attaches the region `token` grants to `session`.
    pub fn attach(
        &self,
        caller: &Caller,
        session: SessionId,
        token: &str,
    ) -> Result<Handout, EngineError> {
        if !keys::well_formed(token) {
            return Err(EngineError::InvalidArgument(format!(
                "not an access key: keys look like {}<64 hex digits>, as Region.Share returns them",
                keys::TOKEN_PREFIX
            )));
        }
        let digest = KeyDigest::of(token);
        // The pool's access list may need the caller's user and groups looked up: that is
        // done with the lock released, and the key looked up again afterwards.
        let pool = {
            let mut s = self.lock();
            let (region, _) = Self::key_grant(&mut s, caller, session, &digest)?;
            Arc::clone(&s.regions[&region].pool)
        };
        check_pool_access(&pool, caller)?;
        let mut s = self.lock();
        let (region_id, access) = Self::key_grant(&mut s, caller, session, &digest)?;
        // A key always grants the same region, so the pool checked above is this one's.
        let region = &s.regions[&region_id];
        if region.session == session {
            return Err(EngineError::InvalidArgument(format!(
                "region {region_id} belongs to this session already"
            )));
        }
        if region.attached.contains_key(&session) {
            return Err(EngineError::InvalidArgument(format!(
                "region {region_id} is attached to this session already"
            )));
        }
        let fd = match access {
            AttachMode::ReadWrite => region.mr.memory().fd().try_clone_to_owned(),
            AttachMode::ReadOnly => reopen_read_only(region.mr.memory().fd()),
        }
        .map_err(|e| EngineError::Io(format!("cannot hand out region {region_id}: {e}")))?;
        let size = region.size();
        s.regions
            .get_mut(&region_id)
            .expect("looked up above")
            .attached
            .insert(session, access);
        s.sessions
            .get_mut(&session)
            .expect("checked above")
            .attachments
            .insert(region_id, access);
        Ok(Handout {
            region: region_id,
            fd,
            size,
            access,
        })
    }

    /// The region and access a token's digest grants to `session` (the caller's own), with
    /// expired keys purged first.
    fn key_grant(
        s: &mut State,
        caller: &Caller,
        session: SessionId,
        digest: &KeyDigest,
    ) -> Result<(RegionId, AttachMode), EngineError> {
        Self::own_session(s, caller, session)?;
        Self::purge_expired(s);
        let invalid = || {
            not_authorized(
                "the access key is not valid (unknown, revoked, expired, or its region was freed)",
            )
        };
        let (region, access) = s
            .keys
            .values()
            .find(|k| k.digest.matches(digest))
            .map(|k| (k.region, k.access))
            .ok_or_else(invalid)?;
        if !s.regions.contains_key(&region) {
            return Err(invalid());
        }
        Ok((region, access))
    }

    /// Ends the caller's attachment of a region.
    pub fn detach(&self, caller: &Caller, id: RegionId) -> Result<(), EngineError> {
        let mut s = self.lock();
        let region = s
            .regions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("region {id}")))?;
        let session = region
            .attached
            .keys()
            .copied()
            .find(|sid| {
                s.sessions
                    .get(sid)
                    .is_some_and(|x| x.owner.bus_name == caller.bus_name)
            })
            .ok_or_else(|| {
                not_authorized(format!("region {id} is not attached to your session"))
            })?;
        s.regions
            .get_mut(&id)
            .expect("looked up")
            .attached
            .remove(&session);
        if let Some(x) = s.sessions.get_mut(&session) {
            x.attachments.remove(&id);
        }
        Ok(())
    }

    fn session_info(id: SessionId, session: &Session, s: &State) -> SessionInfo {
        SessionInfo {
            id,
            uid: session.owner.uid,
            bus_name: session.owner.bus_name.clone(),
            pid: session.owner.pid,
            created: session.created,
            regions: session.regions.iter().copied().collect(),
            attachments: session.attachments.iter().map(|(r, m)| (*r, *m)).collect(),
            registered_bytes: session
                .regions
                .iter()
                .filter_map(|r| s.regions.get(r))
                .map(Region::size)
                .sum(),
        }
    }

    /// Sessions the caller may see: its user's, or all for an administrator.
    pub fn sessions(&self, config: &Config, caller: &Caller) -> Vec<SessionInfo> {
        let admin = policy::is_admin(caller, config);
        let s = self.lock();
        s.sessions
            .iter()
            .filter(|(_, x)| admin || x.owner.uid == caller.uid)
            .map(|(id, x)| Self::session_info(*id, x, &s))
            .collect()
    }

    pub fn session(
        &self,
        config: &Config,
        caller: &Caller,
        id: SessionId,
    ) -> Result<SessionInfo, EngineError> {
        let admin = policy::is_admin(caller, config);
        let s = self.lock();
        let x = s
            .sessions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("session {id}")))?;
        if x.owner.uid != caller.uid && !admin {
            return Err(not_authorized(format!(
                "session {id} belongs to another user"
            )));
        }
        Ok(Self::session_info(id, x, &s))
    }

    fn region_info(id: RegionId, r: &Region, s: &State) -> RegionInfo {
        RegionInfo {
            id,
            session: r.session,
            owner_uid: r.owner_uid,
            pool: r.pool.name().to_owned(),
            device: r.pool.device.clone(),
            size: r.size(),
            requested: r.requested,
            keys: r
                .keys
                .iter()
                .filter_map(|k| s.keys.get(k).map(|key| (k, key)))
                .map(|(k, key)| KeyInfo {
                    id: *k,
                    region: id,
                    access: key.access,
                    expires: key.expires,
                    owner_uid: key.owner_uid,
                })
                .collect(),
            attachments: r.attached.iter().map(|(s, m)| (*s, *m)).collect(),
        }
    }

    fn may_see_region(s: &State, r: &Region, caller: &Caller, admin: bool) -> bool {
        admin
            || r.owner_uid == caller.uid
            || r.attached.keys().any(|sid| {
                s.sessions
                    .get(sid)
                    .is_some_and(|x| x.owner.uid == caller.uid)
            })
    }

    /// Regions the caller may see: its user's, those attached by its user, or all for an
    /// administrator.
    pub fn regions(&self, config: &Config, caller: &Caller) -> Vec<RegionInfo> {
        let admin = policy::is_admin(caller, config);
        let s = self.lock();
        s.regions
            .iter()
            .filter(|(_, r)| Self::may_see_region(&s, r, caller, admin))
            .map(|(id, r)| Self::region_info(*id, r, &s))
            .collect()
    }

    pub fn region(
        &self,
        config: &Config,
        caller: &Caller,
        id: RegionId,
    ) -> Result<RegionInfo, EngineError> {
        let admin = policy::is_admin(caller, config);
        let s = self.lock();
        let r = s
            .regions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("region {id}")))?;
        if !Self::may_see_region(&s, r, caller, admin) {
            return Err(not_authorized(format!(
                "region {id} belongs to another user"
            )));
        }
        Ok(Self::region_info(id, r, &s))
    }

    /// Creates a queue pair for `session` on `entry`'s device, within the `qps` quota.
    pub fn create_qp(
        &self,
        config: &Config,
        caller: &Caller,
        session: SessionId,
        entry: &DeviceEntry,
        options: QpOptions,
    ) -> Result<(QpId, Arc<QueuePairRecord>), EngineError> {
        let limits = quota::limits_for(config, caller.uid, &caller.gids);
        {
            let mut s = self.lock();
            Self::own_session(&mut s, caller, session)?;
            let usage = s.usage.entry(caller.uid).or_default();
            quota::check(&limits, usage, QuotaKind::Qps, 1)?;
            usage.add(QuotaKind::Qps, 1);
        }
        let unreserve =
            |registry: &Registry| registry.unreserve(caller.uid, &[(QuotaKind::Qps, 1)]);
        let record = match qp::create(entry, session, caller.uid, options) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                unreserve(self);
                return Err(e);
            }
        };
        let mut s = self.lock();
        if Self::own_session(&mut s, caller, session).is_err() {
            drop(s);
            unreserve(self);
            return Err(EngineError::NoSuchObject(format!(
                "session {session} (closed while the queue pair was made)"
            )));
        }
        s.last_qp += 1;
        let id = s.last_qp;
        s.sessions
            .get_mut(&session)
            .expect("checked above")
            .qps
            .insert(id);
        s.qps.insert(id, Arc::clone(&record));
        Ok((id, record))
    }

    /// A queue pair, if the caller's connection owns it.
    pub fn own_qp(&self, caller: &Caller, id: QpId) -> Result<Arc<QueuePairRecord>, EngineError> {
        let s = self.lock();
        let record = s
            .qps
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("queue pair {id}")))?;
        let owner = s
            .sessions
            .get(&record.session)
            .map(|x| x.owner.bus_name.as_str());
        if owner != Some(caller.bus_name.as_str()) {
            return Err(not_authorized(format!(
                "queue pair {id} belongs to another session; only its owner may use it"
            )));
        }
        Ok(Arc::clone(record))
    }

    /// Destroys a queue pair (its owner only); its windows go first.
    pub fn destroy_qp(&self, caller: &Caller, id: QpId) -> Result<(), EngineError> {
        self.own_qp(caller, id)?;
        let mut s = self.lock();
        let Some(record) = s.qps.remove(&id) else {
            return Err(EngineError::NoSuchObject(format!("queue pair {id}")));
        };
        if let Some(session) = s.sessions.get_mut(&record.session) {
            session.qps.remove(&id);
        }
        let mut garbage = Garbage::default();
        garbage.take_windows_of(&mut s, id, &record);
        if let Some(usage) = s.usage.get_mut(&record.owner_uid) {
            usage.sub(QuotaKind::Qps, 1);
        }
        Self::forget_idle_user(&mut s, record.owner_uid);
        garbage.qps.push(record);
        drop(s);
        self.release(&[id], garbage);
        Ok(())
    }

    /// Queue pairs the caller may see: its user's, or all for an administrator.
    pub fn qps(&self, config: &Config, caller: &Caller) -> Vec<(QpId, Arc<QueuePairRecord>)> {
        let admin = policy::is_admin(caller, config);
        self.lock()
            .qps
            .iter()
            .filter(|(_, q)| admin || q.owner_uid == caller.uid)
            .map(|(id, q)| (*id, Arc::clone(q)))
            .collect()
    }

    /// The registration of a region the caller's connection owns, and its device.
    pub fn own_region_mr(
        &self,
        caller: &Caller,
        id: RegionId,
    ) -> Result<(Arc<dyn MemoryRegion>, String), EngineError> {
        let s = self.lock();
        let r = Self::own_region(&s, caller, id)?;
        Ok((Arc::clone(&r.mr), r.pool.device.clone()))
    }

    /// Records a window bound over region `id` through `qp`, keeping the `exports` use
    /// reserved for it; returns the export id, or gives the window back if the region or
    /// QP went away meanwhile (the caller then gives the reservation back).
    pub fn add_export(
        &self,
        id: RegionId,
        qp: QpId,
        window: Arc<dyn crate::provider::MemoryWindow>,
    ) -> Result<ExportId, EngineError> {
        let mut s = self.lock();
        let record = s
            .qps
            .get(&qp)
            .cloned()
            .ok_or(EngineError::NoSuchObject(format!("queue pair {qp}")))?;
        s.last_export += 1;
        let export = s.last_export;
        let region = s
            .regions
            .get_mut(&id)
            .ok_or(EngineError::NoSuchObject(format!("region {id}")))?;
        region.exports.insert((qp, export));
        let mr = Arc::clone(&region.mr);
        lock(&record.exports).insert(
            export,
            Export {
                region: id,
                window,
                mr,
            },
        );
        Ok(export)
    }

    /// Removes an export of a region the caller owns; returns its QP's id and its window
    /// with what must outlive it (the caller invalidates the window, then drops it all: the
    /// QP may have been destroyed, and the region freed, meanwhile).
    pub fn remove_export(
        &self,
        caller: &Caller,
        id: RegionId,
        export: ExportId,
    ) -> Result<(QpId, TakenWindow), EngineError> {
        let mut s = self.lock();
        Self::own_region(&s, caller, id)?;
        let (qp, _) = *s.regions[&id]
            .exports
            .iter()
            .find(|(_, e)| *e == export)
            .ok_or(EngineError::NoSuchObject(format!(
                "export {export} of region {id}"
            )))?;
        let region = s.regions.get_mut(&id).expect("checked");
        region.exports.remove(&(qp, export));
        let uid = region.owner_uid;
        if let Some(usage) = s.usage.get_mut(&uid) {
            usage.sub(QuotaKind::Exports, 1);
        }
        Self::forget_idle_user(&mut s, uid);
        let taken = s
            .qps
            .get(&qp)
            .and_then(|r| {
                lock(&r.exports)
                    .remove(&export)
                    .map(|e| TakenWindow::new(e, r))
            })
            .ok_or(EngineError::NoSuchObject(format!(
                "export {export} (its queue pair is gone)"
            )))?;
        Ok((qp, taken))
    }

    /// What the session's QPs may touch: its own regions read-write, attached regions as
    /// their key allowed.
    pub fn session_rights(
        &self,
        session: SessionId,
    ) -> Option<super::datapath::validate::RegionRights> {
        use super::datapath::validate::RegionRight;
        let s = self.lock();
        let x = s.sessions.get(&session)?;
        let owned = x.regions.iter().map(|id| (*id, true));
        let attached = x
            .attachments
            .iter()
            .map(|(id, mode)| (*id, *mode == AttachMode::ReadWrite));
        Some(
            owned
                .chain(attached)
                .filter_map(|(id, writable)| {
                    let mr = Arc::clone(&s.regions.get(&id)?.mr);
                    Some((id, RegionRight { mr, writable }))
                })
                .collect(),
        )
    }

    /// The region's registration, for the data path (same visibility as `region`).
    pub fn region_mr(&self, id: RegionId) -> Option<Arc<dyn MemoryRegion>> {
        self.lock().regions.get(&id).map(|r| Arc::clone(&r.mr))
    }

    /// Limits and live use of `uid`: the caller's own, or anyone's for an administrator.
    pub fn quota(
        &self,
        config: &Config,
        caller: &Caller,
        uid: u32,
    ) -> Result<Vec<QuotaLine>, EngineError> {
        if uid != caller.uid && !policy::is_admin(caller, config) {
            return Err(not_authorized(
                "only administrators may read another user's quota",
            ));
        }
        let gids = if uid == caller.uid {
            caller.gids.clone()
        } else {
            quota::groups_of(uid)
        };
        let limits = quota::limits_for(config, uid, &gids);
        let usage = self.usage(uid);
        Ok(QuotaKind::ALL
            .iter()
            .map(|&kind| QuotaLine {
                kind,
                limit: limits.get(kind).value,
                used: usage.get(kind),
                source: limits.get(kind).source.clone(),
            })
            .collect())
    }
}

/// Pool ACL: everyone when the pool lists no users and no groups.
fn check_pool_access(pool: &Pool, caller: &Caller) -> Result<(), EngineError> {
    let c = &pool.config;
    if c.open_to_everyone() {
        return Ok(());
    }
    let user = quota::user_name(caller.uid);
    if policy::pool_admits(c, &user, &caller.gids) {
        return Ok(());
    }
    Err(not_authorized(format!(
        "user {user} may not use pool {:?} (allowed users: {}; groups: {})",
        pool.name(),
        if c.users.is_empty() {
            "none".into()
        } else {
            c.users.join(", ")
        },
        if c.groups.is_empty() {
            "none".into()
        } else {
            c.groups.join(", ")
        },
    )))
}

/// A new read-only open file description of the memfd: the kernel then refuses writable
/// shared mappings and writes through it.
fn reopen_read_only(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let path = format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd());
    let file = std::fs::OpenOptions::new().read(true).open(path)?;
    Ok(file.into())
}

impl From<PoolError> for EngineError {
    fn from(e: PoolError) -> Self {
        match e {
            PoolError::Exhausted { .. } => EngineError::PoolExhausted(e.to_string()),
            PoolError::TooLarge { .. } | PoolError::Empty => {
                EngineError::InvalidArgument(e.to_string())
            }
            PoolError::Memory { .. } => EngineError::Io(e.to_string()),
            PoolError::Provider(p) => EngineError::Provider(p),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProviderChoice;
    use crate::engine::Engine;
    use nix::sys::uio::{pread, pwrite};
    use std::path::PathBuf;

    /// One body, two tests: `NAME` on loopback, `rxe_NAME` on rxe0 (VM tier).
    macro_rules! on_both_providers {
        ($($name:ident / $rxe:ident),* $(,)?) => {$(
            #[test]
            fn $rxe() {
                bodies::$name(ProviderChoice::Verbs)
            }
            #[test]
            fn $name() {
                bodies::$name(ProviderChoice::Loopback)
            }
        )*};
    }

    on_both_providers!(
        the_client_descriptor_and_the_registration_share_bytes
            / rxe_the_client_descriptor_and_the_registration_share_bytes,
        memory_once_exposed_is_never_handed_to_another_owner
            / rxe_memory_once_exposed_is_never_handed_to_another_owner,
        concurrent_requests_never_overshoot_a_quota
            / rxe_concurrent_requests_never_overshoot_a_quota,
        closing_a_session_releases_everything_it_held
            / rxe_closing_a_session_releases_everything_it_held,
        read_only_keys_give_read_only_descriptors / rxe_read_only_keys_give_read_only_descriptors,
        expired_keys_do_not_attach / rxe_expired_keys_do_not_attach,
        other_connections_cannot_use_a_session / rxe_other_connections_cannot_use_a_session,
        pool_acl_is_enforced / rxe_pool_acl_is_enforced,
    );

    fn engine_on(provider: ProviderChoice, text: &str) -> (Engine, Config) {
        let config = Config::parse(std::path::Path::new("t.toml"), text).unwrap();
        let engine =
            Engine::start(config.clone(), PathBuf::from("/dev/null"), Some(provider)).unwrap();
        (engine, config)
    }

    fn caller(uid: u32, bus: &str) -> Caller {
        Caller {
            bus_name: bus.to_owned(),
            uid,
            gids: vec![uid],
            pid: None,
        }
    }

    /// A session whose connection left counts as a session until everything it held is
    /// released, so that an observer who sees the count drop (`ObjectCounts`, tests waiting
    /// for a killed client's session to go) also sees its queue pairs and memory released.
    #[test]
    fn a_closing_session_counts_until_its_objects_are_released() {
        use crate::engine::qp::QpOptions;
        let (engine, config) = engine_on(ProviderChoice::Loopback, COLD_POOL);
        let engine = Arc::new(engine);
        let pool = Arc::clone(engine.pool("p").unwrap());
        let device = Arc::clone(&engine.devices()[0].device);
        let baseline = device.object_counts();
        for round in 0..100 {
            let alice = caller(1000, ":1.1");
            let s = engine.registry.open_session(&config, &alice).unwrap();
            engine
                .create_qp(&alice, s, "loopback0", QpOptions::default())
                .unwrap();
            engine
                .registry
                .allocate(&config, &alice, s, &pool, 4096)
                .unwrap();
            let closer = {
                let engine = Arc::clone(&engine);
                std::thread::spawn(move || engine.registry.close_sessions_of(":1.1"))
            };
            while engine.registry.counts().0 != 0 {
                std::hint::spin_loop();
            }
            assert_eq!(device.object_counts(), baseline, "round {round}");
            assert_eq!(pool.stats().used, 0, "round {round}");
            closer.join().unwrap();
        }
    }

    /// Every registry call that needs a user or group lookup — pool access lists, the
    /// administrators' group, another user's groups — makes it with the registry's lock
    /// released: NSS may block on a directory server, and under the lock one slow lookup
    /// would stall every tenant. Debug builds fail any lookup made under the lock
    /// (`policy::lookups`), so each call here would panic if one still did.
    #[test]
    fn user_and_group_lookups_never_run_under_the_registry_lock() {
        let (engine, config) = engine_on(
            ProviderChoice::Loopback,
            "[daemon]\nadmin_group = \"root\"\n\n[[pool]]\nname = \"acl\"\n\
             capacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\nusers = [\"root\"]\n\
             groups = [\"root\"]\n",
        );
        let pool = Arc::clone(engine.pool("acl").unwrap());
        let root = caller(0, ":1.0");
        // Not root, but in the administrators' group (and the pool's).
        let carol = Caller {
            gids: vec![0],
            ..caller(1002, ":1.3")
        };
        let owner = engine.registry.open_session(&config, &root).unwrap();
        let region = engine
            .registry
            .allocate(&config, &root, owner, &pool, 4096)
            .unwrap()
            .region;
        let (token, key) = engine
            .registry
            .share(&config, &root, region, AttachMode::ReadOnly, None)
            .unwrap();
        let attacher = engine.registry.open_session(&config, &carol).unwrap();
        let handout = engine.registry.attach(&carol, attacher, &token).unwrap();
        assert_eq!(handout.region, region, "the pool's group lets carol attach");
        assert_eq!(
            engine.registry.session(&config, &carol, owner).unwrap().uid,
            0,
            "an administrator reads another user's session"
        );
        engine.registry.quota(&config, &carol, 0).unwrap();
        engine.registry.revoke(&config, &carol, key).unwrap();
        let removed = engine
            .registry
            .close_session(&config, &carol, owner)
            .unwrap();
        assert_eq!(removed.regions, vec![region]);
    }

    /// Two queue pairs of `session` on loopback0, connected to each other.
    fn connected_pair(engine: &Engine, owner: &Caller, session: SessionId) -> [QpId; 2] {
        use crate::engine::qp::QpOptions;
        use crate::provider::RemoteEndpoint;
        let device = &engine.devices()[0].device;
        let qps = [0, 1].map(|_| {
            engine
                .create_qp(owner, session, "loopback0", QpOptions::default())
                .unwrap()
                .0
        });
        for (me, peer) in [(qps[0], qps[1]), (qps[1], qps[0])] {
            let peer = engine.registry.own_qp(owner, peer).unwrap();
            let remote = RemoteEndpoint {
                gid: peer.local.gid,
                qp_num: peer.local.qp_num,
                psn: peer.local.psn,
                lid: peer.local.lid,
            };
            let record = engine.registry.own_qp(owner, me).unwrap();
            record.connect(device.as_ref(), remote).unwrap();
        }
        qps
    }

    /// Exports are charged to their owner's `exports` quota, one per window: a second
    /// export of the same region through the same QP is a window of its own. Releasing,
    /// freeing the region, destroying the QP and closing the session each give the use
    /// back, and another user's exports are not affected.
    #[test]
    fn exports_are_a_quota_given_back_by_every_release() {
        use crate::provider::Access;
        let (engine, config) = engine_on(
            ProviderChoice::Loopback,
            &format!("{COLD_POOL}[quota.default]\nexports = 2\n"),
        );
        let pool = Arc::clone(engine.pool("p").unwrap());
        let device = Arc::clone(&engine.devices()[0].device);
        let exports = |uid| engine.registry.usage(uid).get(QuotaKind::Exports);
        let alice = caller(1000, ":1.1");
        let bob = caller(1001, ":1.2");
        let s = engine.registry.open_session(&config, &alice).unwrap();
        let qps = connected_pair(&engine, &alice, s);
        let region = || {
            engine
                .registry
                .allocate(&config, &alice, s, &pool, 4096)
                .unwrap()
                .region
        };
        let r = region();
        let mws = device.object_counts().mws;

        let (first, _, rkey1, _) = engine
            .export_remote(&alice, r, qps[0], Access::REMOTE_WRITE)
            .unwrap();
        let (second, _, rkey2, _) = engine
            .export_remote(&alice, r, qps[0], Access::REMOTE_WRITE)
            .unwrap();
        assert_ne!(first, second, "a second export is an export of its own");
        assert_ne!(rkey1, rkey2, "with a window and an rkey of its own");
        assert_eq!(device.object_counts().mws, mws + 2);
        assert_eq!(exports(1000), 2);
        let refused = engine
            .export_remote(&alice, r, qps[1], Access::REMOTE_READ)
            .unwrap_err();
        assert!(matches!(refused, EngineError::Quota(_)), "{refused}");
        assert!(
            refused
                .to_string()
                .starts_with("quota exceeded: exports (memory windows) of user"),
            "{refused}"
        );
        assert!(
            refused
                .to_string()
                .contains("2 in use, 1 more requested, limit 2 (set by quota.default.exports)"),
            "{refused}"
        );
        assert_eq!(exports(1000), 2, "a refusal charges nothing");
        assert_eq!(
            device.object_counts().mws,
            mws + 2,
            "nor binds a window before the check"
        );

        // Another user exports as before.
        let sb = engine.registry.open_session(&config, &bob).unwrap();
        let bob_qps = connected_pair(&engine, &bob, sb);
        let rb = engine
            .registry
            .allocate(&config, &bob, sb, &pool, 4096)
            .unwrap()
            .region;
        engine
            .export_remote(&bob, rb, bob_qps[0], Access::REMOTE_WRITE)
            .unwrap();
        assert_eq!(exports(1001), 1);

        // ReleaseExport gives one back.
        engine.release_export(&alice, r, first).unwrap();
        assert_eq!(exports(1000), 1);
        // Freeing the region gives back what was exported over it.
        engine
            .export_remote(&alice, r, qps[1], Access::REMOTE_READ)
            .unwrap();
        assert_eq!(exports(1000), 2);
        engine.registry.free(&alice, r).unwrap();
        assert_eq!(exports(1000), 0);
        // Destroying the QP gives back what was exported through it; the region stays.
        let r = region();
        let (through_destroyed, ..) = engine
            .export_remote(&alice, r, qps[0], Access::REMOTE_WRITE)
            .unwrap();
        engine
            .export_remote(&alice, r, qps[1], Access::REMOTE_WRITE)
            .unwrap();
        engine.registry.destroy_qp(&alice, qps[0]).unwrap();
        assert_eq!(exports(1000), 1);
        assert!(
            matches!(
                engine.release_export(&alice, r, through_destroyed),
                Err(EngineError::NoSuchObject(_))
            ),
            "an export of a destroyed QP is gone"
        );
        assert_eq!(exports(1000), 1, "and gives nothing back twice");
        // Closing the session gives back the rest.
        engine.registry.close_sessions_of(":1.1");
        assert_eq!(exports(1000), 0);
        assert!(engine.registry.usage(1000).is_zero());
        assert_eq!(exports(1001), 1, "bob's export is untouched");
        engine.registry.close_sessions_of(":1.2");
        assert_eq!(device.object_counts().mws, mws);
    }

    /// A window taken out of its queue pair (by `ReleaseExport`, or with a freed region)
    /// keeps that queue pair alive until the window is dropped, even if the queue pair is
    /// destroyed meanwhile: a QP destroyed with a type-2 window still bound blocks rxe for
    /// ~50 s. Found by rdmad-fuzz-dbus (`Free` or `ReleaseExport` racing `Destroy`: the
    /// loopback device's warning about it).
    #[test]
    fn windows_taken_out_keep_their_queue_pair_until_dropped() {
        use crate::provider::Access;
        let (engine, config) = engine_on(ProviderChoice::Loopback, COLD_POOL);
        let pool = Arc::clone(engine.pool("p").unwrap());
        let device = Arc::clone(&engine.devices()[0].device);
        let alice = caller(1000, ":1.1");
        let s = engine.registry.open_session(&config, &alice).unwrap();
        let qps = connected_pair(&engine, &alice, s);
        let qps_alive = || device.object_counts().qps;
        assert_eq!(qps_alive(), 2);

        // ReleaseExport: the window is handed out, the QP destroyed before it is dropped.
        let region = engine
            .registry
            .allocate(&config, &alice, s, &pool, 4096)
            .unwrap()
            .region;
        let (export, ..) = engine
            .export_remote(&alice, region, qps[0], Access::REMOTE_WRITE)
            .unwrap();
        let (_, taken) = engine
            .registry
            .remove_export(&alice, region, export)
            .unwrap();
        engine.registry.destroy_qp(&alice, qps[0]).unwrap();
        assert_eq!(
            qps_alive(),
            2,
            "the QP outlives the window bound through it"
        );
        drop(taken);
        assert_eq!(qps_alive(), 1);

        // A freed region: its windows go with the garbage, the QP destroyed meanwhile.
        engine
            .export_remote(&alice, region, qps[1], Access::REMOTE_READ)
            .unwrap();
        let garbage = Registry::remove_region(&mut engine.registry.lock(), region).unwrap();
        engine.registry.destroy_qp(&alice, qps[1]).unwrap();
        assert_eq!(
            qps_alive(),
            1,
            "the QP outlives the window bound through it"
        );
        engine.registry.release(&[], garbage);
        assert_eq!(qps_alive(), 0);
        assert_eq!(device.object_counts().mws, 0);
    }

    /// A queue pair made on the device directly, served by no data-path worker, with a
    /// registered buffer: the remote peer of a session's queue pair.
    struct Peer {
        // Field order is drop order.
        qp: Arc<dyn crate::provider::QueuePair>,
        cq: Arc<dyn crate::provider::CompletionQueue>,
        mr: Arc<dyn MemoryRegion>,
    }

    impl Peer {
        /// Connects a new peer and `record` to each other.
        fn connect_to(entry: &DeviceEntry, record: &QueuePairRecord) -> Peer {
            use crate::memory::SharedMemory;
            use crate::provider::{Access, QpInit, RemoteEndpoint, RtrAttributes, RtsAttributes};
            let cq = entry.pd.create_cq(16).unwrap();
            let qp = entry
                .pd
                .create_qp(QpInit {
                    send_cq: Arc::clone(&cq),
                    recv_cq: Arc::clone(&cq),
                    max_send_wr: 8,
                    max_recv_wr: 8,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 0,
                })
                .unwrap();
            let memory = Arc::new(SharedMemory::create(c"peer", 4096).unwrap());
            let mr = entry.pd.register(memory, Access::LOCAL_WRITE).unwrap();
            let psn = 0x1234;
            record
                .connect(
                    entry.device.as_ref(),
                    RemoteEndpoint {
                        gid: record.local.gid,
                        qp_num: qp.qp_num(),
                        psn,
                        lid: record.local.lid,
                    },
                )
                .unwrap();
            qp.to_init(record.local.port, Access::LOCAL_WRITE).unwrap();
            qp.to_rtr(
                &RemoteEndpoint {
                    gid: record.local.gid,
                    qp_num: record.local.qp_num,
                    psn: record.local.psn,
                    lid: record.local.lid,
                },
                &RtrAttributes {
                    port: record.local.port,
                    sgid_index: record.local.gid_index,
                    path_mtu: record.local.mtu,
                    max_dest_rd_atomic: 1,
                    min_rnr_timer: 12,
                },
            )
            .unwrap();
            qp.to_rts(&RtsAttributes {
                psn,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                max_rd_atomic: 1,
            })
            .unwrap();
            Peer { qp, cq, mr }
        }

        /// RDMA WRITEs 8 bytes to `addr` through `rkey`; returns how the device answered.
        fn write(&self, addr: u64, rkey: u32) -> crate::provider::WcStatus {
            use crate::provider::{SendOp, SendWr, Sge};
            self.qp
                .post_send(&[SendWr {
                    wr_id: 1,
                    op: SendOp::Write {
                        remote_addr: addr,
                        rkey,
                        imm: None,
                    },
                    sges: vec![Sge {
                        addr: self.mr.addr(),
                        length: 8,
                        lkey: self.mr.lkey(),
                    }],
                    signaled: true,
                }])
                .unwrap();
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let mut wcs = Vec::new();
            while wcs.is_empty() {
                assert!(std::time::Instant::now() < deadline, "no completion");
                self.cq.poll(&mut wcs, 1).unwrap();
            }
            wcs[0].status
        }
    }

    /// On every path that ends an export's window — ReleaseExport, freeing the region,
    /// destroying the queue pair, closing the session (its client died), closing every
    /// session (shutdown) — the window is deallocated before the region's registration is
    /// dropped, even while the queue pair it was bound through is still held elsewhere, as
    /// by a data-path worker that did not let go of it in time. The peer's old rkey gets a
    /// remote access error at once, the registration is really deregistered (nothing
    /// lingers: the loopback device, like rxe, refuses to deregister an MR with a bound
    /// window), and once the queue pair is let go of, nothing is left.
    #[test]
    fn windows_go_before_their_memory_on_every_path() {
        use crate::engine::qp::QpOptions;
        use crate::provider::{Access, WcStatus};
        let (engine, config) = engine_on(ProviderChoice::Loopback, COLD_POOL);
        let pool = Arc::clone(engine.pool("p").unwrap());
        let entry = &engine.devices()[0];
        let device = Arc::clone(&entry.device);
        let alice = caller(1000, ":1.1");
        let baseline = device.object_counts();
        for path in ["release", "free", "destroy", "close", "close all"] {
            let s = engine.registry.open_session(&config, &alice).unwrap();
            let (qp, record) = engine
                .create_qp(&alice, s, "loopback0", QpOptions::default())
                .unwrap();
            let peer = Peer::connect_to(entry, &record);
            let region = engine
                .registry
                .allocate(&config, &alice, s, &pool, 4096)
                .unwrap()
                .region;
            let (export, addr, rkey, _) = engine
                .export_remote(&alice, region, qp, Access::REMOTE_WRITE)
                .unwrap();
            assert_eq!(peer.write(addr, rkey), WcStatus::Success, "{path}");
            let with_region = device.object_counts();
            match path {
                "release" => engine.release_export(&alice, region, export).unwrap(),
                "free" => engine.registry.free(&alice, region).unwrap(),
                "destroy" => engine.registry.destroy_qp(&alice, qp).unwrap(),
                "close" => assert_eq!(engine.registry.close_sessions_of(":1.1").sessions, [s]),
                _ => assert_eq!(engine.registry.close_all().sessions, [s]),
            }
            let now = device.object_counts();
            assert_eq!(now.mws, baseline.mws, "{path}: the window is gone");
            assert!(
                engine.lingering().is_empty(),
                "{path}: {:?}",
                engine.lingering()
            );
            let region_gone = matches!(path, "free" | "close" | "close all");
            assert_eq!(
                now.mrs,
                with_region.mrs - u64::from(region_gone),
                "{path}: the region's registration is deregistered with it"
            );
            assert_eq!(
                now.qps, with_region.qps,
                "{path}: the queue pair is still held (by `record`, as by a slow worker)"
            );
            assert_eq!(
                peer.write(addr, rkey),
                WcStatus::RemoteAccessError,
                "{path}: the old rkey"
            );
            drop(record);
            drop(peer);
            engine.registry.close_sessions_of(":1.1");
            assert_eq!(device.object_counts(), baseline, "{path}: nothing is left");
        }
    }

    /// What a device refuses to destroy is not dropped on the floor: a registration whose
    /// deregistration failed (here: a window still bound over it, which the registry never
    /// lets happen by itself) is kept, counted, shown in the status line, and retried after
    /// every teardown until the device accepts.
    #[test]
    fn a_refused_deregistration_lingers_and_is_retried() {
        use crate::engine::qp::QpOptions;
        use crate::provider::{Access, ObjectKind, WcStatus};
        let (engine, config) = engine_on(ProviderChoice::Loopback, COLD_POOL);
        let pool = Arc::clone(engine.pool("p").unwrap());
        let entry = &engine.devices()[0];
        let device = Arc::clone(&entry.device);
        let alice = caller(1000, ":1.1");
        let baseline = device.object_counts();
        let s = engine.registry.open_session(&config, &alice).unwrap();
        let (qp, record) = engine
            .create_qp(&alice, s, "loopback0", QpOptions::default())
            .unwrap();
        let peer = Peer::connect_to(entry, &record);
        let region = engine
            .registry
            .allocate(&config, &alice, s, &pool, 4096)
            .unwrap()
            .region;
        let (export, addr, rkey, _) = engine
            .export_remote(&alice, region, qp, Access::REMOTE_WRITE)
            .unwrap();
        // Keep the window, let go of the registration it is bound over, free the region.
        let (_, taken) = engine
            .registry
            .remove_export(&alice, region, export)
            .unwrap();
        let TakenWindow {
            window,
            bound_through,
            over,
        } = taken;
        drop(over);
        engine.registry.free(&alice, region).unwrap();
        let lingering = engine.lingering();
        assert_eq!(lingering.len(), 1, "{lingering:?}");
        let (name, l) = &lingering[0];
        assert_eq!(
            (name.as_str(), l.kind, l.len),
            ("loopback0", ObjectKind::Mr, 4096)
        );
        assert!(l.error.contains("ibv_dereg_mr"), "{}", l.error);
        assert_eq!(
            l.attempts, 2,
            "refused on the free, and by the retry after it"
        );
        assert!(
            engine
                .status_line()
                .contains("1 object the device refused to destroy"),
            "{}",
            engine.status_line()
        );
        assert_eq!(
            peer.write(addr, rkey),
            WcStatus::Success,
            "as on rxe, the window still works while the registration stays"
        );
        assert_eq!(engine.retry_lingering(), 1, "still refused");
        assert_eq!(engine.lingering()[0].1.attempts, 3);

        drop(window);
        drop(bound_through);
        drop(peer);
        drop(record);
        // The next teardown retries: the registration goes.
        engine.registry.close_sessions_of(":1.1");
        assert!(engine.lingering().is_empty());
        assert_eq!(device.object_counts(), baseline);
    }

    const POOL: &str = "[[pool]]\nname = \"p\"\ncapacity = \"64MiB\"\n\
                        size_classes = [\"4KiB\", \"1MiB\"]\nwarm = 2\n";

    /// Without warm regions nothing happens in the background, so counts are exact.
    const COLD_POOL: &str = "[[pool]]\nname = \"p\"\ncapacity = \"64MiB\"\n\
                             size_classes = [\"4KiB\", \"1MiB\"]\n";

    mod bodies {
        use super::*;

        pub fn the_client_descriptor_and_the_registration_share_bytes(provider: ProviderChoice) {
            let (engine, config) = engine_on(provider, POOL);
            let alice = caller(1000, ":1.1");
            let s = engine.registry.open_session(&config, &alice).unwrap();
            let pool = Arc::clone(engine.pool("p").unwrap());
            let h = engine
                .registry
                .allocate(&config, &alice, s, &pool, 100)
                .unwrap();
            assert_eq!(h.size, 4096);
            pwrite(&h.fd, b"from the client", 10).unwrap();
            let mr = engine.registry.region_mr(h.region).unwrap();
            let mut seen = [0u8; 15];
            mr.memory().read_at(10, &mut seen).unwrap();
            assert_eq!(
                &seen, b"from the client",
                "the device's view is the client's bytes"
            );
            mr.memory().write_at(0, b"from the device").unwrap();
            let mut buf = [0u8; 15];
            pread(&h.fd, &mut buf, 0).unwrap();
            assert_eq!(&buf, b"from the device");
        }

        pub fn memory_once_exposed_is_never_handed_to_another_owner(provider: ProviderChoice) {
            let (engine, config) = engine_on(provider, POOL);
            let pool = Arc::clone(engine.pool("p").unwrap());
            let alice = caller(1000, ":1.1");
            let bob = caller(1001, ":1.2");
            let sa = engine.registry.open_session(&config, &alice).unwrap();
            let sb = engine.registry.open_session(&config, &bob).unwrap();
            let kept = engine
                .registry
                .allocate(&config, &alice, sa, &pool, 4096)
                .unwrap();
            pwrite(&kept.fd, b"alice's secret", 0).unwrap();
            let kept_inode = nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&kept.fd))
                .unwrap()
                .st_ino;
            engine.registry.free(&alice, kept.region).unwrap();

            for _ in 0..20 {
                let h = engine
                    .registry
                    .allocate(&config, &bob, sb, &pool, 4096)
                    .unwrap();
                assert_ne!(
                    nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&h.fd))
                        .unwrap()
                        .st_ino,
                    kept_inode
                );
                let mut buf = [0xffu8; 4096];
                pread(&h.fd, &mut buf, 0).unwrap();
                assert!(buf.iter().all(|&b| b == 0), "new regions read as zero");
                pwrite(&h.fd, b"bob's data", 0).unwrap();
                // The freed region's pages went back at once; the kept fd reads zeros,
                // never the next owner's bytes.
                let mut old = [0xffu8; 14];
                pread(&kept.fd, &mut old, 0).unwrap();
                assert_eq!(old, [0u8; 14], "the kept fd never sees the next owner");
                engine.registry.free(&bob, h.region).unwrap();
            }
        }

        pub fn concurrent_requests_never_overshoot_a_quota(provider: ProviderChoice) {
            let (engine, config) =
                engine_on(provider, &format!("{POOL}[quota.default]\nregions = 10\n"));
            let engine = Arc::new(engine);
            let alice = caller(1000, ":1.1");
            let s = engine.registry.open_session(&config, &alice).unwrap();
            let pool = Arc::clone(engine.pool("p").unwrap());
            let results: Vec<bool> = std::thread::scope(|scope| {
                let handles: Vec<_> = (0..64)
                    .map(|_| {
                        let (engine, config, alice, pool) = (&engine, &config, &alice, &pool);
                        scope.spawn(move || {
                            engine
                                .registry
                                .allocate(config, alice, s, pool, 4096)
                                .is_ok()
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(results.iter().filter(|ok| **ok).count(), 10);
            assert_eq!(engine.registry.usage(1000).get(QuotaKind::Regions), 10);
            let err = engine
                .registry
                .allocate(&config, &alice, s, &pool, 4096)
                .unwrap_err();
            assert!(matches!(err, EngineError::Quota(_)), "{err}");
        }

        pub fn closing_a_session_releases_everything_it_held(provider: ProviderChoice) {
            let (engine, config) = engine_on(provider, COLD_POOL);
            let pool = Arc::clone(engine.pool("p").unwrap());
            let device = Arc::clone(&engine.devices()[0].device);
            let alice = caller(1000, ":1.1");
            let bob = caller(1001, ":1.2");
            let sb = engine.registry.open_session(&config, &bob).unwrap();
            let before = (pool.stats().used, engine.registry.counts());
            let mrs_before = device.object_counts().mrs;

            let sa = engine.registry.open_session(&config, &alice).unwrap();
            let a = engine
                .registry
                .allocate(&config, &alice, sa, &pool, 1 << 20)
                .unwrap();
            engine
                .registry
                .allocate(&config, &alice, sa, &pool, 100)
                .unwrap();
            let (token, _) = engine
                .registry
                .share(&config, &alice, a.region, AttachMode::ReadWrite, None)
                .unwrap();
            engine.registry.attach(&bob, sb, &token).unwrap();

            let removed = engine.registry.close_sessions_of(":1.1");
            assert_eq!(removed.sessions, vec![sa]);
            assert_eq!(removed.regions.len(), 2);
            assert_eq!((pool.stats().used, engine.registry.counts()), before);
            assert!(engine.registry.usage(1000).is_zero());
            assert!(engine
                .registry
                .session(&config, &bob, sb)
                .unwrap()
                .attachments
                .is_empty());
            assert_eq!(
                device.object_counts().mrs,
                mrs_before,
                "every region deregistered"
            );
            assert!(
                engine.registry.attach(&bob, sb, &token).is_err(),
                "keys die with the region"
            );
        }

        pub fn read_only_keys_give_read_only_descriptors(provider: ProviderChoice) {
            let (engine, config) = engine_on(provider, POOL);
            let pool = Arc::clone(engine.pool("p").unwrap());
            let alice = caller(1000, ":1.1");
            let bob = caller(1001, ":1.2");
            let sa = engine.registry.open_session(&config, &alice).unwrap();
            let sb = engine.registry.open_session(&config, &bob).unwrap();
            let a = engine
                .registry
                .allocate(&config, &alice, sa, &pool, 4096)
                .unwrap();
            let (token, key) = engine
                .registry
                .share(&config, &alice, a.region, AttachMode::ReadOnly, None)
                .unwrap();
            let h = engine.registry.attach(&bob, sb, &token).unwrap();
            assert_eq!(h.access, AttachMode::ReadOnly);
            let flags = nix::fcntl::fcntl(
                std::os::fd::AsRawFd::as_raw_fd(&h.fd),
                nix::fcntl::FcntlArg::F_GETFL,
            )
            .unwrap();
            assert_eq!(flags & libc::O_ACCMODE, libc::O_RDONLY);
            assert!(
                pwrite(&h.fd, b"x", 0).is_err(),
                "writes through a read-only attachment fail"
            );

            // Bob cannot share, free or revoke what he only attached.
            assert!(matches!(
                engine
                    .registry
                    .share(&config, &bob, a.region, AttachMode::ReadWrite, None),
                Err(EngineError::NotAuthorized(_))
            ));
            assert!(matches!(
                engine.registry.free(&bob, a.region),
                Err(EngineError::NotAuthorized(_))
            ));
            assert!(matches!(
                engine.registry.revoke(&config, &bob, key),
                Err(EngineError::NotAuthorized(_))
            ));

            engine.registry.revoke(&config, &alice, key).unwrap();
            let carol_session = engine
                .registry
                .open_session(&config, &caller(1002, ":1.3"))
                .unwrap();
            assert!(matches!(
                engine
                    .registry
                    .attach(&caller(1002, ":1.3"), carol_session, &token),
                Err(EngineError::NotAuthorized(_))
            ));
            let rights = engine.registry.session_rights(sb).unwrap();
            assert!(
                !rights[&a.region].writable,
                "a read-only attachment is only a source"
            );
            assert!(engine.registry.session_rights(sa).unwrap()[&a.region].writable);
            // The live attachment stays after revocation.
            assert_eq!(
                engine
                    .registry
                    .session(&config, &bob, sb)
                    .unwrap()
                    .attachments
                    .len(),
                1
            );
        }

        pub fn expired_keys_do_not_attach(provider: ProviderChoice) {
            let (engine, config) = engine_on(provider, POOL);
            let pool = Arc::clone(engine.pool("p").unwrap());
            let alice = caller(1000, ":1.1");
            let bob = caller(1001, ":1.2");
            let sa = engine.registry.open_session(&config, &alice).unwrap();
            let sb = engine.registry.open_session(&config, &bob).unwrap();
            let a = engine
                .registry
                .allocate(&config, &alice, sa, &pool, 4096)
                .unwrap();
            let (token, _) = engine
                .registry
                .share(
                    &config,
                    &alice,
                    a.region,
                    AttachMode::ReadWrite,
                    Some(Duration::ZERO),
                )
                .unwrap();
            assert!(matches!(
                engine.registry.attach(&bob, sb, &token),
                Err(EngineError::NotAuthorized(_))
            ));
            assert_eq!(
                engine.registry.usage(1000).get(QuotaKind::Keys),
                0,
                "expired keys are purged"
            );
        }

        pub fn other_connections_cannot_use_a_session(provider: ProviderChoice) {
            let (engine, config) = engine_on(provider, POOL);
            let pool = Arc::clone(engine.pool("p").unwrap());
            let alice = caller(1000, ":1.1");
            let alice_elsewhere = caller(1000, ":1.9");
            let mallory = caller(1666, ":1.6");
            let s = engine.registry.open_session(&config, &alice).unwrap();
            for intruder in [&alice_elsewhere, &mallory] {
                assert!(matches!(
                    engine.registry.allocate(&config, intruder, s, &pool, 4096),
                    Err(EngineError::NotAuthorized(_))
                ));
            }
            assert!(matches!(
                engine.registry.close_session(&config, &mallory, s),
                Err(EngineError::NotAuthorized(_))
            ));
            assert!(engine.registry.sessions(&config, &mallory).is_empty());
            assert_eq!(
                engine.registry.sessions(&config, &caller(0, ":1.0")).len(),
                1,
                "admins see all"
            );
            assert!(matches!(
                engine.registry.quota(&config, &mallory, 1000),
                Err(EngineError::NotAuthorized(_))
            ));
            engine
                .registry
                .close_session(&config, &alice_elsewhere, s)
                .unwrap();
        }

        pub fn pool_acl_is_enforced(provider: ProviderChoice) {
            let (engine, config) = engine_on(provider,
            "[[pool]]\nname = \"rootonly\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\nusers = [\"root\"]\n",
        );
            let pool = Arc::clone(engine.pool("rootonly").unwrap());
            let nobody = caller(65534, ":1.5");
            let s = engine.registry.open_session(&config, &nobody).unwrap();
            let err = engine
                .registry
                .allocate(&config, &nobody, s, &pool, 4096)
                .unwrap_err();
            assert_eq!(
                err.to_string(),
                "user nobody may not use pool \"rootonly\" (allowed users: root; groups: none)"
            );
            assert!(engine.registry.usage(65534).get(QuotaKind::Regions) == 0);
            let root = caller(0, ":1.0");
            let s = engine.registry.open_session(&config, &root).unwrap();
            engine
                .registry
                .allocate(&config, &root, s, &pool, 4096)
                .unwrap();
        }
    }
}
