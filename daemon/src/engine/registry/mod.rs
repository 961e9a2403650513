//! Sessions, regions and access keys, and who owns what. Every session's resources are
//! released as one unit; quota usage is reserved under the same lock that checks it, so
//! concurrent requests never overshoot.

mod queue_pairs;
mod regions;
mod registrations;
mod sessions;
mod sharing;
#[cfg(test)]
mod tests;
mod views;

pub use views::{KeyInfo, QuotaLine, RegionInfo, SessionInfo};

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use super::datapath::rights::SessionRights;
use super::pool::Pool;
use super::qp::{self, Export, ExportId, QpId, QpOptions, QueuePairRecord};
use super::tenancy::{self, Limits, Owner, PoolAccess, Scope, Usage};
use super::token::{self, KeyDigest};
use super::DeviceEntry;
use super::EngineError;
use crate::config::QuotaKind;
use crate::lock::lock;
use crate::provider::{MemoryRegion, ProtectionDomain};

pub use crate::engine::ids::{DomainId, KeyId, RegionId, RegistrationId, SessionId};
pub use registrations::RegistrationHandout;

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
    owner: Owner,
    created: SystemTime,
    regions: BTreeSet<RegionId>,
    attachments: BTreeMap<RegionId, AttachMode>,
    qps: BTreeSet<QpId>,
    /// Its own protection domains, by device and the number the session calls each by.
    domains: BTreeMap<(String, u32), Domain>,
    /// What its queue pairs may touch, as their worker sees it (kept up to date by
    /// [`Registry::refresh_rights`]).
    rights: Arc<SessionRights>,
}

/// A protection domain of a session's own (verbs programs get one per `ibv_alloc_pd`):
/// registrations in it carry remote rights of their own, reachable only through queue
/// pairs in it. It lives while a registration or queue pair is in it (or one is being
/// made), and goes with the last.
#[derive(Debug)]
struct Domain {
    id: DomainId,
    pd: Arc<dyn ProtectionDomain>,
    /// Registrations and queue pairs in it, and those being made.
    users: usize,
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
    /// Its registrations in its session's own protection domains.
    registrations: BTreeSet<RegistrationId>,
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
    registrations: BTreeMap<RegistrationId, registrations::Registration>,
    usage: HashMap<u32, Usage>,
    last_session: SessionId,
    last_region: RegionId,
    last_key: KeyId,
    last_qp: QpId,
    last_export: ExportId,
    last_registration: RegistrationId,
    last_domain: DomainId,
    /// Sessions taken out of the registry whose objects are still being released (see
    /// [`Releasing`]).
    releasing: usize,
    /// How many times a session's rights were rebuilt.
    #[cfg(test)]
    rights_rebuilt: std::sync::atomic::AtomicUsize,
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
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "held only to be dropped after the window")
    )]
    bound_through: Arc<QueuePairRecord>,
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "held only to be dropped after the window")
    )]
    over: Arc<dyn MemoryRegion>,
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
/// (a data-path worker slow to let go) may still hold — and go first. Fields drop in
/// release order, should garbage be dropped as it is.
#[derive(Default)]
pub struct Garbage {
    pub windows: Vec<TakenWindow>,
    /// Registrations in sessions' own domains: their rkeys reach memory the way windows
    /// do, so they go as early, even when the regions' own registrations go later.
    pub registrations: Vec<Arc<dyn MemoryRegion>>,
    pub qps: Vec<Arc<QueuePairRecord>>,
    /// Removed regions' registrations, each with what it holds of quotas and pools.
    pub freed: Vec<Freed>,
    /// Sessions' own protection domains nothing is in any more.
    pub domains: Vec<Arc<dyn ProtectionDomain>>,
}

/// A removed region's registration (which keeps its memory), and what the region holds of
/// its owner's quota and of its pool until the registration is gone: given back
/// ([`Registry::settle`]) only once nothing else holds the registration — a request still
/// in flight on a data path pins it — so the memory a user holds never exceeds its quota.
pub struct Freed {
    pub mr: Arc<dyn MemoryRegion>,
    /// The region's registrations in its session's own domains, which hold the same
    /// memory: released with the teardown (their rkeys die at once), but a request of a QP
    /// in one of those domains may still hold one.
    pub domain_registrations: Vec<std::sync::Weak<dyn MemoryRegion>>,
    pub settlement: Option<Settlement>,
}

impl Freed {
    /// Lets go of those of `freed` nothing else holds (the last holder of its registration,
    /// which goes with it, and its memory: see [`Freed::unpinned`]); returns what they held
    /// of quotas and pools, to settle, and the others, still held.
    pub fn let_go(freed: Vec<Freed>) -> (Vec<Settlement>, Vec<Freed>) {
        let (now, held): (Vec<Freed>, Vec<Freed>) = freed.into_iter().partition(Freed::unpinned);
        let settlements = now
            .into_iter()
            .filter_map(|f| {
                drop(f.mr);
                f.settlement
            })
            .collect();
        (settlements, held)
    }

