//! Opening and closing sessions; a session's objects go with it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::SystemTime;

use crate::engine::datapath::validate::{RegionRight, RegionRights};

use super::*;

impl Registry {
    /// Opens a session for `owner`, within `limits` (its user's).
    pub fn open_session(&self, owner: &Owner, limits: &Limits) -> Result<SessionId, EngineError> {
        let mut s = self.lock();
        let usage = s.usage.entry(owner.uid).or_default();
        tenancy::check(limits, usage, QuotaKind::Sessions, 1)?;
        usage.add(QuotaKind::Sessions, 1);
        s.last_session = s.last_session.next();
        let id = s.last_session;
        s.sessions.insert(
            id,
            Session {
                owner: owner.clone(),
                created: SystemTime::now(),
                regions: BTreeSet::new(),
                attachments: BTreeMap::new(),
                qps: BTreeSet::new(),
                domains: BTreeMap::new(),
                rights: Arc::default(),
            },
        );
        Ok(id)
    }

    /// Closes a session: the owner connection, another process of the same user, or one
    /// whose scope is everyone's may.
    pub fn close_session(
        &self,
        owner: &Owner,
        scope: Scope,
        id: SessionId,
    ) -> Result<Teardown<'_>, EngineError> {
        let mut s = self.lock();
        let session = s
            .sessions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("session {id}")))?;
        if session.owner.uid != owner.uid && scope != Scope::All {
            return Err(not_authorized(format!(
                "session {id} belongs to another user; only its owner or an administrator may close it"
            )));
        }
        let mut stale = BTreeSet::new();
        let (removed, garbage) = Self::take_session(&mut s, id, &mut stale);
        Self::refresh_all(&s, stale);
        Ok(self.teardown(s, removed, garbage))
    }

    /// Closes every session of a bus connection that left the bus.
    pub fn close_sessions_of(&self, connection: &str) -> Teardown<'_> {
        self.close_where(|session| session.owner.connection == connection)
    }

    /// Closes everything (shutdown).
    pub fn close_all(&self) -> Teardown<'_> {
        self.close_where(|_| true)
    }

    pub(super) fn close_where(&self, pick: impl Fn(&Session) -> bool) -> Teardown<'_> {
        let mut s = self.lock();
        let ids: Vec<SessionId> = s
            .sessions
            .iter()
            .filter(|(_, session)| pick(session))
            .map(|(id, _)| *id)
            .collect();
        let mut all = Removed::default();
        let mut garbage = Garbage::default();
        let mut stale = BTreeSet::new();
        for id in ids {
            let (removed, g) = Self::take_session(&mut s, id, &mut stale);
            all.extend(removed);
            garbage.extend(g);
        }
        Self::refresh_all(&s, stale);
        self.teardown(s, all, garbage)
    }

    /// Removes session `id` with everything in it, leaving the rights of the other sessions
    /// that attached its regions to rebuild (added to `stale`, see
    /// [`Registry::take_region`]).
    pub(super) fn take_session(
        s: &mut State,
        id: SessionId,
        stale: &mut BTreeSet<SessionId>,
    ) -> (Removed, Garbage) {
        let mut removed = Removed::default();
        let mut garbage = Garbage::default();
        let Some(session) = s.sessions.remove(&id) else {
            return (removed, garbage);
        };
        removed.sessions.push(id);
        // Its queue pairs (which a worker slow to let go may still serve) touch nothing
        // from now on.
        session.rights.store(RegionRights::default());
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
            if let Some(g) = Self::take_region(s, region, stale) {
                garbage.extend(g);
                removed.regions.push(region);
            }
        }
        // Whatever was in its domains is gone with its regions and queue pairs.
        garbage
            .domains
            .extend(session.domains.into_values().map(|d| d.pd));
        if let Some(usage) = s.usage.get_mut(&session.owner.uid) {
            usage.sub(QuotaKind::Sessions, 1);
        }
        Self::forget_idle_user(s, session.owner.uid);
        (removed, garbage)
    }

    /// [`Registry::refresh_rights`] of each of `sessions` (still open), once.
    pub(super) fn refresh_all(s: &State, sessions: BTreeSet<SessionId>) {
        for session in sessions {
            Self::refresh_rights(s, session);
        }
    }

    /// Replaces the data-path rights of `session` (if it is open) with what it may touch
    /// now: its own regions read-write, attached regions as their key allowed. Called under
    /// the lock by every change to them (see [`SessionRights`] for the rule).
    pub(super) fn refresh_rights(s: &State, session: SessionId) {
        let Some(x) = s.sessions.get(&session) else {
            return;
        };
        #[cfg(test)]
        s.rights_rebuilt
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let owned = x.regions.iter().map(|id| (*id, true));
        let attached = x
            .attachments
            .iter()
            .map(|(id, mode)| (*id, *mode == AttachMode::ReadWrite));
        let rights = owned
            .chain(attached)
            .filter_map(|(id, writable)| {
                let region = s.regions.get(&id)?;
                let mr = Arc::clone(&region.mr);
                // Registrations are their own session's: an attaching session's queue pairs
                // are in none of its domains.
                let in_domains = if region.session == session {
                    Self::registrations_of(s, id)
                } else {
                    Vec::new()
                };
                Some((
                    id,
                    RegionRight {
                        mr,
                        writable,
                        in_domains,
                    },
                ))
            })
            .collect();
        x.rights.store(rights);
    }

    /// What the session's QPs may touch now, as the data path sees it.
    #[cfg(test)]
    pub fn session_rights(&self, session: SessionId) -> Option<Arc<RegionRights>> {
        Some(self.lock().sessions.get(&session)?.rights.load())
    }

    /// Whether `owner`'s connection owns session `id` (the error says why not).
    pub fn check_own_session(&self, owner: &Owner, id: SessionId) -> Result<(), EngineError> {
        Self::own_session(&mut self.lock(), owner, id).map(|_| ())
    }

    /// The session, if `owner`'s connection owns it.
    pub(super) fn own_session<'a>(
        s: &'a mut State,
        owner: &Owner,
        id: SessionId,
    ) -> Result<&'a mut Session, EngineError> {
        let session = s
            .sessions
            .get_mut(&id)
            .ok_or(EngineError::NoSuchObject(format!("session {id}")))?;
        if session.owner.connection != owner.connection {
            return Err(not_authorized(format!(
                "session {id} belongs to another connection; use the session you opened"
            )));
        }
        Ok(session)
    }
}
