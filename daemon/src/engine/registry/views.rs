//! What a caller may see: snapshots of sessions, regions, queue pairs and quotas.

use std::sync::Arc;
use std::time::SystemTime;

use super::*;

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

impl Registry {
    pub(super) fn session_info(id: SessionId, session: &Session, s: &State) -> SessionInfo {
        SessionInfo {
            id,
            uid: session.owner.uid,
            bus_name: session.owner.connection.clone(),
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

    /// Sessions `viewer` may see: its user's, or all when its scope is everyone's.
    pub fn sessions(&self, viewer: &Owner, scope: Scope) -> Vec<SessionInfo> {
        let s = self.lock();
        s.sessions
            .iter()
            .filter(|(_, x)| scope == Scope::All || x.owner.uid == viewer.uid)
            .map(|(id, x)| Self::session_info(*id, x, &s))
            .collect()
    }

    /// A session `viewer` may see (see [`Registry::sessions`]).
    pub fn session(
        &self,
        viewer: &Owner,
        scope: Scope,
        id: SessionId,
    ) -> Result<SessionInfo, EngineError> {
        let s = self.lock();
        let x = s
            .sessions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("session {id}")))?;
        if x.owner.uid != viewer.uid && scope != Scope::All {
            return Err(not_authorized(format!(
                "session {id} belongs to another user"
            )));
        }
        Ok(Self::session_info(id, x, &s))
    }

    pub(super) fn region_info(id: RegionId, r: &Region, s: &State) -> RegionInfo {
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

    pub(super) fn may_see_region(s: &State, r: &Region, viewer: &Owner, scope: Scope) -> bool {
        scope == Scope::All
            || r.owner_uid == viewer.uid
            || r.attached.keys().any(|sid| {
                s.sessions
                    .get(sid)
                    .is_some_and(|x| x.owner.uid == viewer.uid)
            })
    }

    /// Regions `viewer` may see: its user's, those attached by its user, or all when its
    /// scope is everyone's.
    pub fn regions(&self, viewer: &Owner, scope: Scope) -> Vec<RegionInfo> {
        let s = self.lock();
        s.regions
            .iter()
            .filter(|(_, r)| Self::may_see_region(&s, r, viewer, scope))
            .map(|(id, r)| Self::region_info(*id, r, &s))
            .collect()
    }

    /// A region `viewer` may see (see [`Registry::regions`]).
    pub fn region(
        &self,
        viewer: &Owner,
        scope: Scope,
        id: RegionId,
    ) -> Result<RegionInfo, EngineError> {
        let s = self.lock();
        let r = s
            .regions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("region {id}")))?;
        if !Self::may_see_region(&s, r, viewer, scope) {
            return Err(not_authorized(format!(
                "region {id} belongs to another user"
            )));
        }
        Ok(Self::region_info(id, r, &s))
    }

    /// Queue pairs `viewer` may see: its user's, or all when its scope is everyone's.
    pub fn qps(&self, viewer: &Owner, scope: Scope) -> Vec<(QpId, Arc<QueuePairRecord>)> {
        self.lock()
            .qps
            .iter()
            .filter(|(_, q)| scope == Scope::All || q.owner_uid == viewer.uid)
            .map(|(id, q)| (*id, Arc::clone(q)))
            .collect()
    }

    /// The limits of the user `limits` are for, next to its live use.
    pub fn quota(&self, limits: &Limits) -> Vec<QuotaLine> {
        let usage = self.usage(limits.uid);
        QuotaKind::ALL
            .iter()
            .map(|&kind| QuotaLine {
                kind,
                limit: limits.get(kind).value,
                used: usage.get(kind),
                source: limits.get(kind).source.clone(),
            })
            .collect()
    }
}