    /// Whether nothing but this holds the region's memory any more — its own registration
    /// held by this alone, none of its domain registrations by anything: once so, nothing
    /// can take them again (the registry and every rights snapshot let go of them before),
    /// so dropping this releases the registration and its memory.
    pub fn unpinned(&self) -> bool {
        Arc::strong_count(&self.mr) == 1
            && self
                .domain_registrations
                .iter()
                .all(|r| r.strong_count() == 0)
    }
}

/// What a removed region still holds until its registration and memory are gone: one
/// region and its bytes of its owner's quota, and its bytes of its pool.
pub struct Settlement {
    uid: u32,
    size: u64,
    pool: Arc<Pool>,
}

/// What a teardown took out of the registry: what it removed, for the D-Bus layer, and
/// the device objects the engine must release, outside the lock and in order (windows,
/// then — once the data-path workers let go of the removed QPs — the QPs, then the
/// registrations; see `Engine::release`).
#[must_use = "the engine releases what a teardown removed"]
pub struct Teardown<'a> {
    pub removed: Removed,
    pub garbage: Garbage,
    /// Dropped last: the removed sessions count as sessions until then.
    pub releasing: Releasing<'a>,
}

/// Sessions taken out of the registry whose objects are still being released: they count
/// as sessions ([`Registry::counts`]) until this is dropped, so that whoever sees the count
/// of sessions drop also sees what they held released: provider objects, pool space.
pub struct Releasing<'a> {
    registry: &'a Registry,
    sessions: usize,
}

impl Drop for Releasing<'_> {
    fn drop(&mut self) {
        if self.sessions > 0 {
            self.registry.lock().releasing -= self.sessions;
        }
    }
}

impl Garbage {
    fn extend(&mut self, other: Garbage) {
        self.windows.extend(other.windows);
        self.registrations.extend(other.registrations);
        self.qps.extend(other.qps);
        self.freed.extend(other.freed);
        self.domains.extend(other.domains);
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

#[derive(Debug, Default)]
pub struct Registry {
    state: Mutex<State>,
}

/// The registry's state, locked. While it is held, user and group lookups (NSS, which may
/// block on a directory server) are a bug, checked in debug builds: see
/// [`crate::lock::check_lookup`].
struct Locked<'a> {
    // Field order is drop order: the lock is released, then lookups are allowed again.
    state: std::sync::MutexGuard<'a, State>,
    _no_lookups: crate::lock::Forbidden,
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
            _no_lookups: crate::lock::forbid_lookups(),
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

    /// Hands out what a teardown took out under the lock `s`, counting the sessions it
    /// removed as sessions until the engine has released it all.
    fn teardown<'a>(
        &'a self,
        mut s: Locked<'_>,
        removed: Removed,
        garbage: Garbage,
    ) -> Teardown<'a> {
        let sessions = removed.sessions.len();
        s.releasing += sessions;
        drop(s);
        Teardown {
            removed,
            garbage,
            releasing: Releasing {
                registry: self,
                sessions,
            },
        }
    }

    pub fn qp_count(&self) -> usize {
        self.lock().qps.len()
    }

    /// Live usage of `uid` (zero when it holds nothing).
    pub fn usage(&self, uid: u32) -> Usage {
        self.lock().usage.get(&uid).copied().unwrap_or_default()
    }

    fn forget_idle_user(s: &mut State, uid: u32) {
        if s.usage.get(&uid).is_some_and(Usage::is_zero) {
            s.usage.remove(&uid);
        }
    }

    /// Checks `amount` more of `kind` against `limits` (those of the user they name) and
    /// reserves them, in one step under the lock; [`Registry::unreserve`] gives them back if
    /// the creation fails.
    pub fn reserve(
        &self,
        limits: &Limits,
        kind: QuotaKind,
        amount: u64,
    ) -> Result<(), EngineError> {
        let mut s = self.lock();
        let usage = s.usage.entry(limits.uid).or_default();
        let checked = tenancy::check(limits, usage, kind, amount);
        if checked.is_ok() {
            usage.add(kind, amount);
        }
        Self::forget_idle_user(&mut s, limits.uid);
        checked.map_err(EngineError::from)
    }

    /// Gives back what removed regions held of quotas and pools, now that their
    /// registrations and memory are gone.
    pub fn settle(&self, settlements: impl IntoIterator<Item = Settlement>) {
        for Settlement { uid, size, pool } in settlements {
            self.unreserve(
                uid,
                &[(QuotaKind::Regions, 1), (QuotaKind::RegisteredBytes, size)],
            );
            pool.release(size);
        }
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
}
